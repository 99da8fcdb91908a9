"""The GPT, its KV cache and the Medusa heads (medusa_mini.py)."""
import math

import pytest
import torch

from conftest import periodic_batch, random_medusa, tiny_config
from medusa_mini import GPT, HeadStack, MedusaDrafter, MedusaModel, generate, medusa_loss
from kv_cache import KVCache
from verify import prefill, verify_step
from tree import build_tree_buffers, dense_tree


@pytest.mark.parametrize("cfg", [dict(), dict(n_layer=1, n_head=1, n_embd=16, vocab_size=7),
                                 dict(n_layer=3, n_head=4, n_embd=64, vocab_size=100)])
@pytest.mark.parametrize("T", [1, 5, 17])
def test_zero_init_heads_equal_base_exactly(cfg, T, device):
    """At initialisation every head's logits are torch.equal to the base logits (W1 = 0 and b1 = 0)."""
    torch.manual_seed(T)
    model = MedusaModel(GPT(tiny_config(**cfg)).to(device), num_heads=5).eval()
    idx = torch.randint(0, model.base.config.vocab_size, (2, T), device=device)
    base_logits, head_logits = model(idx)
    assert head_logits.shape == (5, 2, T, model.base.config.vocab_size), f"head logits {tuple(head_logits.shape)}"
    for k in range(5):
        diff = (head_logits[k] - base_logits).abs()
        assert torch.equal(head_logits[k], base_logits), (
            f"head {k + 1} differs from the base logits at init by up to {diff.max().item():.3g} (batch, position, "
            f"token) = {tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))}: zero W1 and b1, copy W2")
    assert model.heads[0] is not model.heads[1], "heads 1 and 2 are one module: build them with a comprehension"


def test_medusa_loss_targets_token_t_plus_k_plus_1():
    """On the sequence 0, 1, 2, ... head k at position t must score token t+k+1: loss ~0 there, large when shifted."""
    K, T, V = 3, 10, 20
    x = torch.arange(T + 1)
    targets = x[1:].view(1, T)  # targets[:, t] = token t+1

    def confident(offset):  # head k (1-based) at position t puts all its mass on token t+k+offset
        logits = torch.full((K, 1, T, V), -30.0)
        for k in range(1, K + 1):
            for t in range(T):
                logits[k - 1, 0, t, min(t + k + offset, V - 1)] = 30.0
        return logits

    loss, per_head = medusa_loss(confident(1), targets)
    assert per_head.shape == (K,), f"per-head losses of shape {tuple(per_head.shape)}, expected ({K},)"
    assert per_head.max() < 1e-6, (f"per-head losses {per_head.tolist()} when head k at position t is sure of "
                                   f"token t+k+1 (targets[:, t + k]): expected ~0 for every head")
    # The total weighs head k by decay**k (paper eq. 1: 0.8^k).
    uniform = torch.zeros(K, 1, T, V)
    loss, per_head = medusa_loss(uniform, targets, decay=0.5)
    assert torch.allclose(per_head, torch.full((K,), math.log(V))), \
        f"uniform logits: per-head losses {per_head.tolist()}, expected log V = {math.log(V):.4f} each"
    expected = math.log(V) * (0.5 + 0.25 + 0.125)
    assert torch.isclose(loss, torch.tensor(expected)), \
        f"total {loss.item():.4f}, expected {expected:.4f} = log V * (0.5 + 0.5^2 + 0.5^3): head k weighs decay**k"
    with pytest.raises(ValueError, match="longer than the number of heads"):
        medusa_loss(torch.zeros(K, 1, K, V), targets[:, :K])
    for offset, says in [(0, "t+k"), (2, "t+k+2")]:
        shifted = medusa_loss(confident(offset), targets)[1]
        assert shifted.min() > 10, (f"heads sure of token {says} got per-head losses {shifted.tolist()}: "
                                    f"the loss must score head k at position t against token t+k+1 only")


