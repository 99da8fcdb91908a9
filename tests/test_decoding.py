"""Medusa decoding against plain decoding: greedy equality, typical acceptance, exact sampling, errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import trained_once, PERIOD, assert_same_tokens, clock_model, random_medusa, tiny_config
from medusa_mini import GPT, MedusaModel, generate, medusa_generate, medusa_loss
from verify import evaluate_posterior, sample_tree_walk
from tree import build_tree_buffers, dense_tree

TREES = {
    "dense_2x2x2": dense_tree([2, 2, 2]),
    "chain_4": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "sparse": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1)],
    # grow_tree([[0.7, 0.1, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1, 0.05], [0.4, 0.1, 0.05]], 20), written
    # out: the trees these tests decode with do not depend on the code that grows them.
    "grown_20": [(0,), (0, 0), (0, 0, 0), (1,), (0, 0, 0, 0), (0, 1), (1, 0), (2,), (0, 0, 1), (0, 2), (0, 1, 0),
                 (2, 0), (1, 0, 0), (0, 0, 2), (0, 0, 0, 1), (0, 2, 0), (0, 0, 1, 0), (2, 0, 0), (0, 1, 0, 0),
                 (1, 0, 0, 0)],
}


@pytest.mark.parametrize("tree", TREES)
def test_greedy_medusa_equals_plain_greedy_on_a_trained_model(periodic_model, tree, device):
    """Token for token identical to plain greedy; and the heads of this model are perfect, so every
    step commits a full path of the tree (depth + 1 tokens), as many as the tree can give."""
    depth = max(map(len, TREES[tree]))
    for prompt in ([3, 17], [29, 11, 2, 23], [8]):
        idx = torch.tensor([prompt], device=device)
        n = 40  # a multiple of depth + 1 for every tree here: no step is cut short by the end
        plain = generate(periodic_model, idx, n)
        fast, stats = medusa_generate(periodic_model, idx, n, TREES[tree])
        assert_same_tokens(fast, plain, periodic_model, stats, len(prompt))
        assert len(stats.token_depths) == n == sum(a + 1 for a in stats.accept_lengths), \
            f"prompt {prompt}: {len(stats.token_depths)} token depths, accept lengths {stats.accept_lengths}"
        short = [(step, a) for step, a in enumerate(stats.accept_lengths) if a != depth]
        assert not short, (f"prompt {prompt}: step {short[0][0]} accepted {short[0][1]} tokens after the root, "
                           f"not {depth}: the heads are perfect here, so each step should take a whole path "
                           f"(are the next head logits taken at the last accepted node?); "
                           f"accept lengths {stats.accept_lengths}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_medusa_equals_plain_greedy_on_a_random_model(seed, device):
    """Equality also holds when the heads are mostly wrong (acceptance near zero)."""
    model = random_medusa(seed).to(device)
    idx = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(seed)).to(device)
    fast, stats = medusa_generate(model, idx, 30, TREES["sparse"])
    assert_same_tokens(fast, generate(model, idx, 30), model, stats, 5)
    assert stats.steps >= 10, f"30 tokens in {stats.steps} steps: random heads should rarely be accepted"


def test_exactly_max_new_tokens_up_to_the_end_of_the_context(periodic_model, device):
    """The tree is cut near the end: exactly max_new_tokens, the last one at position block_size - 1."""
    idx = torch.tensor([PERIOD[:4]], device=device)
    block = periodic_model.base.config.block_size
    for n in (1, 2, 3, block - 4):
        out, stats = medusa_generate(periodic_model, idx, n, TREES["chain_4"])
        assert out.shape == (1, 4 + n) and len(stats.token_depths) == n, \
            f"max_new_tokens={n}: output shape {tuple(out.shape)}, {len(stats.token_depths)} token depths"
        plain = generate(periodic_model, idx, n)
        assert_same_tokens(out, plain, periodic_model, stats, 4)
    assert max(stats.token_depths) == 4 and stats.token_depths[0] == 0, f"token depths {stats.token_depths}"


def test_token_depths_name_the_proposing_head(periodic_model, device):
    """Each step's committed tokens come from depths 0, 1, ..., accept_length."""
    _, stats = medusa_generate(periodic_model, torch.tensor([[3]], device=device), 30, TREES["chain_4"])
    expected = [d for a in stats.accept_lengths for d in range(a + 1)]
    assert stats.token_depths == expected, f"token depths {stats.token_depths} for accept lengths {stats.accept_lengths}"
    assert stats.steps == len(stats.accept_lengths), f"{stats.steps} steps, {len(stats.accept_lengths)} accept lengths"


