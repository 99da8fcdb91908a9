"""What a speculative step should cost and gain, predicted from counts before any clock runs.

A chain (Leviathan, Kalman, Matias: Fast Inference from Transformers via Speculative Decoding, arXiv
2211.17192): a drafter proposes gamma tokens, each accepted with probability alpha, independently. A step
then commits (1 - alpha^(gamma+1)) / (1 - alpha) tokens on average (section 3.3). With each draft costing c
of a plain step, the expected speedup is that over (gamma c + 1) (section 3.4, theorem 3.8); one gamma
maximises it, and drafting pays at all only where alpha > c (section 3.4, corollary 3.9).

A tree (Medusa, EAGLE): tau(N) tokens a step from N drafted nodes, over r(N) + c_draft, where r(N) is the
cost of verifying the N + 1 tokens in one pass and c_draft the drafting, both in plain steps. Every cost
here is in units of one plain decoding step (one token's pass of the base model, the same dtype).
"""
import torch
import torch.nn as nn


def expected_tokens(alpha, gamma):
    """Tokens a chain of gamma drafts commits per step: 1 + alpha + ... + alpha^gamma (section 3.3)."""
    return gamma + 1.0 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def chain_speedup(alpha, gamma, c):
    """Expected speedup of a chain, (1 - a^(g+1)) / ((1 - a)(g c + 1)) (section 3.4, theorem 3.8): each of the
    gamma drafts costs c of a plain step, and verifying gamma + 1 tokens costs one plain step."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def best_gamma(alpha, c, max_gamma=32):
    """(gamma, speedup) of the gamma in 0..max_gamma that maximises chain_speedup (gamma 0: plain decoding)."""
    return max(((g, chain_speedup(alpha, g, c)) for g in range(max_gamma + 1)), key=lambda gs: gs[1])


def tree_speedup(tau, r, c):
    """Speedup of a step that commits tau tokens at a cost of r (verifying the tree in one pass) plus c
    (drafting it), both in plain steps: tau / (r + c)."""
    return tau / (r + c)


def speedup_limit(theta, c):
    """The most any drafter gains when verifying costs theta of a plain step per extra token and drafting c per
    depth of the draft (EAGLE: one pass per depth; Medusa's heads run once a step: c is that spread over the
    depth): 1 / (theta + c).

    Why: a step commits at most one token per depth plus the verifier's own, tau <= 1 + D, and with N >= D tokens
    verified it costs at least 1 + (theta + c) D. (1 + D) / (1 + k D) rises towards 1 / k as D grows when k <= 1.
    When k > 1 it is below 1 at every depth: no drafter of those costs pays."""
    return 1 / (theta + c)


def weight_bytes(module, dtype=None):
    """Bytes of a module's parameters, each counted once (a tied lm_head and embedding are one tensor), as
    stored, or in `dtype` if given. Works on a model built on the meta device (no weights needed)."""
    return _bytes({id(p): p for p in module.parameters()}.values(), dtype)


def _bytes(params, dtype=None):
    """Bytes of these parameters, as stored, or in `dtype` if given."""
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    return sum(p.numel() * (size or p.element_size()) for p in params)


def read_bytes(module, dtype=None):
    """Bytes of weights a one-token pass of `module` reads: weight_bytes without the embedding tables, of
    which a pass reads a row (a table tied to an output head is read whole, as the head)."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    skipped = [p for p in {id(p): p for p in module.parameters()}.values() if id(p) in tables - heads]
    return weight_bytes(module, dtype) - _bytes(skipped, dtype)


def pass_seconds(nbytes, bandwidth, fixed=0.0):
    """Seconds of one pass that reads nbytes of weights at bandwidth (bytes/s), after a fixed cost (s) for
    everything that does not scale with the bytes (Python, dispatch, kernel launches)."""
    return fixed + nbytes / bandwidth


def predicted_step(base_bytes, bandwidth, fixed, draft_bytes=0.0, draft_passes=0, draft_fixed=None,
                   once_bytes=0.0, verify=1.0):
    """A speculative step's cost in plain steps, from byte counts: plain numbers, so any base serves.

    A plain step is one pass of the base: pass_seconds(base_bytes, bandwidth, fixed). A speculative step is
    - the verification: `verify` plain steps (1: memory-bound, N + 1 tokens read the weights once, as one
      does; or a measured r(N));
    - draft_passes passes of the drafter, each reading draft_bytes, after draft_fixed seconds (default:
      fixed, a base pass's own fixed cost);
    - once_bytes read once a step, outside those passes.
    What to pass: Medusa, its heads' bytes once a step (draft_passes=1, draft_bytes=the heads). EAGLE, one
    pass per depth of the tree, each reading its layer and the lm_head (draft_passes=depth). EAGLE-3 the same,
    with its own lm_head, and its fc over the three fused features read once (once_bytes=fc). bandwidth in
    bytes/s, fixed and draft_fixed in seconds, bytes in the dtype decoding reads them (weight_bytes, read_bytes).
    Where a pass is mostly its bytes (SmolLM2), fixed = draft_fixed = 0 gives the bytes-only prediction, whatever
    the bandwidth: verify + (draft_passes x draft_bytes + once_bytes) / base_bytes.
    """
    plain = pass_seconds(base_bytes, bandwidth, fixed)
    draft_fixed = fixed if draft_fixed is None else draft_fixed
    drafting = draft_passes * pass_seconds(draft_bytes, bandwidth, draft_fixed) + once_bytes / bandwidth
    return verify + drafting / plain
