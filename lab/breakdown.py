"""Where a drafted step's time goes: drafting, the tree forward and the bookkeeping, in real decoding against
each part alone (benchmark.py --breakdown). Any drafter: it takes a registry entry (lab/drafters.py).
"""
import statistics

import torch

from lab.timing import timed
from medusa_mini import generate
from tree import gather_paths
from verify import Drafter, evaluate_posterior, prefill, tree_decoding, verify_step


class TimedDrafter(Drafter):
    """A drafter whose propose() and commit() are timed (seconds per call, in `seconds`)."""

    def __init__(self, drafter, device):
        self.inner, self.device, self.nodes, self.taps = drafter, device, drafter.nodes, drafter.taps
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
    state, h = prefill(model.base, prompt, extra=drafter.nodes, taps=drafter.taps)
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
    state, h = prefill(model.base, prompt, extra=drafter.nodes, taps=drafter.taps)
    drafter.start(state, h)
    S = state.tokens.size(1)
    draft = drafter.propose(state, state.logits.argmax(-1), n_new)
    buffers = draft.buffers

    def tree_pass():
        out = tree_decoding(model.base, draft.tokens, buffers, state.cache, drafter.taps)
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