# ---------------------------------------------------------------- a model that writes its own position

@pytest.mark.parametrize("tree", ["chain_4", "sparse"])
def test_tokens_sit_at_their_positions_after_the_prompt(tree):
    """Every tree node is verified at position S + depth. On tests/conftest.py's clock model the token
    at position t is t mod V, so a node placed one slot off comes out as the wrong number, whatever
    the tokens (a periodic model, which only looks at tokens, cannot show this)."""
    model = clock_model()
    V = model.base.config.vocab_size
    for S in (1, 6, 13):
        idx = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(S))
        out, stats = medusa_generate(model, idx, 30, TREES[tree])
        for i, token in enumerate(out[0, S:].tolist()):
            if token != (S + i) % V:
                off = (token - (S + i) + V // 2) % V - V // 2
                step = sum(1 for d in stats.token_depths[:i + 1] if d == 0) - 1
                raise AssertionError(
                    f"prompt of {S} tokens: new token {i} (step {step}, depth {stats.token_depths[i]}) is {token}, "
                    f"expected {(S + i) % V}: it was predicted from a node at prompt end + {i + off}, "
                    f"{off:+d} slot(s) from its place (the node that predicts new token i sits at S + i - 1)")


def test_perfect_heads_commit_depth_plus_one_tokens_every_step():
    """With perfect heads every step commits depth + 1 tokens: tokens/step is exactly 5.0 on a depth-4
    tree. Output that equals plain greedy is not enough: heads read at the wrong node cost steps."""
    model = clock_model()
    for tree in ("chain_4", "sparse", "grown_20"):
        _, stats = medusa_generate(model, torch.tensor([[5, 9]]), 40, TREES[tree])
        assert stats.tokens_per_step == 5.0, (
            f"{tree}: {stats.tokens_per_step:.2f} tokens/step, expected exactly 5.0; accept lengths per step "
            f"{stats.accept_lengths}: the next step's head logits must come from the last accepted node")


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
        assert accept == int(p_token > thr), (f"p = {p_token}, threshold min(0.5, {alpha} * exp(-H)) = {thr:.3f}: "
                                              f"accept length {accept}, expected {int(p_token > thr)}")
    # Now epsilon is the smaller term: 0.25 < p = 0.3 accepts, 0.2 does not.
    for token, p_token, expected in [(1, 0.3, 1), (2, 0.2, 0)]:
        accept = evaluate_posterior(logits, torch.tensor([[0, token]]), 1.0, 0.25, 1.0)[1]
        assert accept == expected, (f"p = {p_token}, threshold min(epsilon 0.25, 1.0 * exp(-H) = "
                                    f"{math.exp(-H):.3f}): accept length {accept}, expected {expected}")
    # Low entropy: alpha * exp(-H) > epsilon, so epsilon decides.
    sharp = logits_from_probs([[[0.96, 0.03, 0.01], [0.96, 0.03, 0.01]]])
    for token, p_token, expected in [(1, 0.03, 1), (2, 0.01, 0)]:
        accept = evaluate_posterior(sharp, torch.tensor([[0, token]]), 1.0, 0.02, 0.9)[1]
        assert accept == expected, (f"p = {p_token} on a sharp row, epsilon 0.02 < alpha * exp(-H): "
                                    f"accept length {accept}, expected {expected}")


def test_typical_comparison_is_strict():
    """p(candidate) exactly at the threshold is rejected."""
    logits = logits_from_probs([[[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]])
    accept = evaluate_posterior(logits, torch.tensor([[0, 1]]), 1.0, 0.25, 1.0)[1]
    assert accept == 0, f"p = 0.25 equal to the threshold 0.25 was accepted (accept length {accept}): use >, not >="
    accept = evaluate_posterior(logits, torch.tensor([[0, 0]]), 1.0, 0.25, 1.0)[1]
    assert accept == 1, f"p = 0.5 above the threshold 0.25: accept length {accept}, expected 1"


def test_typical_ties_broken_by_log_likelihood():
    """Among rows with the longest accept length, the one with the larger sum of log p wins."""
    p = [0.4, 0.35, 0.25]
    logits = logits_from_probs([[p, p, p]] * 3)
    candidates = torch.tensor([[0, 2, 2], [0, 0, 1], [0, 1, 0]])  # all accept 2 (threshold 0.09)
    got = tuple(evaluate_posterior(logits, candidates, 1.0)[:2])
    assert got == (1, 2), (f"(best row, accept length) = {got}, expected (1, 2): rows 0-2 all accept 2, "
                           f"rows 1 and 2 tie exactly (0.4 * 0.35) above row 0, and the first of a tie wins")
    candidates = torch.tensor([[0, 2, 2], [0, 1, 1], [0, 0, 1]])
    got = tuple(evaluate_posterior(logits, candidates, 1.0)[:2])
    assert got == (2, 2), f"(best row, accept length) = {got}, expected (2, 2): row 2 has the largest 0.4 * 0.35"


def at_temperature(rows, T):
    """(P, L, V) logits whose softmax at temperature T is exactly the given probabilities."""
    return torch.tensor(rows, dtype=torch.float).log() * T


def typical_accepts(p, token, epsilon=0.09, alpha=0.3):
    """The definition, in plain Python: p(token) > min(epsilon, alpha * exp(-H))."""
    H = -sum(q * math.log(q) for q in p if q > 0)
    return p[token] > min(epsilon, alpha * math.exp(-H))


@pytest.mark.parametrize("T", [0.5, 3.0])
def test_typical_acceptance_uses_the_temperature(T):
    """Typical acceptance reads softmax(logits / T), not softmax(logits): at T = 0.5 a token that
    temperature 1 would accept is rejected, and at T = 3 one that it would reject is accepted."""
    p_at_T = {0.5: [0.6, 0.35, 0.05], 3.0: [0.45, 0.35, 0.2]}[T]
    token = 2
    expected = int(typical_accepts(p_at_T, token))
    p_at_1 = F.softmax(torch.tensor(p_at_T).log() * T, -1).tolist()  # the same logits read at T = 1
    assert typical_accepts(p_at_1, token) != expected, "the test's own case must tell T from T = 1 apart"
    logits = at_temperature([[p_at_T, [1 / 3] * 3]], T)  # logits[0, 0] scores the draft; logits[0, 1] nothing
    accept = evaluate_posterior(logits, torch.tensor([[0, token]]), T)[1]
    assert accept == expected, (
        f"T = {T}: p(token) = {p_at_T[token]} at T, {p_at_1[token]:.3f} at T = 1; accept length {accept}, "
        f"expected {expected}: divide the logits by the temperature before the softmax")


def test_typical_ties_compare_only_the_accepted_prefix():
    """At T = 0.7, rows that accept equally many tokens are ranked by the sum of log p over their
    accepted tokens only: what follows the first rejection (in the row, or past its length) does not count."""
    T = 0.7
    D = [0.40, 0.30, 0.25, 0.05]       # threshold about 0.088: tokens 0, 1, 2 pass, token 3 does not
    assert [typical_accepts(D, v) for v in range(4)] == [True, True, True, False], "the test's own setup"
    logits = at_temperature([[D] * 4] * 3, T)
    cases = [
        # Row 0 wins on its whole row (0.3 * 0.05 * 0.4 > 0.4 * 0.05 * 0.05); row 1 on the accepted prefix.
        ([[0, 1, 3, 0], [0, 0, 3, 3], [0, 3, 0, 0]], None, (1, 1)),
        # Row 1 wins if every passing token counts, also those after the rejection (0.3 < 0.4 * 0.4).
        ([[0, 1, 3, 3], [0, 0, 3, 0], [0, 3, 0, 0]], None, (1, 1)),
        # Row 0 is only 2 long: its slots 2 and 3 are padding, whatever they hold.
        ([[0, 0, 0, 0], [0, 1, 3, 0], [0, 3, 0, 0]], [2, 4, 4], (0, 1)),
    ]
    for candidates, lengths, expected in cases:
        lengths = None if lengths is None else torch.tensor(lengths)
        got = tuple(evaluate_posterior(logits, torch.tensor(candidates), T, path_lengths=lengths)[:2])
        assert got == expected, (
            f"candidates {candidates}, path_lengths {lengths}, probabilities {D} at T = {T}: (best row, "
            f"accept length) = {got}, expected {expected}: rank tied rows by the log p of their accepted tokens only")


def test_typical_argmax_always_passes():
    """The argmax token is accepted whatever the entropy, epsilon and alpha < 1."""
    torch.manual_seed(0)
    for scale in (0.01, 0.1, 1.0, 10.0):
        logits = torch.randn(4, 3, 50) * scale
        candidates = torch.cat([torch.zeros(4, 1, dtype=torch.long), logits[:, :-1].argmax(-1)], dim=1)
        for eps, alpha in [(0.09, 0.3), (0.9, 0.99), (1.0, 0.5)]:
            accept = evaluate_posterior(logits, candidates, 1.0, eps, alpha)[1]
            assert accept == 2, (f"logit scale {scale}, epsilon {eps}, alpha {alpha}: rows of argmax tokens "
                                 f"accepted {accept} tokens, expected all 2")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_is_never_accepted(temperature):
    """A padded slot is never accepted, even when its filler token is what the model predicts."""
    logits = torch.full((2, 3, 5), -10.0)
    logits[:, :, 0] = 10.0  # the model is sure the next token is 0 everywhere
    candidates = torch.tensor([[0, 0, 0], [0, 1, 0]])
    accept = evaluate_posterior(logits, candidates, temperature, path_lengths=torch.tensor([2, 3]))[1]
    assert accept == 1, (f"accept length {accept}, expected 1: row 0 has path_lengths 2, so its slot 2 is "
                         f"padding however well it matches; row 1 stops at its token 1")
    accept = evaluate_posterior(logits[:1], torch.tensor([[0, 0, -1]]), temperature)[1]
    assert accept == 1, f"accept length {accept}, expected 1: candidate -1 is padding (no path_lengths given)"


def test_greedy_picks_the_first_longest_row():
    """Greedy: accept length is the max over rows; best is the first row reaching it (row 0 if none)."""
    logits = torch.zeros(3, 3, 4)
    logits[:, :, 2] = 1.0
    for candidates, expected, why in [([[0, 1, 1], [0, 2, 1], [0, 2, 2]], (2, 2), "only row 2 accepts 2"),
                                      ([[0, 1, 1], [0, 2, 2], [0, 2, 2]], (1, 2), "rows 1 and 2 accept 2: the first"),
                                      ([[0, 1, 1], [0, 3, 2]], (0, 0), "nothing is accepted: row 0")]:
        got = tuple(evaluate_posterior(logits[:len(candidates)], torch.tensor(candidates))[:2])
        assert got == expected, (f"candidates {candidates} (the argmax is 2 everywhere): (best row, accept length) "
                                 f"= {got}, expected {expected}, {why}")
    # logits[r, j] predicts token j + 1 of row r: here the argmax is 1, then 3, then 0.
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 1] = logits[0, 1, 3] = logits[0, 2, 0] = 1.0
    got = tuple(evaluate_posterior(logits, torch.tensor([[0, 1, 3]]))[:2])
    assert got == (0, 2), (f"candidates [[0, 1, 3]], argmax of logits[0, j] = 1, 3, 0 for j = 0, 1, 2: (best row, "
                           f"accept length) = {got}, expected (0, 2): draft j + 1 is checked against logits[:, j]")


@pytest.mark.parametrize("sampling", ["typical", "typical-fast"])
def test_typical_mode_runs_end_to_end(periodic_model, device, sampling):
    """Typical acceptance produces max_new_tokens tokens and accepts drafts on a confident model."""
    torch.manual_seed(0)
    out, stats = medusa_generate(periodic_model, torch.tensor([[3, 17]], device=device), 40, TREES["sparse"],
                                 temperature=0.7, sampling=sampling)
    assert out.shape == (1, 42), f"output shape {tuple(out.shape)}, expected (1, 42)"
    assert stats.tokens_per_step > 2.0, f"{stats.tokens_per_step:.2f} tokens/step on a confident model, expected > 2"


def test_typical_fast_is_deterministic_and_typical_samples_the_root():
    """typical-fast takes the argmax root and is the same for every seed; typical draws the root
    from the model, so on a model that is unsure its output varies with the seed."""
    model, idx = random_medusa(0), torch.tensor([[1, 2, 3]])
    def run(seed, sampling):
        torch.manual_seed(seed)
        return medusa_generate(model, idx, 20, TREES["sparse"], temperature=1.0, sampling=sampling)[0]
    first = run(0, "typical-fast")
    for seed in range(1, 4):
        assert_same_tokens(run(seed, "typical-fast"), first, model, prompt_length=3)
    outputs = {tuple(run(s, "typical")[0].tolist()) for s in range(4)}
    assert len(outputs) > 1, f"typical gave the same tokens for seeds 0-3, {outputs.pop()[3:]}: is the root sampled?"



@pytest.mark.parametrize("n", [1, 7])
def test_the_last_token_is_the_root_as_a_step_chooses_it(n):
    """A generation one token short of its end commits the root alone, with no tree (n = 1: at once; n = 7:
    after steps that commit a token or a few), chosen by the rule a step uses (verify.choose_root): greedy and
    typical-fast take the argmax, whatever the seed; typical and exact draw it, as plain sampling does."""
    model, idx = random_medusa(0), torch.tensor([[1, 2, 3]])

    def run(seed, **kwargs):
        torch.manual_seed(seed)
        out, stats = medusa_generate(model, idx, n, TREES["sparse"], **kwargs)
        assert out.size(1) == 3 + n
        return out
    assert_same_tokens(run(0), generate(model, idx, n), model, prompt_length=3)
    fast = [run(seed, temperature=1.0, sampling="typical-fast") for seed in range(4)]
    for out in fast[1:]:
        assert torch.equal(out, fast[0]), "typical-fast drew a token: its last token must be the argmax too"
    if n == 1:
        assert torch.equal(fast[0], generate(model, idx, 1)), "typical-fast's root is the argmax"
        for sampling in ("typical", "exact"):
            drawn = {tuple(run(seed, temperature=1.0, sampling=sampling)[0].tolist()) for seed in range(4)}
            assert len(drawn) > 1, f"{sampling}: the same root for seeds 0-3: is it drawn?"
            for seed in range(4):
                torch.manual_seed(seed)
                plain = generate(model, idx, 1, 1.0)
                assert torch.equal(run(seed, temperature=1.0, sampling=sampling), plain), f"{sampling}: not plain's draw"
    else:
        for sampling in ("typical", "exact"):
            run(0, temperature=1.0, sampling=sampling)  # reaches the branch after steps, and ends at n tokens


# ---------------------------------------------------------------- exact sampling: the tree walk

WALK_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0)]  # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0)
WALK_TOKENS = torch.tensor([7, 3, 5, 1, 2, 1])    # (1,0) and (0,0) carry the same token: head 2's rank 0


