"""EAGLE-3 (eagle3.py): the layers it reads, its draft layer on both bases, its training-time test, and
decoding through the shared verifier: greedy output equal to plain greedy's, the model's own distribution
when sampling (exact), and the training-time test's mask checked against what decoding sees."""
import pytest
import torch
import torch.nn.functional as F

import smollm
from conftest import assert_same_tokens, tiny_config, trained_once
from eagle3 import Eagle3Model, GrowingCache, feature_layers, ttt_loss
from feature_drafter import DynamicTree, chain_mask, feature_generate, unroll
import feature_drafter
from kv_cache import KVCache
from medusa_mini import GPT, generate
from test_decoding import MARKOV, V_SMALL, skewed_model
from test_distribution import N_DRAWS, assert_follows
from lab.distribution import true_joint

STATIC = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


def test_the_layers_it_reads():
    """The reference's rule where it gives three distinct layers in order (SmolLM2: 2, 15, 27, what the engines
    assume); spread evenly over a smaller base (the tiny GPT's 4 layers: 1, 2, 3)."""
    assert feature_layers(30) == (2, 15, 27) and feature_layers(32) == (2, 16, 29)
    assert feature_layers(4) == (1, 2, 3) and feature_layers(2) == (0, 1, 2) and feature_layers(6) == (1, 3, 5)
    for n in range(2, 40):
        low, mid, high = feature_layers(n)
        assert 0 <= low < mid < high <= n, (n, feature_layers(n))


def random_eagle3(seed=0, scale=4.0, **kw):
    """An untrained base scaled as tests/test_eagle.py's, and an EAGLE-3 layer as initialised, over all tokens."""
    torch.manual_seed(seed)
    model = Eagle3Model(GPT(tiny_config(**kw)))
    with torch.no_grad():
        for p in model.base.parameters():
            p.mul_(scale)
    model.set_vocab(torch.arange(model.base.config.vocab_size))
    return model.eval()


def test_the_base_gives_the_features_it_reads_from_the_forward_that_verifies():
    """hidden(taps=...) returns the residual stream entering those layers, from the same forward: equal to hooking
    the blocks' inputs, and the last hidden states unchanged."""
    base = random_eagle3(n_layer=4).base
    x = torch.randint(0, 32, (2, 9))
    seen = []
    hooks = [block.register_forward_pre_hook(lambda m, args: seen.append(args[0])) for block in base.h]
    h, features = base.hidden(x, taps=(1, 2, 3))
    for hook in hooks:
        hook.remove()
    assert torch.equal(h, base.hidden(x)) and features.shape == (2, 9, 3 * base.config.n_embd)
    assert torch.equal(features, torch.cat(seen[1:4], -1))


def test_its_accuracies_are_read_with_the_features_it_reads():
    """The accuracies a tree is grown from, given the base's last hidden states (what EAGLE reads, and what
    SmolLM2's distillation keeps), are refused in one line rather than computed wrong: EAGLE-3 reads three layers.
    Given none, they are those of its own features, from one forward."""
    from feature_drafter import chain_accuracies
    model = random_eagle3(n_layer=4)
    seq = torch.randint(0, 32, (2, 12))
    with pytest.raises(ValueError, match="wide: this drafter reads"):
        chain_accuracies(model, seq, 0, 3, 1, features=model.base.hidden(seq))
    tapped = model.base.hidden(seq, taps=model.taps)[1]
    assert chain_accuracies(model, seq, 0, 3, 1) == chain_accuracies(model, seq, 0, 3, 1, features=tapped)


