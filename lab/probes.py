"""Probes: what decoding costs beyond a stopwatch, and whether exact sampling is exact.

- Ops per step (OpCounter, count_ops): what a step would cost a GPU where a model this small is
  launch-bound, counted exactly on the CPU.
- Where a step's time goes (breakdown): drafting, the tree forward and the bookkeeping, in real
  decoding against each part alone.
- The exact-sampling distribution (true_joint, chi_square, chi_square_family): draws against the
  model's own probabilities, with a check of the test's power (shifted_marginal, draws_from).
- The exact-sampling ceiling (exact_sampling_ceiling): tokens per step our drafters could reach,
  against the best any Medusa heads, or a perfect conditional drafter, could.
Any drafter: each takes a registry entry (lab/drafters.py), never a drafter's name.
"""
import itertools
import statistics
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # torch's documented hook for op counting

from lab.devices import sync
from lab.timing import timed
from medusa_mini import generate
from tree import grow_tree
from verify import DecodeStats, Drafter, evaluate_posterior, prefill, tree_decoding, verify_step
from tree import gather_paths


# ---------------------------------------------------------------------------------------- ops: the GPU proxy

class OpCounter(TorchDispatchMode):
    """Counts what decoding would cost a GPU where a model is this small: one kernel launch per aten
    op that computes something (views only relabel memory, so they are left out), and every read of
    a tensor's value on the host, which makes the CPU wait for the GPU."""
    HOST_READS = {"aten._local_scalar_dense", "aten.equal", "aten.nonzero", "aten.is_nonzero", "aten.masked_select"}
    FREE = {"aten._unsafe_view", "aten.scalar_tensor"}  # metadata, or a CPU scalar: no kernel

    def __init__(self):
        super().__init__()
        self.ops, self.host_reads = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.HOST_READS:
            self.host_reads += 1
        elif not func.is_view and name not in self.FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        # .tolist() reads a whole tensor on the host without an aten op: count it by hand.
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(tensor):
            counter.host_reads += 1
            return tolist(tensor)
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def total(self):
        return sum(self.ops.values())


@torch.no_grad()
def count_ops(kind, model, prompt, tree, n_new=64, **decode_kwargs):
    """Kernel-launching ops per plain token and per drafted step (kind: the drafter's registry entry),
    and host reads per step.

    Plain: the difference between generating 2m and m tokens (m = n/2), per token. Drafted: a whole
    generation minus what comes before its first step (the prompt's forward, the drafter's start), per
    step. ops_ratio = ops per step / ops per plain token; on a GPU, where a small model's step costs
    about one launch per op, tokens/step / ops_ratio projects the speedup (a projection, not a
    measurement). Counted as a GPU decodes: drafting in the base's dtype (model.draft_dtype set aside)."""
    block = model.base.config.block_size
    n_new = min(n_new, block - prompt.size(1))          # everything within the context
    saved, model.draft_dtype = model.draft_dtype, None
    try:
        n_plain = n_new // 2                             # plain: generate 2 * n_plain and n_plain tokens
        kind.generate(model, prompt, n_new, tree, **decode_kwargs)  # build the tree buffers first

        def start():  # what a generation does before its first step
            drafter = kind.drafter(model, tree, prompt.device)
            state, h = prefill(model.base, prompt, extra=drafter.nodes)
            drafter.start(state, h)
        counts = []
        for fn in (lambda: generate(model.base, prompt, n_plain), lambda: generate(model.base, prompt, 2 * n_plain),
                   start, lambda: kind.generate(model, prompt, n_new, tree, **decode_kwargs)):
            with OpCounter() as counter:
                result = fn()
            counts.append((counter, result))
    finally:
        model.draft_dtype = saved
    (short, _), (long, _), (pre, _), (drafted, (_, stats)) = counts
    plain = (long.total - short.total) / n_plain
    per_step = (drafted.total - pre.total) / stats.steps
    return {"plain_ops_per_token": plain, "ops_per_step": per_step, "ops_ratio": per_step / plain,
            "host_reads_per_step": (drafted.host_reads - pre.host_reads) / stats.steps,
            "plain_host_reads_per_token": (long.host_reads - short.host_reads) / n_plain,
            "tokens_per_step": stats.tokens_per_step,
            "projected_speedup": stats.tokens_per_step / (per_step / plain),
            "ops_by_name": {k: (v - pre.ops[k]) / stats.steps for k, v in drafted.ops.most_common()}}