def test_tree_walk_follows_the_drawn_tokens():
    """At a low temperature each node's draw is certain: the walk goes root -> (1,) -> (1,0), since
    node 0 draws 5, the token of (1,), and (1,) draws 1, the token of its child (1,0) (not of (0,0),
    which carries 1 too but hangs under (0,)); (1,0) has no children, so its draw, 6, is the next root."""
    b = build_tree_buffers(WALK_TREE)
    assert b.children == [[1, 2], [3, 4], [5], [], [], []], f"build_tree_buffers gave children {b.children}"
    draws = {0: 5, 1: 2, 2: 1, 3: 0, 4: 4, 5: 6}                   # node -> the token its logits favour
    logits = torch.zeros(6, 8)
    for node, token in draws.items():
        logits[node, token] = 1.0                                # at T = 0.02: all other tokens e^-50
    torch.manual_seed(0)
    for _ in range(20):
        walked, x = sample_tree_walk(logits, WALK_TOKENS, b, 0.02)
        assert isinstance(walked, list) and torch.is_tensor(x) and x.dim() == 0, \
            f"returned ({type(walked).__name__}, {type(x).__name__} {getattr(x, 'shape', '')}): expected (list of ints, 0-d tensor)"
        assert (walked, int(x)) == ([0, 2, 5], 6), (
            f"walked nodes {walked}, next root {int(x)}; expected [0, 2, 5] and 6: at each node draw from that "
            f"node's own logits row, at temperature 0.02 (the favoured tokens per node are {draws})")