def test_trained_heads_guess_t_plus_k_plus_1(periodic_model):
    """Heads trained with your loss (tests/conftest.py, a few seconds on a periodic sequence) learn
    what they are for: head k at position t puts its top guess on token t+k+1, nearly always."""
    seq = periodic_batch(8, 24, torch.Generator().manual_seed(3))                 # (8, 25)
    seq = seq.to(periodic_model.base.lm_head.weight.device)
    with torch.no_grad():
        _, head_logits = periodic_model(seq[:, :-1])                             # (K, 8, 24, V)
    for k in range(1, head_logits.size(0) + 1):
        guess, truth = head_logits[k - 1, :, :24 - k].argmax(-1), seq[:, k + 1:]  # (8, 24-k): tokens t+k+1
        accuracy = (guess == truth).float().mean().item()
        if accuracy < 0.95:
            early = (guess == seq[:, k:24]).float().mean().item()
            raise AssertionError(f"head {k} guesses token t+{k + 1} right {accuracy:.0%} of the time, expected > 95%; "
                                 f"it guesses t+{k} {early:.0%} of the time: is head k trained on targets[:, t + k]?")


def test_cached_forward_equals_uncached():
    """Prefill + one token at a time through the KV cache gives the plain causal forward's logits."""
    model = random_medusa().base
    idx = torch.randint(0, 32, (1, 20))
    full = model(idx)[0]
    cache = KVCache(model.config)
    steps = [model(idx[:, :8], cache=cache)[0]] + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(8, 20)]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=0,
                               msg=lambda m: f"cached logits (prefill of 8, then one token at a time) differ: {m}")