def format_ops(ops):
    return (f"ops per step (kernel-launching aten ops, views excluded): plain {ops['plain_ops_per_token']:.0f} per "
            f"token, a drafted step {ops['ops_per_step']:.0f} = {ops['ops_ratio']:.2f}x; host reads per step "
            f"{ops['host_reads_per_step']:.2f}; projected GPU speedup {ops['tokens_per_step']:.2f} tokens/step / "
            f"{ops['ops_ratio']:.2f} = {ops['projected_speedup']:.2f}x (a projection, not a measurement)")


# ---------------------------------------------------------------------------------------- where a step's time goes

class TimedDrafter(Drafter):
    """A drafter whose propose() and commit() are timed (seconds per call, in `seconds`)."""

    def __init__(self, drafter, device):
        self.inner, self.device, self.nodes = drafter, device, drafter.nodes
        self.seconds = {"propose": [], "commit": []}

    def start(self, state, h):
        self.inner.start(state, h)

    def propose(self, state, root, depth):
        seconds, draft = timed(lambda: self.inner.propose(state, root, depth), self.device)
        self.seconds["propose"].append(seconds)
        return draft

    def commit(self, state, kept, h):
        seconds, _ = timed(lambda: self.inner.commit(state, kept, h), self.device)
        self.seconds["commit"].append(seconds)


def median_ms(fn, device, repeats=25):
    """Median time of fn() in ms over `repeats` calls, after a few warm-up calls."""
    for _ in range(3):
        fn()
    return statistics.median(timed(fn, device)[0] for _ in range(repeats)) * 1e3


@torch.no_grad()
def timed_generation(kind, model, prompt, tree, n_new):
    """Greedy decoding step by step through verify.verify_step (as speculative_generate runs it), each
    step timed, the drafter's own calls timed inside it: ({"step", "propose", "commit"}: ms per step)."""
    device = prompt.device
    drafter = TimedDrafter(kind.drafter(model, tree, device), device)
    state, h = prefill(model.base, prompt, extra=drafter.nodes)
    drafter.start(state, h)
    steps, end = [], prompt.size(1) + n_new
    while state.tokens.size(1) < end - 1:
        seconds, _ = timed(lambda: verify_step(model.base, drafter, state, end - state.tokens.size(1) - 1), device)
        steps.append(seconds)
    return {"step": statistics.fmean(steps) * 1e3, **{k: statistics.fmean(v) * 1e3 for k, v in drafter.seconds.items()},
            "tokens_per_step": (state.tokens.size(1) - prompt.size(1)) / len(steps)}


