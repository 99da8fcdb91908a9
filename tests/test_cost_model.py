"""lab/cost_model.py: the speedup model of Leviathan et al. (chain), its tree form and the step-cost prediction."""
import math

import pytest
import torch
import torch.nn as nn

import tree
from lab import cost_model as cm
from medusa_mini import GPT, GPTConfig


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95])
@pytest.mark.parametrize("gamma", [0, 1, 4, 9])
def test_free_drafts_give_the_expected_tokens(alpha, gamma):
    chain = [(0,) * k for k in range(1, gamma + 1)]
    expected = tree.expected_tokens_per_step(chain, [[alpha]] * max(gamma, 1)) if gamma else 1.0
    assert cm.chain_speedup(alpha, gamma, 0.0) == pytest.approx(expected)
    assert cm.expected_tokens(alpha, gamma) == pytest.approx(sum(alpha ** k for k in range(gamma + 1)))


def test_a_draft_cost_divides_by_gamma_c_plus_one():
    assert cm.chain_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.4))
    assert cm.chain_speedup(1.0, 3, 0.5) == pytest.approx(4 / 2.5)


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.9, 0.99])
@pytest.mark.parametrize("c", [0.01, 0.05, 0.2, 0.6, 1.5])
def test_best_gamma_is_the_argmax(alpha, c):
    gamma, speedup = cm.best_gamma(alpha, c, max_gamma=40)
    brute = [cm.chain_speedup(alpha, g, c) for g in range(41)]
    assert speedup == pytest.approx(max(brute)) and brute[gamma] == speedup
    if alpha <= c:  # Leviathan et al., corollary 3.9: drafting pays only where alpha > c
        assert gamma == 0 and speedup == 1


def test_best_gamma_grows_as_drafts_get_cheaper():
    gammas = [cm.best_gamma(0.8, c)[0] for c in (0.5, 0.2, 0.05, 0.01)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]


@pytest.mark.parametrize("theta", [0.0, 0.02, 0.1, 0.4, 0.9])
@pytest.mark.parametrize("c", [0.0, 0.05, 0.3])
def test_the_limit_bounds_every_tree(theta, c):
    if theta + c == 0:
        return
    limit = cm.speedup_limit(theta, c)
    for depth in range(1, 200, 7):
        for nodes in (depth, 2 * depth, 8 * depth):
            for tau in (1.0, 1 + depth / 2, 1 + depth):          # at most one token per depth, and the root's
                s = cm.tree_speedup(tau, 1 + theta * nodes, c * depth)
                assert s <= limit + 1e-12 if theta + c <= 1 else s < 1
    if theta + c < 1:  # and a deep chain that accepts everything comes near it
        assert cm.tree_speedup(1 + 10 ** 6, 1 + theta * 10 ** 6, c * 10 ** 6) == pytest.approx(limit, rel=1e-4)


def test_chain_speedup_is_a_tree_speedup():
    tau = cm.expected_tokens(0.7, 5)
    assert cm.tree_speedup(tau, 1.0, 5 * 0.1) == pytest.approx(cm.chain_speedup(0.7, 5, 0.1))


def test_weight_bytes_counts_tied_weights_once_and_converts_dtypes():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=8))
    n = sum(p.numel() for p in {id(p): p for p in gpt.parameters()}.values())
    assert cm.weight_bytes(gpt) == 4 * n
    assert cm.weight_bytes(gpt, torch.bfloat16) == 2 * n
    assert cm.read_bytes(gpt) == cm.weight_bytes(gpt) - 4 * 16 * 8   # the position table: a row a pass
    with torch.device("meta"):
        meta = nn.Linear(8, 3)
    assert cm.weight_bytes(meta, torch.bfloat16) == 2 * 27


@pytest.mark.parametrize("fixed", [0.0, 1e-4, 1e-3])
def test_predicted_step_is_one_without_drafting_and_grows_with_draft_passes(fixed):
    kwargs = dict(base_bytes=4e6, bandwidth=1e10, fixed=fixed)
    assert cm.predicted_step(**kwargs) == pytest.approx(1.0)
    steps = [cm.predicted_step(**kwargs, draft_bytes=1e6, draft_passes=d) for d in range(6)]
    assert all(a < b for a, b in zip(steps, steps[1:]))
    if fixed == 0:  # memory-bound: a step is its bytes over a plain pass's
        assert steps[4] == pytest.approx(1 + 4 * 1e6 / 4e6)
    assert cm.predicted_step(**kwargs, once_bytes=2e6) == pytest.approx(1 + 2e6 / 1e10 / (fixed + 4e-4))
    assert cm.predicted_step(**kwargs, verify=1.5) == pytest.approx(1.5)
    cheap = cm.predicted_step(**kwargs, draft_bytes=1e6, draft_passes=3, draft_fixed=0.0)
    assert cheap == pytest.approx(1 + 3e-4 / (fixed + 4e-4)) and cheap <= steps[3]


def test_a_deeper_base_makes_the_same_draft_layer_cheap():
    """EAGLE's point: one layer plus the lm_head per depth costs a large share of a shallow base, a small one of
    a deep base."""
    layer, head = 1e6, 2e6
    shallow = cm.predicted_step(4 * layer + head, 1e10, 0.0, layer + head, 4)
    deep = cm.predicted_step(32 * layer + head, 1e10, 0.0, layer + head, 4)
    assert shallow > 3 * (deep - 1) + 1 and math.isclose(deep, 1 + 4 * 3 / 34)
