"""Medusa decoding against plain decoding: greedy equality, typical acceptance, exact sampling, errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import PERIOD, assert_same_tokens, random_medusa, tiny_config
from medusa_mini import GPT, MedusaModel, evaluate_posterior, generate, medusa_generate, medusa_loss
from tree import dense_tree

TREES = {
    "dense_2x2x2": dense_tree([2, 2, 2]),
    "chain_4": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "sparse": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1)],
    # grow_tree([[0.7, 0.1, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1, 0.05], [0.4, 0.1, 0.05]], 20), written
    # out so that this file imports even where grow_tree is an assignment's stub.
    "grown_20": [(0,), (0, 0), (0, 0, 0), (1,), (0, 0, 0, 0), (0, 1), (1, 0), (2,), (0, 0, 1), (0, 2), (0, 1, 0),
                 (2, 0), (1, 0, 0), (0, 0, 2), (0, 0, 0, 1), (0, 2, 0), (0, 0, 1, 0), (2, 0, 0), (0, 1, 0, 0),
                 (1, 0, 0, 0)],
}


@pytest.mark.parametrize("tree", TREES)
def test_greedy_medusa_equals_plain_greedy_on_a_trained_model(periodic_model, tree, device):
    """Token for token identical to plain greedy, while steps really commit several tokens."""
    for prompt in ([3, 17], [29, 11, 2, 23], [8]):
        idx = torch.tensor([prompt], device=device)
        n = 40
        plain = generate(periodic_model, idx, n)
        fast, stats = medusa_generate(periodic_model, idx, n, TREES[tree])
        assert_same_tokens(fast, plain, periodic_model)
        assert stats.tokens_per_step > 2.0
        assert len(stats.token_depths) == n == sum(a + 1 for a in stats.accept_lengths)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_medusa_equals_plain_greedy_on_a_random_model(seed, device):
    """Equality also holds when the heads are mostly wrong (acceptance near zero)."""
    model = random_medusa(seed).to(device)
    idx = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(seed)).to(device)
    fast, stats = medusa_generate(model, idx, 30, TREES["sparse"])
    assert_same_tokens(fast, generate(model, idx, 30), model)
    assert stats.steps >= 10


def test_exactly_max_new_tokens_up_to_the_end_of_the_context(periodic_model):
    """The tree is cut near the end: exactly max_new_tokens, the last one at position block_size - 1."""
    idx = torch.tensor([PERIOD[:4]])
    block = periodic_model.base.config.block_size
    for n in (1, 2, 3, block - 4):
        out, stats = medusa_generate(periodic_model, idx, n, TREES["chain_4"])
        assert out.shape == (1, 4 + n) and len(stats.token_depths) == n
        assert torch.equal(out, generate(periodic_model, idx, n))
    assert max(stats.token_depths) == 4 and stats.token_depths[0] == 0


def test_token_depths_name_the_proposing_head(periodic_model):
    """Each step's committed tokens come from depths 0, 1, ..., accept_length."""
    _, stats = medusa_generate(periodic_model, torch.tensor([[3]]), 30, TREES["chain_4"])
    expected = [d for a in stats.accept_lengths for d in range(a + 1)]
    assert stats.token_depths == expected and stats.steps == len(stats.accept_lengths)


# ---------------------------------------------------------------- typical acceptance, hand-made logits

def logits_from_probs(rows):
    """(P, L, V) logits whose softmax at temperature 1 is exactly the given probabilities."""
    return torch.tensor(rows, dtype=torch.float).log()


def test_typical_threshold_is_min_of_epsilon_and_alpha_exp_minus_entropy():
    """Accept iff p(candidate) > min(epsilon, alpha * exp(-H)): checked on both sides of the threshold."""
    probs = [0.5, 0.3, 0.2]
    H = -sum(p * math.log(p) for p in probs)
    alpha = 0.3
    thr = alpha * math.exp(-H)  # about 0.107, below epsilon = 0.5 below
    logits = logits_from_probs([[probs, probs]])  # one row: root, then one draft scored by logits[0, 0]
    for p_token, token in [(0.2, 2), (0.3, 1)]:
        accept = evaluate_posterior(logits, torch.tensor([[0, token]]), 1.0, 0.5, alpha)[1]
        assert accept == int(p_token > thr)
    # Now epsilon is the smaller term: 0.25 < p = 0.3 accepts, 0.2 does not.
    assert evaluate_posterior(logits, torch.tensor([[0, 1]]), 1.0, 0.25, 1.0)[1] == 1
    assert evaluate_posterior(logits, torch.tensor([[0, 2]]), 1.0, 0.25, 1.0)[1] == 0
    # Low entropy: alpha * exp(-H) > epsilon, so epsilon decides.
    sharp = logits_from_probs([[[0.96, 0.03, 0.01], [0.96, 0.03, 0.01]]])
    assert evaluate_posterior(sharp, torch.tensor([[0, 1]]), 1.0, 0.02, 0.9)[1] == 1
    assert evaluate_posterior(sharp, torch.tensor([[0, 2]]), 1.0, 0.02, 0.9)[1] == 0