def test_tree_walk_draws_at_the_temperature():
    """At T = 0.5 the root moves to (1,) with probability 0.8^2 / (0.8^2 + 0.2^2) = 0.941 (0.8 at T = 1,
    1 for an argmax). When the walk stops at a node, the next root is the token drawn there, which is
    then never a child's token: drawing it again would be a second, different draw."""
    b = build_tree_buffers(WALK_TREE)
    T, n = 0.5, 600
    logits = torch.full((6, 8), -1e9)
    logits[0, 5], logits[0, 0] = math.log(0.8) * 1, math.log(0.2) * 1   # root: 5 (a child's token) or 0
    logits[2, 6] = 0.0                                                 # (1,): always 6, not a child's token
    torch.manual_seed(0)
    moved = 0
    for _ in range(n):
        walked, x = sample_tree_walk(logits, WALK_TOKENS, b, T)
        expected = [0, 2] if walked[-1] == 2 else [0]
        assert walked == expected and int(x) == (6 if walked[-1] == 2 else 0), (
            f"walked {walked}, next root {int(x)}: the root draws 5 (go to (1,), which draws 6) or 0 (stop, "
            f"next root 0); a walk that stops at the root with next root {int(x)} drew twice there")
        moved += walked[-1] == 2
    q = 0.8 ** 2 / (0.8 ** 2 + 0.2 ** 2)
    sd = math.sqrt(q * (1 - q) / n)
    assert abs(moved / n - q) < 4 * sd, (
        f"the walk left the root in {moved}/{n} = {moved / n:.3f} of draws, expected {q:.3f} +- {4 * sd:.3f} "
        f"at T = {T} (0.8 would mean the temperature was ignored, 1.0 an argmax)")


