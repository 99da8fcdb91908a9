"""Timing decoding: a drafter's step against a plain step, and whole decoding modes against each other,
in the same process, interleaved.

Every figure is a median over interleaved repeats: on a small shared machine, timings drift, and
running the sides one after the other would hand the drift to one of them. Each side runs at every
CPU thread count from 1 to the number of cores, and a speedup compares each side at its own best
count (best against best).
"""
import functools
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from lab.devices import sync
from medusa_mini import generate

# The sizes of the measurements, defined here once: lab/plan.py's time estimate and the pipeline's check
# that no stage generates past the trained positions read them too.
STEP_COST_PROMPT, STEP_COST_TOKENS, STEP_COST_REPEATS = 64, 48, 3  # step_costs: prompt, new tokens, rounds
STEP_COST_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # tree sizes timed (nodes)


def timed(fn, device):
    """(seconds, fn()): the GPU's queued work waited for on both sides."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t0, result


def thread_counts(device, threads=None):
    """The CPU thread counts to try: 1 .. the number of cores, or the one given. On a GPU the CPU only
    launches kernels, so the current count alone."""
    if threads:
        return [threads]
    if torch.device(device).type != "cpu":
        return [torch.get_num_threads()]
    return list(range(1, (os.cpu_count() or 1) + 1))


def keeps_thread_count(measure):
    """A measurement that sets torch's thread count as it goes puts the caller's back when it ends."""
    @functools.wraps(measure)
    def measured(*args, **kwargs):
        before = torch.get_num_threads()
        try:
            return measure(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return measured


@torch.no_grad()
@keeps_thread_count
def step_costs(model, generate_drafted, order, prompt, device, threads=None, sizes=None, repeats=STEP_COST_REPEATS,
               n_new=STEP_COST_TOKENS):
    """Time of one drafted step with the first n nodes of `order`, against one plain decoding step, at each
    thread count.

    Measured as decoding really runs: whole greedy generations of n_new tokens from `prompt` (1-D token
    ids), the drafter's decoding (generate_drafted, its registry entry's) over plain decoding, time per
    step over time per token, sizes and thread counts interleaved, medians. Returns {threads:
    {"plain_step_ms", "step_ms": {n: ms}, "relative": {n: x plain}}}."""
    sizes = sizes or [n for n in STEP_COST_SIZES if n <= len(order)]
    prompt = prompt.view(1, -1)
    for n in sizes:  # warm-up: builds and caches each tree's buffers
        generate_drafted(model, prompt, 4, order[:n])
    runs = {(t, n): [] for t in thread_counts(device, threads) for n in ["plain"] + sizes}
    for _ in range(repeats):
        for t, n in runs:
            torch.set_num_threads(t)
            if n == "plain":
                seconds, _ = timed(lambda: generate(model, prompt, n_new), device)
                runs[t, n].append(seconds / n_new)
            else:
                seconds, (_, stats) = timed(lambda: generate_drafted(model, prompt, n_new, order[:n]), device)
                runs[t, n].append(seconds / stats.steps)
    costs = {}
    for t in thread_counts(device, threads):
        plain = statistics.median(runs[t, "plain"])
        costs[t] = {"plain_step_ms": plain * 1e3,
                    "step_ms": {n: statistics.median(runs[t, n]) * 1e3 for n in sizes},
                    "relative": {n: statistics.median(runs[t, n]) / plain for n in sizes}}
    return costs


@dataclass
class Mode:
    """One way of decoding, as the comparisons time it."""
    decode: object                  # generate, or a drafter's generate: decode(model, idx, n[, tree], **kwargs)
    kwargs: dict = field(default_factory=dict)
    model: object = None            # the model it decodes with (default: compare's)
    tree: object = None             # its tree (None: plain decoding)
    drafter: str | None = None      # the registry name of its drafter (None: plain decoding, a peer)
    sampling: str = "greedy"        # greedy, typical or exact (plain sampling: "sampled")
    baseline: str = "plain greedy"  # the mode it is compared with
    every_thread_count: bool = True  # False: compare picks one count for it on the first prompt

    def run(self, model, idx, n_new):
        model = self.model if self.model is not None else model
        args = (model, idx, n_new) if self.tree is None else (model, idx, n_new, self.tree)
        return self.decode(*args, **self.kwargs)


@torch.no_grad()
@keeps_thread_count
def compare(model, prompts, n_new, modes: dict, repeats, threads=(None,)):
    """Run every mode at every thread count on every prompt `repeats` times, interleaved (the order
    rotates each round). A mode with every_thread_count=False runs at every count on the first prompt
    only, then at the count that was fastest for it there (its first prompt's runs at it are kept).

    modes: {label: Mode}. Returns, per (label, threads) run on every prompt: median seconds and new
    tokens per prompt (fewer than n_new where a stop token ended the text), outputs, and the tree
    decoding stats of the last repeat (None for plain decoding)."""
    keys = [(name, t) for name in modes for t in threads]
    runs = {key: {"seconds": [], "tokens": [], "outputs": [], "stats": []} for key in keys}
    picked = [name for name, mode in modes.items() if not mode.every_thread_count] if len(threads) > 1 else []
    for p, prompt in enumerate(prompts):
        idx = prompt.view(1, -1)
        per_prompt = {key: [] for key in keys}
        made = {key: [] for key in keys}
        for r in range(repeats):
            for name, t in keys[r % len(keys):] + keys[:r % len(keys)]:
                if t is not None:
                    torch.set_num_threads(t)
                torch.manual_seed(1000 * p + r)  # sampled modes: the same seeds for every mode
                seconds, result = timed(lambda: modes[name].run(model, idx, n_new), idx.device)
                out, stats = result if isinstance(result, tuple) else (result, None)
                # an engine in another process times itself (lab/llama_cpp.py, EngineRun): its load is not decoding
                per_prompt[name, t].append(getattr(stats, "seconds", seconds))
                made[name, t].append(getattr(stats, "tokens", out.size(1) - idx.size(1)))  # < n_new: a stop token
                if r == repeats - 1:
                    runs[name, t]["outputs"].append(out[0, idx.size(1):].tolist())
                    runs[name, t]["stats"].append(stats)
        for key in keys:
            runs[key]["seconds"].append(statistics.median(per_prompt[key]))
            runs[key]["tokens"].append(statistics.median(made[key]))
        if p == 0:  # the first prompt picked these modes' thread counts: the others are dropped
            for name in picked:
                best = max(threads, key=lambda t: runs[name, t]["tokens"][0] / runs[name, t]["seconds"][0])
                for t in threads:
                    if t != best:
                        keys.remove((name, t))
                        del runs[name, t]
    return runs


def distinct_4gram_ratio(tokens):
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / max(len(grams), 1)


def summarise(runs, name, baseline, threads):
    """One row: mode `name` at each thread count it ran at, and at its best against `baseline` at its
    best; speeds over the tokens each side actually generated."""
    def speeds(mode):
        return {t: sum(runs[mode, t]["tokens"]) / sum(runs[mode, t]["seconds"]) for t in threads if (mode, t) in runs}
    speed, base_speed = speeds(name), speeds(baseline)
    best, base_best = max(speed, key=speed.get), max(base_speed, key=base_speed.get)
    run = runs[name, best]
    tokens = sum(getattr(s, "tokens", len(o)) for o, s in zip(run["outputs"], run["stats"]))
    row = {"tokens_per_s": speed[best], "threads": best, "tokens_per_s_by_threads": speed,
           "speedup": speed[best] / base_speed[base_best],  # best against best
           "speedup_same_threads": {t: speed[t] / base_speed[t] for t in speed if t in base_speed},
           "distinct_4gram": statistics.mean(distinct_4gram_ratio(o) for o in run["outputs"])}
    if getattr(run["stats"][0], "steps", None) is not None:
        steps = sum(s.steps for s in run["stats"])
        row["tokens_per_step"] = tokens / steps
        # overhead = time of a tree decoding step / time of a plain decoding step (one token), same threads
        row["overhead_per_step"] = (tokens / speed[best] / steps) / (1 / base_speed[best])
    return row


def identical_share(runs, name, reference, threads):
    """The fraction of prompts on which mode `name` (at its best thread count) wrote the reference's text."""
    best = max((t for t in threads if (name, t) in runs),
               key=lambda t: sum(runs[name, t]["tokens"]) / sum(runs[name, t]["seconds"]))
    ref = next(t for t in threads if (reference, t) in runs)
    same = [a == b for a, b in zip(runs[name, best]["outputs"], runs[reference, ref]["outputs"])]
    return sum(same) / len(same)
