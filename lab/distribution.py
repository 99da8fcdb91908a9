"""Whether exact sampling keeps the model's distribution: draws against the model's own probabilities (a
chi-square test of the joint and of every marginal and conditional), and the power of that test (a sampler
known to be off must fail it).
"""
import itertools

import torch


@torch.no_grad()
def true_joint(model, prompt, temperature, n, vocab):
    """p(x1, ..., xn | prompt) at the temperature, from the model itself, for a model with a `vocab`-token
    vocabulary small enough to enumerate every prefix: (vocab,) * n, float64."""
    base = getattr(model, "base", model)
    joint = torch.ones(1, dtype=torch.double)
    for k in range(n):
        prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=k)),
                                dtype=torch.long, device=prompt.device).view(vocab**k, k)  # (V^k, k)
        seqs = torch.cat([prompt.expand(len(prefixes), -1), prefixes], 1)                 # (V^k, S+k)
        p = torch.softmax(base(seqs)[:, -1].double() / temperature, -1)                   # (V^k, V)
        joint = (joint[:, None] * p.cpu()).flatten()
    return joint.view((vocab,) * n)


def pearson(observed, expected):
    """Pearson's chi-square statistic of observed counts against expected ones, and its degrees of freedom:
    cells expecting fewer than 5 draws pooled into one, when there are any (none when none is small: it
    would be 0 / 0), cells expecting none left out."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    stat, df = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1
    return stat, df


def survival(stat, df):
    """P(chi-square with df degrees of freedom > stat)."""
    if df <= 0:
        return 1.0
    half = torch.tensor([df / 2, stat / 2], dtype=torch.double)
    return float(torch.special.gammaincc(half[0], half[1]))


def chi_square(counts, probs):
    """Pearson's chi-square test of draws against the probabilities they should follow: counts and probs
    of the same shape. Cells expecting fewer than 5 draws are pooled into one, when there are any.

    Returns (p-value, the cell (an index into probs) contributing most, its observed and expected
    counts). A p-value far below the false alarm rate chosen says the draws do not follow the probabilities."""
    n = counts.sum()
    expected = probs.flatten().double() * n
    observed = counts.flatten().double()
    contribution = (observed - expected) ** 2 / expected
    worst = int(contribution.masked_fill(expected < 5, -1).argmax())
    p = survival(*pearson(observed, expected))
    cell = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), probs.shape))
    return p, cell, int(counts.flatten()[worst]), float(probs.flatten()[worst] * n)


def chi_square_family(counts, probs, alpha=1e-3):
    """Planned chi-square tests of draws of (x1, ..., xk) against the probabilities they should follow
    (counts and probs of shape (V,) * k): the joint, each token's marginal, and each token given the
    ones before it (x_j | x_<j: the per-prefix statistics and degrees of freedom summed). A shift of
    one token's marginal spreads over many cells in the joint test; its own marginal test sees it.
    Bonferroni: each test at alpha / (number of tests), so that a correct sampler fails any of them
    with probability at most alpha. Returns {"p": {test: p-value}, "level", "passed", "worst"}."""
    counts, probs = counts.double(), probs.double()
    k = probs.dim()
    p = {"joint": chi_square(counts, probs)[0]}
    for j in range(k):
        others = tuple(i for i in range(k) if i != j)
        c, q = (counts.sum(others), probs.sum(others)) if others else (counts, probs)
        p[f"x{j + 1}"] = survival(*pearson(c, c.sum() * q / q.sum()))
    for j in range(1, k):
        later = tuple(range(j + 1, k))
        c = (counts.sum(later) if later else counts).reshape(-1, probs.shape[j])   # (prefixes, V)
        q = (probs.sum(later) if later else probs).reshape(-1, probs.shape[j])
        stat, df = 0.0, 0
        for row_c, row_q in zip(c, q):
            if row_c.sum() > 0 and row_q.sum() > 0:
                s, d = pearson(row_c, row_c.sum() * row_q / row_q.sum())
                stat, df = stat + s, df + d
        p[f"x{j + 1} | x<{j + 1}"] = survival(stat, df)
    level = alpha / len(p)
    worst = min(p, key=p.get)
    return {"p": p, "level": level, "passed": p[worst] > level, "worst": worst}


def shifted_marginal(probs, shift=0.03):
    """probs (V,) * k with `shift` of x1's probability moved between its two likeliest values (where a move
    is hardest to see), each x1's continuations kept: a sampler that a test must reject."""
    p1 = probs.sum(tuple(range(1, probs.dim()))) if probs.dim() > 1 else probs
    a, b = p1.argsort(descending=True)[:2].tolist()
    q = probs.clone().double()
    q[a] *= (p1[a] - shift) / p1[a]
    q[b] *= (p1[b] + shift) / p1[b]
    return q


def draws_from(probs, n, generator=None):
    """Counts (shape of probs) of n draws straight from probs: a sampler known to be right (or wrong)."""
    index = torch.multinomial(probs.flatten().double(), n, replacement=True, generator=generator)
    return index.bincount(minlength=probs.numel()).view(probs.shape).double()