def test_typical_comparison_is_strict():
    """p(candidate) exactly at the threshold is rejected."""
    logits = logits_from_probs([[[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]])
    assert evaluate_posterior(logits, torch.tensor([[0, 1]]), 1.0, 0.25, 1.0)[1] == 0
    assert evaluate_posterior(logits, torch.tensor([[0, 0]]), 1.0, 0.25, 1.0)[1] == 1


def test_typical_ties_broken_by_log_likelihood():
    """Among rows with the longest accept length, the one with the larger sum of log p wins."""
    p = [0.4, 0.35, 0.25]
    logits = logits_from_probs([[p, p, p]] * 3)
    candidates = torch.tensor([[0, 2, 2], [0, 0, 1], [0, 1, 0]])  # all accept 2 (threshold 0.09)
    best, accept = evaluate_posterior(logits, candidates, 1.0)
    assert (best, accept) == (1, 2)  # rows 1 and 2 tie exactly (0.4 * 0.35): the first wins
    candidates = torch.tensor([[0, 2, 2], [0, 1, 1], [0, 0, 1]])
    assert evaluate_posterior(logits, candidates, 1.0) == (2, 2)


def test_typical_argmax_always_passes():
    """The argmax token is accepted whatever the entropy, epsilon and alpha < 1."""
    torch.manual_seed(0)
    for scale in (0.01, 0.1, 1.0, 10.0):
        logits = torch.randn(4, 3, 50) * scale
        candidates = torch.cat([torch.zeros(4, 1, dtype=torch.long), logits[:, :-1].argmax(-1)], dim=1)
        for eps, alpha in [(0.09, 0.3), (0.9, 0.99), (1.0, 0.5)]:
            assert evaluate_posterior(logits, candidates, 1.0, eps, alpha)[1] == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_is_never_accepted(temperature):
    """A padded slot is never accepted, even when its filler token is what the model predicts."""
    logits = torch.full((2, 3, 5), -10.0)
    logits[:, :, 0] = 10.0  # the model is sure the next token is 0 everywhere
    candidates = torch.tensor([[0, 0, 0], [0, 1, 0]])
    assert evaluate_posterior(logits, candidates, temperature, path_lengths=torch.tensor([2, 3]))[1] == 1
    assert evaluate_posterior(logits[:1], torch.tensor([[0, 0, -1]]), temperature)[1] == 1


def test_greedy_picks_the_first_longest_row():
    """Greedy: accept length is the max over rows; best is the first row reaching it (row 0 if none)."""
    logits = torch.zeros(3, 3, 4)
    logits[:, :, 2] = 1.0
    assert evaluate_posterior(logits, torch.tensor([[0, 1, 1], [0, 2, 1], [0, 2, 2]])) == (2, 2)
    assert evaluate_posterior(logits, torch.tensor([[0, 1, 1], [0, 2, 2], [0, 2, 2]])) == (1, 2)
    assert evaluate_posterior(logits[:2], torch.tensor([[0, 1, 1], [0, 3, 2]])) == (0, 0)


@pytest.mark.parametrize("sampling", ["typical", "typical-fast"])
def test_typical_mode_runs_end_to_end(periodic_model, device, sampling):
    """Typical acceptance produces max_new_tokens tokens and accepts drafts on a confident model."""
    torch.manual_seed(0)
    out, stats = medusa_generate(periodic_model, torch.tensor([[3, 17]], device=device), 40, TREES["sparse"],
                                 temperature=0.7, sampling=sampling)
    assert out.shape == (1, 42) and stats.tokens_per_step > 2.0


def test_typical_fast_is_deterministic_and_typical_samples_the_root():
    """typical-fast takes the argmax root and is the same for every seed; typical draws the root
    from the model, so on a model that is unsure its output varies with the seed."""
    model, idx = random_medusa(0), torch.tensor([[1, 2, 3]])
    def run(seed, sampling):
        torch.manual_seed(seed)
        return medusa_generate(model, idx, 20, TREES["sparse"], temperature=1.0, sampling=sampling)[0]
    assert all(torch.equal(run(s, "typical-fast"), run(0, "typical-fast")) for s in range(1, 4))
    assert len({tuple(run(s, "typical")[0].tolist()) for s in range(4)}) > 1


# ---------------------------------------------------------------- exact sampling: a statistical test

V_SMALL = 4


MARKOV = torch.tensor([[0.05, 0.70, 0.15, 0.10],  # next-token probabilities given the previous token
                       [0.50, 0.05, 0.05, 0.40],
                       [0.10, 0.10, 0.20, 0.60],
                       [0.30, 0.30, 0.35, 0.05]])


def skewed_model():
    """A 4-token model trained on a Markov chain: far from uniform, and x2 depends strongly on x1."""
    torch.manual_seed(0)
    model = MedusaModel(GPT(tiny_config(vocab_size=V_SMALL, block_size=8)), num_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        seq = [torch.randint(0, V_SMALL, (64,))]
        for _ in range(8):
            seq.append(torch.multinomial(MARKOV[seq[-1]], 1)[:, 0])
        seq = torch.stack(seq, 1)                                    # (64, 9)
        base_logits, head_logits = model(seq[:, :-1])
        loss = F.cross_entropy(base_logits.flatten(0, 1), seq[:, 1:].flatten())
        loss = loss + medusa_loss(head_logits, seq[:, 1:])[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def true_joint(model, prompt, T):
    """p(x1, x2 | prompt) at temperature T, from the model itself: (V, V)."""
    p1 = F.softmax(model.base(prompt)[0, -1] / T, -1)
    rows = [F.softmax(model.base(torch.cat([prompt, torch.tensor([[a]], device=prompt.device)], 1))[0, -1] / T, -1)
            for a in range(V_SMALL)]
    return (p1[:, None] * torch.stack(rows)).cpu()


def chi_square_p_value(counts, probs):
    """Pearson's chi-square goodness of fit; cells expecting < 5 draws are pooled."""
    n = counts.sum()
    expected = probs.flatten() * n
    observed = counts.flatten().double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


def test_exact_sampling_matches_the_models_joint_distribution(device):
    """The first two tokens of exact Medusa sampling follow the model's own p(x1) p(x2 | x1).

    False alarm rate 1e-3 (chi-square). Power: a uniform sampler and one that draws x2 without
    looking at x1 are both rejected by the same test at the same sample size."""
    torch.manual_seed(1)
    model, T, n = skewed_model().to(device), 1.0, 3000
    prompt = torch.tensor([[1, 2]], device=device)
    with torch.no_grad():
        joint = true_joint(model, prompt, T).double()
    independent_joint = joint.sum(1, keepdim=True) * joint.sum(0)
    assert 0.5 * (joint - 1 / V_SMALL**2).abs().sum() > 0.2    # total variation from uniform
    assert 0.5 * (joint - independent_joint).abs().sum() > 0.1  # ... and from p(x1) p(x2)
    tree = [(0,), (1,), (0, 0)]
    counts, accepted = torch.zeros(V_SMALL, V_SMALL), 0
    for _ in range(n):
        out, stats = medusa_generate(model, prompt, 2, tree, temperature=T, sampling="exact")
        counts[out[0, 2], out[0, 3]] += 1
        accepted += stats.accept_lengths[0]
    assert accepted > n / 10  # the walk really accepted drafted tokens, not only roots
    assert chi_square_p_value(counts, joint) > 1e-3

    g = torch.Generator().manual_seed(2)
    uniform = torch.randint(0, V_SMALL**2, (n,), generator=g).bincount(minlength=V_SMALL**2).float()
    assert chi_square_p_value(uniform, joint) < 1e-3
    x1 = torch.multinomial(joint.sum(1).float(), n, replacement=True, generator=g)
    x2 = torch.multinomial(joint.sum(0).float(), n, replacement=True, generator=g)  # ignores x1
    independent = (x1 * V_SMALL + x2).bincount(minlength=V_SMALL**2).float()
    assert chi_square_p_value(independent, joint) < 1e-3


def test_exact_sampling_is_lossless_by_construction_at_length_one():
    """With one new token, exact sampling is plain sampling: same draws for the same seed."""
    model = skewed_model()
    torch.manual_seed(5)
    a = medusa_generate(model, torch.tensor([[1]]), 1, [(0,)], temperature=0.9, sampling="exact")[0]
    torch.manual_seed(5)
    assert torch.equal(a, generate(model, torch.tensor([[1]]), 1, temperature=0.9))


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, message", [
    (dict(choices=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]), "only 4 heads"),
    (dict(choices=[(0,), (40,)]), "vocabulary"),
    (dict(choices=[(0,), (1, 0)]), "prefix-closed"),
    (dict(choices=[(0,)], max_new_tokens=62), "does not fit"),
    (dict(choices=[(0,)], temperature=-1.0), "temperature"),
    (dict(choices=[(0,)], temperature=1.0, sampling="nucleus"), "sampling"),
    (dict(choices=[(0,)], max_new_tokens=0), "at least 1"),
])
def test_bad_requests_raise_clear_errors(kwargs, message):
    """Trees the heads cannot supply, prompts that do not fit, bad temperature or sampling mode."""
    args = dict(max_new_tokens=5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        medusa_generate(random_medusa(), torch.tensor([[1, 2, 3]]), **args)