# ---------------------------------------------------------------- exact sampling on a skewed model
# The models here also serve tests/test_distribution.py, where the chi-square family checks what exact sampling
# draws against the model's own distribution (8,000 draws a test: seconds, so a file of their own).

V_SMALL = 4


MARKOV = torch.tensor([[0.05, 0.70, 0.15, 0.10],  # next-token probabilities given the previous token
                       [0.50, 0.05, 0.05, 0.40],
                       [0.10, 0.10, 0.20, 0.60],
                       [0.30, 0.30, 0.35, 0.05]])


@trained_once
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


@trained_once
def skewed_eagle():
    """An EAGLE layer on the skewed model's base, trained a few seconds on the same Markov chain."""
    from eagle import EagleModel, eagle_loss
    torch.manual_seed(0)
    base = skewed_model().base.requires_grad_(False)
    model = EagleModel(base)
    opt = torch.optim.AdamW(model.eagle.parameters(), lr=1e-2)
    for _ in range(60):
        seq = [torch.randint(0, V_SMALL, (64,))]
        for _ in range(8):
            seq.append(torch.multinomial(MARKOV[seq[-1]], 1)[:, 0])
        seq = torch.stack(seq, 1)                                    # (64, 9)
        with torch.no_grad():
            f = base.hidden(seq[:, :-1])                             # (64, 8, C)
        loss = eagle_loss(model.eagle, base, f, seq[:, 1:], torch.arange(8))[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@trained_once
def skewed_mtp():
    """Two MTP modules on the skewed model's (frozen) base, trained a few seconds on the same Markov chain."""
    from mtp import MTPModel, mtp_losses
    torch.manual_seed(0)
    model = MTPModel(skewed_model().base.requires_grad_(False), depth=2)
    opt = torch.optim.AdamW(model.mtp.parameters(), lr=1e-2)
    for _ in range(60):
        seq = [torch.randint(0, V_SMALL, (64,))]
        for _ in range(8):
            seq.append(torch.multinomial(MARKOV[seq[-1]], 1)[:, 0])
        seq = torch.stack(seq, 1)                                    # (64, 9)
        with torch.no_grad():
            h = model.base.hidden(seq[:, :-1])                       # (64, 8, C)
        loss = mtp_losses(model, h, seq).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


TREE_2 = [(0,), (1,), (0, 0), (0, 1), (1, 0)]  # depth 2: three tokens use nodes past depth 1


SEEDS = 100  # generations per drafter; kit/mutants.toml's sampling mutants are caught within them


@pytest.mark.parametrize("drafter", ["medusa", "eagle", "mtp"])
def test_exact_sampling_draws_what_plain_sampling_draws(drafter):
    """Whichever drafter proposes the tree (Medusa's heads; EAGLE's layer, on EAGLE-2's dynamic tree, which
    changes with every step's drafts; two MTP modules), the exact walk draws each token once, from the
    model's own conditional, in the order plain sampling draws them: with the same seed, the two write the
    same text. (The distribution itself: tests/test_distribution.py.)"""
    from feature_drafter import feature_generate
    from feature_drafter import DynamicTree
    model = {"medusa": skewed_model, "eagle": skewed_eagle, "mtp": skewed_mtp}[drafter]()
    prompt = torch.tensor([[1, 2]])
    if drafter == "medusa":
        def exact():
            return medusa_generate(model, prompt, 6, TREE_2, temperature=0.7, sampling="exact")
    else:
        def exact():
            return feature_generate(model, prompt, 6, DynamicTree(topk=2, nodes=4, depth=2), temperature=0.7,
                                    sampling="exact")
    accepted = 0
    for seed in range(SEEDS):
        torch.manual_seed(seed)
        out, stats = exact()
        torch.manual_seed(seed)
        plain = generate(model.base, prompt, 6, temperature=0.7)
        assert torch.equal(out, plain), f"seed {seed}: exact {out[0, 2:].tolist()}, plain {plain[0, 2:].tolist()}"
        accepted += sum(stats.accept_lengths)
    assert accepted > SEEDS, f"the walk accepted {accepted} drafted tokens in {SEEDS} generations: it must walk the tree"


def test_exact_sampling_is_lossless_by_construction_at_length_one():
    """With one new token, exact sampling is plain sampling: same draws for the same seed."""
    model = skewed_model()
    torch.manual_seed(5)
    a = medusa_generate(model, torch.tensor([[1]]), 1, [(0,)], temperature=0.9, sampling="exact")[0]
    torch.manual_seed(5)
    b = generate(model, torch.tensor([[1]]), 1, temperature=0.9)
    assert torch.equal(a, b), f"same seed: exact sampling drew {a[0, 1].item()}, plain sampling {b[0, 1].item()}"


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


def test_exact_sampling_ceiling_scores_heads_against_the_models_own_distribution(periodic_model):
    """lab.ceiling.exact_sampling_ceiling: on a periodic model, sampling follows the period, so the heads
    (trained on it) and the ceiling both commit nearly the whole 4-deep chain each step; heads with
    scrambled residual blocks guess wrong and commit about the root alone, while the ceiling stays."""
    import copy
    from lab import drafters
    from lab.ceiling import exact_sampling_ceiling
    from conftest import PERIOD
    medusa = drafters.get("medusa")
    device = periodic_model.base.lm_head.weight.device
    prompts = [torch.tensor(PERIOD[:5], device=device), torch.tensor(PERIOD[3:], device=device),
               torch.tensor((PERIOD * 6)[:52], device=device)]  # 52 + 12 tokens fill the 64-token context
    torch.manual_seed(0)
    good = exact_sampling_ceiling(periodic_model.base, {"heads": (medusa, periodic_model)}, prompts, 0.7, [4], 4,
                                  new_tokens=12, every=3, draws=64, ranked=32)
    # contexts of 5, 8, ..., 17 and 6, 9, ..., 18 tokens: every third, to the end of the sample; then
    # 52, 55 and 58, where the root and 4 tokens after it still fit in the context
    assert good["positions"] == 5 + 5 + 3
    assert good["heads"][4] > 4.5 and good["ceiling"][4] > 4.5 and good["conditional"][4] > 4.5, good
    scrambled = copy.deepcopy(periodic_model)
    with torch.no_grad():
        for head in scrambled.heads:
            head.residual.weight.normal_(0, 3.0, generator=torch.Generator(device=device).manual_seed(1))
    torch.manual_seed(0)
    bad = exact_sampling_ceiling(scrambled.base, {"heads": (medusa, scrambled)}, prompts, 0.7, [4], 4,
                                 new_tokens=12, every=3, draws=64, ranked=32)
    assert bad["heads"][4] < 2.0 < 4.5 < min(bad["ceiling"][4], bad["conditional"][4]), bad


# ---------------------------------------------------------------- stop tokens

@pytest.mark.parametrize("tree", ["chain_4", "sparse"])
@pytest.mark.parametrize("stop", [29, 3])
def test_greedy_with_a_stop_token_equals_plain_greedy_stop_included(periodic_model, device, tree, stop):
    """With a stop token, greedy tree decoding still equals plain greedy decoding token for token:
    both end right after the stop token. The periodic model's heads are perfect, so the stop comes
    in the middle of an accepted path (29) or as a step's root (3, the first token of a period here)."""
    idx = torch.tensor([[17, 5]], device=device)
    plain = generate(periodic_model, idx, 40, stop_tokens=[stop])
    fast, stats = medusa_generate(periodic_model, idx, 40, TREES[tree], stop_tokens=[stop])
    assert plain[0, -1] == stop and stop not in plain[0, 2:-1].tolist(), plain
    assert_same_tokens(fast, plain, periodic_model, stats, 2)
    assert len(stats.token_depths) == plain.size(1) - 2


@pytest.mark.parametrize("sampling", ["typical", "exact"])
def test_sampled_decoding_ends_at_its_first_stop_token(periodic_model, device, sampling):
    """Sampled tree decoding commits up to and including the first stop token, and nothing after it."""
    torch.manual_seed(0)
    out, stats = medusa_generate(periodic_model, torch.tensor([[17, 5]], device=device), 40, TREES["sparse"],
                                 temperature=0.7, sampling=sampling, stop_tokens=[23])
    new = out[0, 2:].tolist()
    assert new[-1] == 23 and 23 not in new[:-1], new
    assert len(stats.token_depths) == len(new)


def test_batched_generation_stops_each_row_at_its_own_stop_token():
    """Plain batched generation (distillation): each row ends at its own stop token and repeats it
    after; generation ends when every row has ended, and rows match their one-at-a-time output."""
    model = random_medusa(0)
    prompts = torch.randint(0, 32, (4, 3), generator=torch.Generator().manual_seed(1))
    free = generate(model, prompts, 20)
    stop = free[0, 8].item()                                   # a token row 0 is sure to produce
    out = generate(model, prompts, 20, stop_tokens=[stop])
    for row in range(4):
        alone = generate(model, prompts[row:row + 1], 20, stop_tokens=[stop])[0]
        n = alone.numel()
        assert torch.equal(out[row, :n], alone), row
        assert (out[row, n:] == alone[-1]).all(), f"row {row} goes on after its stop token: {out[row].tolist()}"
    ended = [stop in out[r, 3:].tolist() for r in range(4)]
    assert out.size(1) == 23 or all(ended), "generation ran on after every row had ended"


def test_acceptance_stops_after_a_stop_token():
    """evaluate_posterior with stop tokens: nothing after a row's first stop token is accepted (the
    stop itself can be), and the third value says whether the best row's accepted run ends with one."""
    logits = torch.zeros(2, 4, 10)
    logits[:, 0, 5], logits[:, 1, 6], logits[:, 2, 7] = 1.0, 1.0, 1.0  # the model says 5, then 6, then 7
    candidates = torch.tensor([[1, 5, 6, 7], [1, 5, 6, 9]])
    for temperature in (0.0, 1.0):
        kwargs = dict(temperature=temperature, posterior_threshold=0.05, posterior_alpha=0.05)
        assert evaluate_posterior(logits, candidates, **kwargs) == (0, 3, False)
        assert evaluate_posterior(logits, candidates, stop_tokens=torch.tensor([6]), **kwargs) == (0, 2, True)
        assert evaluate_posterior(logits, candidates, stop_tokens=torch.tensor([1]), **kwargs) == (0, 0, True)
        assert evaluate_posterior(logits, candidates, stop_tokens=torch.tensor([8]), **kwargs) == (0, 3, False)
        assert evaluate_posterior(logits, candidates, stop_tokens=torch.tensor([9]), **kwargs) == (0, 3, False)