@torch.no_grad()
def breakdown(kind, model, prompt, tree, n_new=128, rounds=9):
    """Where a drafted step's time goes, actual against ideal.

    Actual: each step of real greedy decoding, timed, and inside it the drafter's propose and commit
    (their sum: drafting); verification is the rest. Ideal, on the prompt's cache: the tree forward
    alone, and the bookkeeping alone (acceptance, the cache's keep, the commit of tokens), each warm and
    in isolation (medians of 25); the ideal step is drafting as measured plus those two. Actual and
    ideal are measured in alternating rounds, so that a machine whose speed drifts slows both alike:
    medians over rounds. Returns the figures; prints the table."""
    device = prompt.device
    drafter = kind.drafter(model, tree, device)
    state, h = prefill(model.base, prompt, extra=drafter.nodes)
    drafter.start(state, h)
    S = state.tokens.size(1)
    draft = drafter.propose(state, state.logits.argmax(-1), n_new)
    buffers = draft.buffers

    def tree_pass():
        out = tree_decoding(model.base, draft.tokens, buffers, state.cache)
        state.cache.rollback(S)
        return out
    _, logits = tree_pass()
    nodes = buffers.retrieve_indices[0, :buffers.depth + 1]

    def bookkeeping():  # everything of a step but the forwards and the drafting: acceptance and updates
        best, accept, _ = evaluate_posterior(gather_paths(logits, buffers), draft.candidates)
        state.buffer[0, S:S + len(nodes)] = draft.candidates[0]
        state.cache.length = S + len(buffers.node_paths)
        state.cache.keep(S, nodes)
        state.cache.rollback(S)
        return logits[buffers.rows[0][-1]]

    def plain_forward():  # one plain decoding step on the same cache
        out = model.base(prompt[:, -1:], cache=state.cache)
        state.cache.rollback(S)
        return out

    timed_generation(kind, model, prompt, tree, 8)  # warm-up
    per_round = []
    for _ in range(rounds):
        plain = timed(lambda: generate(model.base, prompt, n_new), device)[0] / n_new * 1e3
        row = timed_generation(kind, model, prompt, tree, n_new)
        row.update({"plain": plain, "plain alone": median_ms(plain_forward, device),
                    "tree forward": median_ms(tree_pass, device), "bookkeeping": median_ms(bookkeeping, device)})
        row["drafting"] = row["propose"] + row["commit"]
        row["verification"] = row["step"] - row["drafting"]
        row["ideal step"] = row["drafting"] + row["tree forward"] + row["bookkeeping"]
        row["ratio"] = row["step"] / row["ideal step"]
        per_round.append(row)
    med = {key: statistics.median(row[key] for row in per_round) for key in per_round[0]}
    plain, step = med["plain"], med["step"]
    print(f"{rounds} rounds, each: a plain generation, a {kind.name} generation with every step timed, and each "
          f"ideal part alone (medians of 25); medians over the rounds")
    print(f"plain step {plain:.2f} ms in real decoding; {kind.name} step {step:.2f} ms ({step / plain:.2f}x) "
          f"with a {len(buffers.node_paths) - 1}-node tree, {med['tokens_per_step']:.2f} tokens/step")
    print("\nactual, inside real decoding (mean over the steps)")
    for name in ("propose", "commit", "drafting", "verification", "step"):
        print(f"  {name:24s} {med[name]:7.3f} ms ({med[name] / plain:.2f}x a plain step)")
    print("\nideal: each part alone on the prompt's cache, warm")
    for name in ("tree forward", "bookkeeping", "ideal step", "plain alone"):
        print(f"  {name:24s} {med[name]:7.3f} ms ({med[name] / plain:.2f}x a plain step)")
    ratios = sorted(row["ratio"] for row in per_round)
    print(f"\nactual step / ideal step = {med['ratio']:.2f} (rounds from {ratios[0]:.2f} to {ratios[-1]:.2f})")
    return {"plain_step_ms": plain, "step_ms": step, "tokens_per_step": med["tokens_per_step"],
            "actual_ms": {k: med[k] for k in ("propose", "commit", "drafting", "verification")},
            "ideal_ms": {k: med[k] for k in ("tree forward", "bookkeeping")}, "ideal_step_ms": med["ideal step"],
            "plain_alone_ms": med["plain alone"], "actual_over_ideal": med["ratio"], "rounds": per_round}


# ---------------------------------------------------------------------------------------- exact sampling, checked

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


# ---------------------------------------------------------------------------------------- the exact-sampling ceiling

def accepted_depth(ranks, tree):
    """How deep a sample goes into the tree: ranks[k] is the rank of its token k+1 after the root in
    the proposals at depth k+1 (-1: not among them); the tree is a set of rank paths, prefix-closed."""
    d = 0
    while d < len(ranks) and tuple(ranks[:d + 1]) in tree:
        d += 1
    return d


def _rank_in(proposals, drawn):
    """proposals (N, D, ranks) token ids per draw and depth, drawn (N, D) -> (N, D): each drawn token's rank
    among its depth's proposals, or -1."""
    hit = drawn[:, :, None] == proposals                                                 # (N, D, ranks)
    return torch.where(hit.any(-1), hit.int().argmax(-1), -1)