@pytest.mark.parametrize("tree", [STATIC, DynamicTree(topk=3, nodes=10, depth=4)], ids=["static", "dynamic"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_eagle3_equals_plain_greedy_on_a_random_gpt(tree, seed, device):
    model = random_eagle3(seed, block_size=64).to(device)
    idx = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(seed)).to(device)
    fast, stats = feature_generate(model, idx, 50, tree)
    assert_same_tokens(fast, generate(model.base, idx, 50), model.base, stats, 5)


def test_greedy_eagle3_equals_plain_greedy_on_a_random_llama():
    """On a Llama of SmolLM2's kind (RoPE, grouped-query attention, RMSNorm): its draft layer is a Llama block
    whose attention reads 2C, and a drafting vocabulary of its own (token = id + d2t[id])."""
    torch.manual_seed(0)
    cfg = smollm.LlamaConfig(vocab_size=48, block_size=64, n_layer=8, n_head=4, n_kv_head=2, n_embd=32, n_hidden=64)
    base = smollm.Llama(cfg).eval()
    model = Eagle3Model(base, draft_vocab_size=20)
    assert model.taps == (2, 4, 5)
    model.set_vocab(torch.arange(0, 40, 2))                                 # drafts even tokens only
    assert model.draft_ids.tolist() == list(range(0, 40, 2)) and int(model.t2d.sum()) == 20
    idx = torch.randint(0, 48, (1, 6), generator=torch.Generator().manual_seed(3))
    for tree in (STATIC, DynamicTree(topk=2, nodes=6, depth=3)):
        fast, stats = feature_generate(model.eval(), idx, 30, tree)
        assert_same_tokens(fast, generate(base, idx, 30), base, stats, 6)


def naive_chain(model, features, seq, depth, t):
    """What decoding computes for the text's path from position t, one entry at a time on a fresh cache: the
    layer over the true features up to t (causal), then, step by step, its own previous output at t with the
    next token, at position t + j, seeing its true entries and its own chain (nothing is masked). (depth, C)."""
    base, layer = model.base, model.layers[0]
    cache = KVCache(base.config, capacity=t + 1 + depth, n_layer=1)
    out = layer(base, features[None, :t + 1], seq[None, 1:t + 2], torch.arange(t + 1), None, cache)[0, -1:]
    outs = [out]
    for j in range(1, depth):
        out = layer(base, out[None], seq[None, t + 1 + j:t + 2 + j], torch.tensor([t + j]), None, cache)[0]
        outs.append(out)
    return torch.cat(outs)


def training_steps_match_decoding(model, steps=3):
    """Whether the training-time test's unrolled steps (feature_drafter.unroll with chain_mask, on a cache that keeps
    gradients) give, at every position, what decoding computes along the text's path (naive_chain)."""
    seq = torch.randint(0, 32, (1, 14), generator=torch.Generator().manual_seed(2))
    features = model.base.hidden(seq, taps=model.taps)[1]
    outs = [out for _, out in unroll(model, seq, steps, features, new_cache=GrowingCache)]  # steps x (1, n, C)
    n = outs[0].size(1)
    for t in range(n):
        expected = naive_chain(model, features[0], seq[0], steps, t)        # (steps, C)
        got = torch.stack([out[0, t] for out in outs])
        if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
            return False
    return True


def test_the_training_time_test_sees_what_decoding_sees():
    """Step j at position t sees the true entries up to t and its own chain at t: what the layer sees when it
    drafts depth j + 1 (feature_drafter.chain_mask); with gradients through every step's keys."""
    model = random_eagle3(block_size=64).requires_grad_(True)
    assert training_steps_match_decoding(model)
    seq = torch.randint(0, 32, (2, 12))
    features = model.base.hidden(seq, taps=model.taps)[1].detach()
    out = list(unroll(model, seq, 3, features, new_cache=GrowingCache))[-1][1]
    out.sum().backward()
    assert model.eagle3.fc.weight.grad is not None and model.eagle3.fc.weight.grad.abs().sum() > 0


def test_a_training_mask_that_shows_a_step_other_positions_is_caught(monkeypatch):
    """The planted bug: each step's entries seeing the earlier steps' entries at other positions (causally, as the
    true ones) instead of only their own chain's. The check above must catch it."""
    def leaky(n, chains, device=None):
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return torch.cat([causal] * (chains + 1), 1)
    monkeypatch.setattr(feature_drafter, "chain_mask", leaky)
    assert not training_steps_match_decoding(random_eagle3(block_size=64)), "a leaky training mask went unnoticed"


def test_the_loss_is_the_base_distribution_t_plus_j_ahead():
    """ttt_loss's step 0 is the soft cross-entropy from the base's next-token distribution at t + 1 to the layer's,
    over its vocabulary (here all tokens, each a top token of the base: every position counts)."""
    model = random_eagle3(block_size=64)
    seq = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(0))
    h, features = model.base.hidden(seq[:, :-1], taps=model.taps)
    y = seq[:, 1:]
    loss, agree = ttt_loss(model, features, y, h, steps=1)
    n = y.size(1) - 1
    out = next(unroll(model, torch.cat([seq[:, :1], y], 1), 1, features))[1]    # (4, n, C)
    logq = F.log_softmax(F.linear(model.eagle3.norm(out), model.eagle3.lm_head.weight), -1)
    p = F.softmax(model.base.lm_head(h[:, 1:1 + n]), -1)
    assert torch.allclose(loss, -(p * logq).sum(-1).mean(), atol=1e-5)
    assert agree.shape == (1,) and 0 <= float(agree[0]) <= 1