CHAIN = [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
IRREGULAR = [(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (0, 1, 0), (0, 1, 1), (0, 1, 1, 0)]


@pytest.mark.parametrize("choices", [dense_tree([2, 3]), dense_tree([3, 2, 2]), CHAIN, IRREGULAR])
@pytest.mark.parametrize("prefix", [0, 7])
def test_tree_forward_equals_per_path_forward(choices, prefix, device):
    """Logits at every tree node equal those of running its root-to-node path with a plain causal forward."""
    torch.manual_seed(prefix)
    model = random_medusa().base.to(device)
    b = build_tree_buffers(choices, device)
    tokens = torch.randint(0, 32, (len(b.node_paths),)).to(device)
    committed = torch.randint(0, 32, (1, prefix)).to(device)
    cache = KVCache(model.config, extra=len(tokens), device=device)
    if prefix:
        model(committed, cache=cache)
    tree_logits = model(tokens.view(1, -1), b.position_ids + prefix, b.attn_mask, cache)[0]  # (N, V)
    index = {p: i for i, p in enumerate(b.node_paths)}
    for i, path in enumerate(b.node_paths):
        path_tokens = tokens[[index[path[:k]] for k in range(len(path) + 1)]].view(1, -1)
        plain = model(torch.cat([committed, path_tokens], dim=1))[0, -1]
        torch.testing.assert_close(tree_logits[i], plain, atol=1e-5, rtol=0, msg=lambda m: (
            f"node {i}, path {path}, after {prefix} committed tokens: its logits differ from a plain forward of "
            f"its own path (does the mask show it exactly its ancestors, at position ids = depth?): {m}"))


def test_cache_keep_and_rollback():
    """keep() moves the chosen newest entries into contiguous slots; rollback() forgets entries."""
    cfg = tiny_config(n_layer=1, n_head=1, n_embd=4)
    cache = KVCache(cfg, extra=4)
    for t in range(6):
        entry = torch.full((1, 1, 1, 4), float(t))
        cache.append(0, entry, entry)
        cache.advance(1)
    cache.keep(2, torch.tensor([0, 2, 3]))  # keep entries 2, 4, 5 after the first two
    assert cache.length == 5, f"keep(2, [0, 2, 3]) left length {cache.length}, expected 2 + 3 = 5"
    for name, t in (("keys", cache.k), ("values", cache.v)):
        slots = t[0, 0, 0, :5, 0].tolist()
        assert slots == [0, 1, 2, 4, 5], (f"keep(2, [0, 2, 3]): {name} in slots 0-4 hold entries {slots}, expected "
                                          f"[0, 1, 2, 4, 5] (indices count from `start`, the first slot kept)")
    cache.rollback(3)
    assert cache.length == 3, f"rollback(3) left length {cache.length}"
    keys, _ = cache.append(0, torch.full((1, 1, 1, 4), 9.0), torch.zeros(1, 1, 1, 4))
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 9], \
        f"after rollback(3) an append returned keys {keys[0, 0, :, 0].tolist()}, expected [0, 1, 2, 9]"
    with pytest.raises(ValueError, match="full"):
        cache.append(0, torch.zeros(1, 1, 70, 4), torch.zeros(1, 1, 70, 4))


@pytest.mark.parametrize("temperature, sampling", [(0.0, "typical"), (0.8, "typical"), (0.8, "typical-fast"),
                                                   (0.8, "exact")])
def test_cache_after_medusa_steps_equals_plain_decoding(periodic_model, temperature, sampling, device):
    """After any number of steps the cache holds exactly the entries plain decoding builds for the committed tokens."""
    torch.manual_seed(1)
    model = periodic_model
    drafter = MedusaDrafter(model, dense_tree([2, 2, 1]), device)
    state, h = prefill(model.base, torch.tensor([[3, 17, 5]], device=device), extra=drafter.nodes)
    drafter.start(state, h)
    if sampling == "exact":
        state.root = state.logits.argmax()
    for step in range(5):
        verify_step(model.base, drafter, state, 3, temperature, sampling)
        S = state.tokens.size(1)
        plain = KVCache(model.base.config, device=device)
        model.base(state.tokens[:, :3], cache=plain)
        for t in range(3, S):
            model.base(state.tokens[:, t:t + 1], cache=plain)
        assert state.cache.length == plain.length == S, \
            f"step {step}: the cache holds {state.cache.length} entries for {S} committed tokens"
        for name, ours, theirs in (("keys", state.cache.k, plain.k), ("values", state.cache.v, plain.v)):
            bad = ((ours[:, :, :, :S] - theirs[:, :, :, :S]).abs() > 1e-5).nonzero()
            assert len(bad) == 0, (
                f"step {step}: cached {name} of committed token {int(bad[0, 3])} (prompt of 3, so new token "
                f"{int(bad[0, 3]) - 3}) differ from those plain decoding builds, first in layer {int(bad[0, 0])}; "
                f"slots differing: {sorted(set(bad[:, 3].tolist()))}")
        torch.testing.assert_close(state.logits, model.base(state.tokens)[0, -1], atol=1e-5, rtol=0, msg=lambda m: (
            f"step {step}: the next logits are not the base logits at the last committed token: {m}"))


def test_positions_past_the_table_raise():
    """Nothing indexes past the position table: a clear error instead of an index error inside torch."""
    model = random_medusa().base
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="does not fit"):
        generate(model, torch.zeros(1, 60, dtype=torch.long), 5)