@torch.no_grad()
def exact_sampling_ceiling(base, drafted, prompts, temperature, sizes, depth, new_tokens=96, every=4, draws=384,
                           ranked=256, ranks=10):
    """Exact sampling's tokens/step with our drafters' proposals, the best any Medusa heads could make, and
    the best a drafter conditioned on its path could make.

    The tree walk is lossless, so a step commits the root and then the longest prefix of a sample from
    the model that the tree holds: tokens/step can be measured by sampling, without decoding. At every
    `every`-th position of a sample of new_tokens from each prompt, `draws` continuations of the root
    and `depth` tokens are drawn. Each set of proposals ranks the drawn tokens at each depth:
    - drafted: {name: (registry entry, model)}: each drafter's own proposals (kind.proposals);
    - ceiling: the tokens ranked by how often the first `ranked` draws hold them at that depth: the
      model's own distribution of the tokens after the root, the most a head can know (it guesses
      before the root is drawn, the same guesses on every branch);
    - conditional: the model's own top tokens given each draw's path so far (root included): what a
      drafter that conditions on the tokens before it could know at best.
    Trees are grown from each set's accuracies on the first `ranked` draws and scored on the others: a
    drafter whose drafts ignore the path (and the ceiling) by each depth's frequency, the others given
    the path in reach. Returns {name: {size: tokens/step}, "positions": count}."""
    D, V = depth, base.config.vocab_size
    conditional = {"ceiling": False, "conditional": True} | {n: kind.conditional for n, (kind, _) in drafted.items()}
    found = {name: [] for name in conditional}               # per position: (draws, D) ranks, -1 where not within `ranks`
    for prompt in prompts:
        sample = generate(base, prompt.view(1, -1), new_tokens, temperature)[0]
        last = min(sample.numel(), base.config.block_size - D - 1)  # the draws must fit in the context
        for t in range(prompt.numel(), last + 1, every):
            context = sample[None, :t]                                                   # (1, t)
            seq = generate(base, context.expand(draws, -1), D + 1, temperature)         # (draws, t + D + 1)
            drawn = seq[:, t + 1:]                                                       # (draws, D) after the root
            h = base.hidden(seq)                                                         # (draws, t + D + 1, C)
            counts = [torch.bincount(drawn[:ranked, k], minlength=V) for k in range(D)]  # D x (V,)
            ceiling = torch.stack([c.topk(ranks).indices for c in counts])               # (D, ranks)
            found["ceiling"].append(_rank_in(ceiling.expand(draws, -1, -1), drawn))
            top = base.lm_head(h[:, t:t + D]).topk(ranks, -1).indices                   # (draws, D, ranks): given the path
            found["conditional"].append(_rank_in(top, drawn))
            for name, (kind, model) in drafted.items():
                found[name].append(_rank_in(kind.proposals(model, seq, h, t, D, ranks), drawn))

    result = {"positions": len(found["ceiling"])}
    for name, per_position in found.items():
        per_position = torch.stack(per_position)                                         # (positions, draws, D)
        train, test = per_position[:, :ranked].flatten(0, 1), per_position[:, ranked:].flatten(0, 1)
        if conditional[name]:  # given the path in reach: the chain rule
            reached = torch.cumprod(torch.cat([torch.ones_like(train[:, :1]), train[:, :-1] >= 0], 1), 1).bool()
            accuracies = [[float(((train[:, k] == r) & reached[:, k]).sum() / reached[:, k].sum().clamp(min=1))
                           for r in range(ranks)] for k in range(D)]
        else:  # guesses made before the root: each depth's own frequency
            accuracies = [[float((train[:, k] == r).float().mean()) for r in range(ranks)] for k in range(D)]
        order = grow_tree(accuracies, max(sizes))
        rows = test.tolist()
        result[name] = {n: statistics.fmean(1 + accepted_depth(r, set(order[:n])) for r in rows) for n in sizes}
    return result


def format_ceiling(ceiling, temperature):
    sizes = list(ceiling["ceiling"])
    lines = [f"exact sampling at T={temperature}, tokens/step on {ceiling['positions']} positions of sampled text",
             "| proposals | " + " | ".join(f"{n} nodes" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    labels = {"ceiling": "any Medusa heads, estimated best: the model's own distribution of each future token",
              "conditional": "a perfect conditional drafter (a bound): the model's own top tokens given each path"}
    for name, row in ceiling.items():
        if name != "positions":
            lines.append(f"| {labels.get(name, f'our {name} drafter')} | " +
                         " | ".join(f"{row[n]:.2f}" for n in sizes) + " |")
    return "\n".join(lines)