@trained_once
def skewed_eagle3():
    """An EAGLE-3 layer on tests/test_decoding.py's skewed model, trained a few seconds with the training-time test."""
    torch.manual_seed(0)
    base = skewed_model().base.requires_grad_(False)
    model = Eagle3Model(base)
    model.set_vocab(torch.arange(V_SMALL))
    opt = torch.optim.AdamW(model.eagle3.parameters(), lr=1e-2)
    for _ in range(40):
        seq = [torch.randint(0, V_SMALL, (64,))]
        for _ in range(8):
            seq.append(torch.multinomial(MARKOV[seq[-1]], 1)[:, 0])
        seq = torch.stack(seq, 1)                                    # (64, 9)
        with torch.no_grad():
            h, features = base.hidden(seq[:, :-1], taps=model.taps)
        loss, _ = ttt_loss(model, features, seq[:, 1:], h, steps=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_exact_sampling_with_eagle3_draws_what_plain_sampling_draws():
    model, prompt = skewed_eagle3(), torch.tensor([[1, 2]])
    accepted = 0
    for seed in range(100):
        torch.manual_seed(seed)
        out, stats = feature_generate(model, prompt, 6, DynamicTree(topk=2, nodes=4, depth=2), temperature=0.7,
                                      sampling="exact")
        torch.manual_seed(seed)
        assert torch.equal(out, generate(model.base, prompt, 6, temperature=0.7)), f"seed {seed}"
        accepted += sum(stats.accept_lengths)
    assert accepted > 100, f"the walk accepted {accepted} drafted tokens in 100 generations: it must walk the tree"


def test_exact_sampling_with_eagle3_matches_the_models_joint_distribution():
    """The chi-square family (lab/distribution.py) on the first three tokens drawn with EAGLE-3's trees."""
    torch.manual_seed(1)
    model, prompt = skewed_eagle3(), torch.tensor([[1, 2]])
    joint = true_joint(model.base, prompt, 0.7, 3, V_SMALL)
    counts = torch.zeros(V_SMALL, V_SMALL, V_SMALL)
    tree = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    for _ in range(N_DRAWS):
        out, _ = feature_generate(model, prompt, 3, tree, temperature=0.7, sampling="exact")
        counts[tuple(out[0, 2:].tolist())] += 1
    assert_follows(counts, joint, "exact sampling with EAGLE-3")


def test_its_vocabulary_maps_draft_ids_to_tokens():
    torch.manual_seed(0)
    model = Eagle3Model(GPT(tiny_config()), draft_vocab_size=4)
    ids = torch.tensor([31, 3, 17, 5])
    model.set_vocab(ids)  # sorted, offsets, and the head started from the base's rows for them
    assert model.draft_ids.tolist() == [3, 5, 17, 31] and model.d2t.tolist() == [3, 4, 15, 28]
    assert model.t2d.nonzero().flatten().tolist() == [3, 5, 17, 31]
    assert torch.equal(model.eagle3.lm_head.weight, model.base.lm_head.weight[[3, 5, 17, 31]])
    w, token_ids = model.token_head()
    assert w.shape == (4, model.base.config.n_embd) and token_ids.tolist() == [3, 5, 17, 31]
    assert chain_mask(3, 2).int().tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0],
                                                [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_the_training_time_test_is_what_makes_deep_drafts_right(capsys):
    """What the training-time test is for. Two EAGLE-3 layers on the same tiny GPT (tests/conftest.py's periodic
    model), trained with the same number of layer passes (the clock-free stand-in for equal training time): k = 4
    steps unrolled, 30 batches; k = 1 (no test), 120 batches. Drafting a chain on their own predictions, the
    layer trained without it has never been fed its own output (only fc's fused features) and is right at
    depth 1 alone; the one trained with it drafts depths 3 and deeper right too. Both are printed; the check
    is on the direction, far from what noise moves (measured: 0.99 and above against 0.00)."""
    from conftest import periodic_batch, train_periodic_model
    from feature_drafter import chain_accuracies
    base = train_periodic_model().base.requires_grad_(False)

    def trained(k, batches):
        torch.manual_seed(0)
        model = Eagle3Model(base)
        model.set_vocab(torch.arange(base.config.vocab_size))
        opt = torch.optim.AdamW(model.eagle3.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        for _ in range(batches):
            xy = periodic_batch(16, 32, g)
            with torch.no_grad():
                h, features = base.hidden(xy[:, :-1], taps=model.taps)
            loss, _ = ttt_loss(model, features, xy[:, 1:], h, steps=k)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.eval()
    text = periodic_batch(8, 40, torch.Generator().manual_seed(5))
    top1 = {k: [a[0] for a in chain_accuracies(trained(k, batches), text, 0, 5, 1)] for k, batches in ((1, 120), (4, 30))}
    with capsys.disabled():
        print(f"\nEAGLE-3 top-1 by depth on its own predictions: k=1 {top1[1]}, k=4 {top1[4]}")
    assert min(top1[4][2:4]) > max(top1[1][2:4]), top1
