"""Corpus, BPE tokenizer and token cache (lab/data.py)."""
import base64

import numpy as np
import pytest
import requests
import tiktoken

from lab import data

AWKWARD = [
    "", " ", "\n", "   \t\t  \n\n\r\n  ", "  trailing spaces  ", "héllo, wörld — ½ café",
    "emoji 🦀👍🏽 and 日本語", "a\x00b\x7f", "ROMEO:\nO, she doth teach the torches to burn bright!\n\n",
]


@pytest.fixture(autouse=True)
def private_tiktoken_cache(tmp_path, monkeypatch):
    """tiktoken caches every file it loads; keep that cache inside the test's temp dir."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))


@pytest.fixture(scope="module")
def plays():
    return data.load_plays()


@pytest.fixture(scope="module")
def small_text(plays):
    return plays["macbeth"][:20_000]


@pytest.fixture(scope="module")
def ranks(small_text):
    return data.train_bpe(small_text, vocab_size=300)


def test_bpe_round_trips_awkward_text(ranks, small_text):
    """decode(encode(x)) == x for non-ASCII, emoji, empty and whitespace-only text."""
    enc = data.make_encoding(ranks)
    for text in AWKWARD + [small_text]:
        assert enc.decode(enc.encode_ordinary(text)) == text


def test_bpe_file_loads_back_identically(tmp_path, ranks, small_text):
    """A saved BPE loads as an encoding with the same n_vocab and the same ids for any text."""
    path = tmp_path / "bpe" / "vocab.tiktoken"
    path.parent.mkdir()
    data.save_bpe(ranks, str(path))
    lines = path.read_text().splitlines()
    assert len(lines) == 300 and lines[65] == f"{base64.b64encode(b'A').decode()} 65"
    assert [p.name for p in path.parent.iterdir()] == ["vocab.tiktoken"]  # no temp file left
    in_memory, loaded = data.make_encoding(ranks), data.load_bpe(str(path))
    assert loaded.n_vocab == in_memory.n_vocab == 300
    for text in AWKWARD + [small_text]:
        assert loaded.encode_ordinary(text) == in_memory.encode_ordinary(text)


def test_retrained_bpe_file_loads_fresh(tmp_path, ranks, small_text):
    """Loading a BPE file that was overwritten gives the new vocab, not tiktoken's cached copy."""
    path = str(tmp_path / "vocab.tiktoken")
    data.save_bpe(ranks, path)
    assert data.load_bpe(path).n_vocab == 300
    data.save_bpe(data.train_bpe(small_text, vocab_size=270), path)
    assert data.load_bpe(path).n_vocab == 270


def test_bpe_has_asked_vocab_and_compresses(ranks, plays):
    """Ranks are 0..vocab_size-1, bytes first, each merge built from earlier tokens; text shrinks."""
    assert sorted(ranks.values()) == list(range(300))
    assert all(ranks[bytes([b])] == b for b in range(256))
    for token, rank in ranks.items():
        if rank >= 256:
            assert any(ranks.get(token[:k], rank) < rank and ranks.get(token[k:], rank) < rank
                       for k in range(1, len(token)))
    unseen = plays["hamlet"][:20_000]  # not the training text
    assert len(data.make_encoding(ranks).encode_ordinary(unseen)) < 0.8 * len(unseen.encode())


def test_bpe_training_is_deterministic_and_ordered(ranks, small_text):
    """Training again gives the same ranks, and a smaller vocab is the first merges of a larger one."""
    assert data.train_bpe(small_text, vocab_size=300) == ranks
    assert data.train_bpe(small_text, vocab_size=280) == {t: r for t, r in ranks.items() if r < 280}


def test_bpe_rejects_impossible_vocab():
    """A vocab below 256 bytes, or more merges than the text allows, is a ValueError."""
    with pytest.raises(ValueError, match="at least 256"):
        data.train_bpe("some text", vocab_size=255)
    with pytest.raises(ValueError, match="too small"):
        data.train_bpe("ab ab", vocab_size=300)


def test_plays_load_clean(plays):
    """All 38 plays load, sorted and non-empty, as speaker lines and speech with no markdown left."""
    assert len(plays) == 38 and list(plays) == sorted(plays)
    for name, text in plays.items():
        assert len(text) > 50_000, name
        assert not any(ch in text for ch in "#*_[]\\"), name
    assert plays["macbeth"].startswith("First Witch:\nWhen shall we three meet again\n")
    assert "\n\nMACBETH:\nSo foul and fair a day I have not seen.\n\n" in plays["macbeth"]