def test_batched_generate_equals_one_prompt_at_a_time():
    """generate on a batch of prompts (used for self-distillation) gives each row's own greedy output."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    prompts = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(0))
    batched = generate(model, prompts, 10)
    for row in range(3):
        assert torch.equal(batched[row], generate(model, prompts[row:row + 1], 10)[0])


# ---------------------------------------------------------------- devices, with CPU stand-ins

@pytest.mark.parametrize("share_lm_head", [False, True])
def test_heads_take_the_base_models_dtype_and_device(share_lm_head):
    """Heads are made where the base lives, in its dtype: a bf16 base and a base on the `meta`
    device (stand-ins for a GPU) give heads of the same dtype and device, and in bf16 the
    zero-initialised heads still equal the base logits exactly."""
    torch.manual_seed(0)
    bf16 = MedusaModel(GPT(tiny_config()).to(torch.bfloat16), num_heads=3, share_lm_head=share_lm_head).eval()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    base_logits, head_logits = bf16(torch.randint(0, 32, (2, 7)))
    assert all(torch.equal(head_logits[k], base_logits) for k in range(3))
    with torch.device("meta"):
        base = GPT(tiny_config())
    meta = MedusaModel(base, num_heads=3, share_lm_head=share_lm_head)
    assert {p.device.type for p in meta.parameters()} == {"meta"}


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_stacked_heads_equal_head_logits(share_lm_head):
    """HeadStack, the heads in four ops for decoding, gives head_logits' values."""
    torch.manual_seed(0)
    model = MedusaModel(GPT(tiny_config()), num_heads=4, share_lm_head=share_lm_head).eval()
    for head in model.heads:
        torch.nn.init.normal_(head.residual.weight, std=0.3)
        torch.nn.init.normal_(head.residual.bias, std=0.3)
    h = torch.randn(32)
    for depth in (1, 4):
        torch.testing.assert_close(HeadStack(model)(h, depth), model.head_logits(h, depth), atol=1e-5, rtol=1e-5)
    assert share_lm_head == all(head.proj is None for head in model.heads)
    model.draft_vocab = torch.tensor([1, 5, 6, 30])  # drafting from four tokens: the rest read -inf
    subset = HeadStack(model)(h, 4)
    torch.testing.assert_close(subset[:, model.draft_vocab], model.head_logits(h, 4)[:, model.draft_vocab], atol=1e-5, rtol=1e-5)
    assert (subset.isinf().sum(1) == model.base.config.vocab_size - 4).all()


def test_cheaper_drafts_leave_greedy_output_exact(periodic_model):
    """Drafting in bfloat16 (model.draft_dtype) or over part of the vocabulary (model.draft_vocab)
    changes only the proposals: bf16 head logits are close to fp32 ones with the same top guesses,
    the subset's logits equal the full ones on it and are -inf elsewhere, and greedy Medusa still
    equals plain greedy."""
    from conftest import assert_same_tokens
    from medusa_mini import medusa_generate
    model = periodic_model
    device = model.base.lm_head.weight.device
    idx = torch.tensor([[3, 17, 5]], device=device)
    plain = generate(model, idx, 40)
    h = model.base.hidden(idx)[0, -1]
    full = HeadStack(model)(h, len(model.heads))                              # (K, V)
    vocab = torch.arange(0, model.base.config.vocab_size, 2, device=device)   # every other token
    for dtype, subset in ((torch.bfloat16, None), (None, vocab), (torch.bfloat16, vocab)):
        model.draft_dtype, model.draft_vocab = dtype, subset
        try:
            drafts = HeadStack(model)(h, len(model.heads))
            out, stats = medusa_generate(model, idx, 40, [(0,), (1,), (0, 0), (0, 0, 0)])
        finally:
            model.draft_dtype, model.draft_vocab = None, None
        case = f"draft_dtype={dtype}, draft_vocab={'every other token' if subset is not None else None}"
        assert drafts.shape == full.shape and drafts.dtype == (dtype or full.dtype), case
        expected = full if subset is None else torch.full_like(full, float("-inf")).index_copy_(1, subset, full[:, subset])
        if dtype is None:
            assert torch.equal(drafts, expected), case
        else:
            torch.testing.assert_close(drafts.float(), expected, atol=0.1, rtol=0.02, msg=lambda m: f"{case}: {m}")
            assert torch.equal(drafts.argmax(-1), expected.argmax(-1)), f"{case}: bf16 changed the heads' top guesses"
        assert_same_tokens(out, plain, model, stats, 3)
    # 3 of the period's 9 tokens are even: drafts from that half still commit more than the root alone
    assert stats.tokens_per_step > 1.3, f"{stats.tokens_per_step:.2f} tokens/step drafting from half the vocabulary"


def test_divergence_report_gives_the_top2_margin():
    """When greedy outputs differ, the failure names the first divergent token and the margin there."""
    from conftest import assert_same_tokens
    model = random_medusa().base
    plain = generate(model, torch.tensor([[1, 2, 3]]), 6)
    other = plain.clone()
    other[0, 5] = (other[0, 5] + 1) % 32
    with pytest.raises(AssertionError, match="position 5.*margin"):
        assert_same_tokens(other, plain, model)