def test_split_plays_holds_out_whole_plays(plays):
    """No play is in both halves, together they are all plays, and the seed fixes the split."""
    train, val = data.split_plays(plays, n_val=4, seed=0)
    assert len(val) == 4 and not set(train) & set(val) and sorted(train + val) == list(plays)
    assert data.split_plays(plays, n_val=4, seed=0) == (train, val)
    assert any(data.split_plays(plays, n_val=4, seed=s)[1] != val for s in range(1, 4))


@pytest.mark.parametrize("n_val", [0, 38, -1])
def test_split_plays_rejects_bad_n_val(plays, n_val):
    """Holding out no play, or every play, is a ValueError."""
    with pytest.raises(ValueError, match="n_val"):
        data.split_plays(plays, n_val=n_val, seed=0)


def test_read_text_file_explains_bad_files(tmp_path):
    """Empty, whitespace-only and non-UTF-8 files, a folder and a missing file: one line (UsageError) naming
    the flag, the file and the problem."""
    from lab.cli import UsageError
    (tmp_path / "folder.txt").mkdir()
    for name, content, problem in [("empty.txt", b"", "empty"), ("blank.txt", b" \n\t\n", "empty"),
                                   ("latin1.txt", b"caf\xe9\n", "not UTF-8"), ("folder.txt", None, "a folder"),
                                   ("missing.txt", None, "no such file")]:
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(UsageError, match=problem) as err:
            data.read_text_file(str(path))
        assert str(err.value).startswith(f"--data {path}")
    good = tmp_path / "good.txt"
    good.write_bytes("To be,\r\nor not — 🦀\n".encode())
    assert data.read_text_file(str(good)) == "To be,\r\nor not — 🦀\n"


def test_split_text_holds_out_the_tail():
    """split_text keeps the text in order and holds out its last tenth by default."""
    text = "".join(f"line {i}\n" for i in range(100))
    train, val = data.split_text(text)
    assert train + val == text and len(val) == round(0.1 * len(text))
    with pytest.raises(ValueError):
        data.split_text("x")


def test_token_cache_reused_when_key_matches(tmp_path, ranks, small_text, monkeypatch):
    """A second call with the same text and tokenizer reads the cache instead of encoding."""
    enc, path = data.make_encoding(ranks), str(tmp_path / "tokens.npy")
    ids = data.encode_cached(enc, small_text, path)
    assert ids.dtype == np.uint16 and ids.tolist() == enc.encode_ordinary(small_text)

    def must_not_encode(text):
        raise AssertionError("cache was not reused")

    monkeypatch.setattr(enc, "encode_ordinary", must_not_encode)
    assert np.array_equal(data.encode_cached(enc, small_text, path), ids)


def test_token_cache_rebuilt_when_tokenizer_or_text_differs(tmp_path, ranks, small_text, plays):
    """Another vocab (even with the same name and size) or another text re-encodes."""
    path = str(tmp_path / "tokens.npy")
    data.encode_cached(data.make_encoding(ranks), small_text, path)
    other = data.make_encoding(data.train_bpe(plays["hamlet"][:20_000], vocab_size=300))
    assert data.encode_cached(other, small_text, path).tolist() == other.encode_ordinary(small_text)
    assert data.encode_cached(other, "new text", path).tolist() == other.encode_ordinary("new text")


def test_token_cache_uses_int32_beyond_uint16(tmp_path):
    """Ids that do not fit in uint16 are stored as int32, unchanged."""

    class BigVocab:  # stands in for a tokenizer with more than 65,536 tokens
        name, n_vocab = "big", 70_000

        def decode_single_token_bytes(self, i):
            return str(i).encode()

        def encode_ordinary(self, text):
            return [69_999] * len(text)

    ids = data.encode_cached(BigVocab(), "abc", str(tmp_path / "tokens.npy"))
    assert ids.dtype == np.int32 and ids.tolist() == [69_999] * 3


def test_gpt2_encoding_offline_gives_clear_error(monkeypatch):
    """When the GPT-2 files cannot be downloaded, the error says so and points to the BPE."""

    def offline(name):
        raise requests.exceptions.ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="could not download the GPT-2 tokenizer") as err:
        data.get_gpt2_encoding()
    assert "BPE tokenizer" in str(err.value) and isinstance(err.value.__cause__, requests.ConnectionError)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: f"encoding {name}")
    assert data.get_gpt2_encoding() == "encoding gpt2"
