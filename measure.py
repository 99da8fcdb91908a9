"""Measuring decoding: tree decoding against plain decoding of the same model, in the same process,
interleaved; step costs and the tree they choose; ops per step (the GPU proxy); where a step's time
goes; the exact-sampling ceiling. The commands benchmark.py and train_heads.py, and smollm_heads.py,
use it.

Every figure is a median over interleaved repeats: on a small shared machine, timings drift, and
running the sides one after the other would hand the drift to one of them. Each side runs at every
CPU thread count from 1 to the number of cores, and a speedup compares each side at its own best
count.
"""
import json
import os
import dataclasses
import itertools
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import sync
import verify
import common
from eagle import DynamicTree, FeatureDrafter, as_tree, chain_outputs
from medusa_mini import HeadStack, MedusaDrafter, generate, generate_candidates, medusa_generate
from tree import expected_tokens_per_step, gather_paths, grow_tree
from verify import evaluate_posterior, prefill, tree_decoding

DENSE_WIDTHS = [3, 3, 2]  # 3 + 9 + 18 = 30 nodes: the dense tree the report compares against

# The sizes of the measurements, defined here once: training.py's plan (its time estimate) and its
# check that no stage generates past the trained positions read them too.
STEP_COST_PROMPT, STEP_COST_TOKENS, STEP_COST_REPEATS = 64, 48, 3  # measure_step_costs: prompt, new tokens, rounds
STEP_COST_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # tree sizes timed (nodes)
REPORT_PROMPT, REPORT_REPEATS = 32, 2                                # run_report: held-out prompt tokens, rounds
SWEEP_PROMPTS, SWEEP_REPEATS, SWEEP_SIZES = 5, 2, (1, 2, 4, 8, 16, 32, 64)  # its tree-size sweep


def timed(fn, device):
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


@torch.no_grad()
def measure_step_costs(model, order, val_ids, device, threads=None, sizes=None, repeats=STEP_COST_REPEATS,
                       n_new=STEP_COST_TOKENS, decode=medusa_generate, prompt=None):
    """Time of one Medusa step with the first n nodes of `order`, against one plain decoding step,
    at each thread count.

    Measured as decoding really runs: whole greedy generations of n_new tokens from a held-out prompt
    (tree buffers built once and reused, as in decoding), Medusa time per step over plain time per
    token, sizes and thread counts interleaved, medians. Returns {threads: {"plain_step_ms",
    "step_ms": {n: ms}, "relative": {n: x plain}}}."""
    sizes = sizes or [n for n in STEP_COST_SIZES if n <= len(order)]
    if prompt is None:  # held-out text, or the prompt given (a chat prompt)
        prompt = torch.as_tensor(val_ids[:STEP_COST_PROMPT].astype("int64"), device=device)
    prompt = prompt.view(1, -1)
    for n in sizes:  # warm-up: builds and caches each tree's buffers
        decode(model, prompt, 4, order[:n])
    runs = {(t, n): [] for t in thread_counts(device, threads) for n in ["plain"] + sizes}
    for _ in range(repeats):
        for t, n in runs:
            torch.set_num_threads(t)
            if n == "plain":
                seconds, _ = timed(lambda: generate(model, prompt, n_new), device)
                runs[t, n].append(seconds / n_new)
            else:
                seconds, (_, stats) = timed(lambda: decode(model, prompt, n_new, order[:n]), device)
                runs[t, n].append(seconds / stats.steps)
    costs = {}
    for t in thread_counts(device, threads):
        plain = statistics.median(runs[t, "plain"])
        costs[t] = {"plain_step_ms": plain * 1e3,
                    "step_ms": {n: statistics.median(runs[t, n]) * 1e3 for n in sizes},
                    "relative": {n: statistics.median(runs[t, n]) / plain for n in sizes}}
    return costs


def choose_tree(order, accuracies, costs):
    """The prefix of the grown order, and the thread count, with the most expected tokens per second:
    expected tokens per step (from the accuracies) over the measured time of a step.
    Returns (tree, threads)."""
    best = max(((t, n) for t in costs for n in costs[t]["step_ms"]),
               key=lambda tn: expected_tokens_per_step(order[:tn[1]], accuracies) / costs[tn[0]]["step_ms"][tn[1]])
    return order[:best[1]], best[0]


def distinct_4gram_ratio(tokens):
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / max(len(grams), 1)


@torch.no_grad()
def compare(model, prompts, n_new, modes, repeats, threads=(None,), picked=()):
    """Run every mode at every thread count on every prompt `repeats` times, interleaved (the order
    rotates each round). The modes named in `picked` run at every count on the first prompt only,
    then at the count that was fastest for them there (their first prompt's runs at it are kept).

    modes: {name: (decode, kwargs)}: decode is generate (plain) or a drafter's (medusa_generate,
    eagle_generate), called as decode(model, prompt, n_new[, tree], **kwargs); kwargs may bring the
    mode's own "model" and its "tree". Returns, per (mode, threads) run on every prompt: median seconds
    and new tokens per prompt (fewer than n_new where a stop token ended the text), outputs, and the
    tree decoding stats of the last repeat (None for plain decoding)."""
    keys = [(name, t) for name in modes for t in threads]
    runs = {key: {"seconds": [], "tokens": [], "outputs": [], "stats": []} for key in keys}
    for p, prompt in enumerate(prompts):
        idx = prompt.view(1, -1)
        per_prompt = {key: [] for key in keys}
        made = {key: [] for key in keys}
        for r in range(repeats):
            for name, t in keys[r % len(keys):] + keys[:r % len(keys)]:
                decode, kwargs = modes[name]
                kwargs = dict(kwargs)
                m, tree = kwargs.pop("model", model), kwargs.pop("tree", None)
                args = (m, idx, n_new) if tree is None else (m, idx, n_new, tree)
                if t is not None:
                    torch.set_num_threads(t)
                torch.manual_seed(1000 * p + r)  # sampled modes: the same seeds for every mode
                seconds, result = timed(lambda: decode(*args, **kwargs), idx.device)
                out, stats = result if isinstance(result, tuple) else (result, None)
                per_prompt[name, t].append(seconds)
                made[name, t].append(out.size(1) - idx.size(1))  # fewer than n_new when a stop token ended it
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


def summarise(runs, name, baseline, threads, n_new=None):
    """One row: mode `name` at each thread count it ran at, and at its best against `baseline` at its
    best; speeds over the tokens each side actually generated."""
    def speeds(mode):
        return {t: sum(runs[mode, t]["tokens"]) / sum(runs[mode, t]["seconds"]) for t in threads if (mode, t) in runs}
    speed, base_speed = speeds(name), speeds(baseline)
    best, base_best = max(speed, key=speed.get), max(base_speed, key=base_speed.get)
    run = runs[name, best]
    tokens = sum(len(o) for o in run["outputs"])
    row = {"tokens_per_s": speed[best], "threads": best, "tokens_per_s_by_threads": speed,
           "speedup": speed[best] / base_speed[base_best],  # best against best
           "speedup_same_threads": {t: speed[t] / base_speed[t] for t in speed if t in base_speed},
           "distinct_4gram": statistics.mean(distinct_4gram_ratio(o) for o in run["outputs"])}
    if run["stats"][0] is not None:
        steps = sum(s.steps for s in run["stats"])
        row["tokens_per_step"] = tokens / steps
        # overhead = time of a tree decoding step / time of a plain decoding step (one token), same threads
        row["overhead_per_step"] = (tokens / speed[best] / steps) / (1 / base_speed[best])
    return row


def equal_trees(models, prompts, n_new, sizes, threads, repeats=REPORT_REPEATS):
    """Greedy decoding with every drafter on its own grown tree of each size (the first n nodes of the
    order its accuracies grew: the tree grow_tree picks for n), interleaved with plain greedy: tokens per
    step and speed at equal tree size. models: {name: (model, checkpoint)}. Prints the table and
    returns {"n nodes": {name: summarise's row + "greedy_identical"}}."""
    modes = {"plain greedy": (generate, {})}
    for name, (model, ckpt) in models.items():
        order = [tuple(p) for p in ckpt["grown_order"]]
        for n in sizes:
            if n > len(order):
                raise ValueError(f"--nodes {n}: {name}'s grown order has {len(order)} nodes")
            modes[f"{name}, {n} nodes"] = (common.GENERATE[name], dict(model=model, tree=order[:n]))
    first = next(iter(models.values()))[0]
    print(f"equal trees: {len(modes)} modes x {len(threads)} thread counts x {len(prompts)} held-out prompts x "
          f"{n_new} tokens, interleaved")
    runs = compare(first, prompts, n_new, modes, repeats, threads)
    plain = runs["plain greedy", threads[0]]["outputs"]
    table = {}
    print("\n| tree | drafter | tokens/step | tokens/s (best) | speedup (best vs best) | step cost (x plain) "
          "| = plain greedy |\n|---|---|---|---|---|---|---|")
    for n in sizes:
        for name in models:
            row = summarise(runs, f"{name}, {n} nodes", "plain greedy", threads, n_new)
            same = [x == y for x, y in zip(runs[f"{name}, {n} nodes", threads[0]]["outputs"], plain)]
            row["greedy_identical"] = sum(same) / len(same)
            table.setdefault(f"{n} nodes", {})[name] = row
            print(f"| {n} nodes | {name} | {row['tokens_per_step']:.2f} | {row['tokens_per_s']:.0f} ({row['threads']} "
                  f"thr) | {row['speedup']:.2f}x | {row['overhead_per_step']:.2f} | {row['greedy_identical']:.0%} |")
    return table


def tree_label(tree) -> str:
    """How a tree reads in a table: its node count, or a dynamic tree's settings."""
    if isinstance(tree, DynamicTree):
        return f"dynamic, {tree.nodes} nodes, top-{tree.topk}, {tree.depth} deep"
    return f"{len(tree)} nodes"


@dataclass
class Drafted:
    """One trained drafter, as the report measures it."""
    name: str                     # "medusa", "eagle", "mtp"
    model: torch.nn.Module        # carries .base and the drafter's weights
    decode: object                # its decoding function (medusa_generate, eagle_generate)
    drafter: object               # its Drafter class (MedusaDrafter, FeatureDrafter), for counting ops
    tree: object                  # the tree chosen for greedy decoding: rank paths, or an eagle.DynamicTree
    order: list                   # the grown order the chosen tree is a prefix of
    accuracies: list              # what the order was grown from
    costs: dict                   # measured step costs (measure_step_costs)
    sampling_tree: list | None = None                     # grown from accuracies on sampled text
    extra: dict = field(default_factory=dict)             # more greedy trees to report: label -> tree
    training: dict = field(default_factory=dict)          # what training it took: parameters, seconds


# Modes per drafter in the report (greedy on the chosen tree and its extra trees, typical, exact):
# the plan's time estimate (training.py) counts them from here.
REPORT_PLAIN_MODES = 2


def report_modes(drafted, sampled=0.7):
    """The report's modes: plain greedy and sampling, then each drafter's."""
    modes = {"plain greedy": (generate, {}), f"plain sampling T={sampled}": (generate, dict(temperature=sampled))}
    for d in drafted:
        kw = dict(model=d.model)
        modes[f"{d.name} greedy, chosen tree ({tree_label(d.tree)})"] = (d.decode, dict(kw, tree=d.tree))
        for label, tree in d.extra.items():
            modes[f"{d.name} greedy, {label} ({tree_label(tree)})"] = (d.decode, dict(kw, tree=tree))
        modes[f"{d.name} typical T={sampled}, chosen tree"] = (
            d.decode, dict(kw, tree=d.tree, temperature=sampled, sampling="typical"))
        modes[f"{d.name} exact T={sampled}, chosen tree"] = (
            d.decode, dict(kw, tree=d.tree, temperature=sampled, sampling="exact"))
        if d.sampling_tree is not None:  # exact sampling on a tree grown for it
            modes[f"{d.name} exact T={sampled}, sampling tree ({tree_label(d.sampling_tree)})"] = (
                d.decode, dict(kw, tree=d.sampling_tree, temperature=sampled, sampling="exact"))
    return modes


def modes_per_drafter(extra_trees: int) -> int:
    """How many report modes a drafter with that many extra greedy trees adds (report_modes)."""
    return 1 + extra_trees + 3


def pick_threads(drafted, modes, threads):
    """The report modes whose thread count compare picks on the first prompt: all but the plain
    baselines, the peers and each drafter's chosen greedy tree, which run at every count (the report
    gives their speed at each). Each side still runs at its own best; the rest of the counts are left out."""
    if len(threads) < 2:
        return []
    chosen = {f"{d.name} greedy, chosen tree ({tree_label(d.tree)})" for d in drafted}
    return [name for name in modes if name not in chosen and any(name.startswith(d.name + " ") for d in drafted)]


def run_report(drafted, prompts, n_new, threads, decode_kwargs=None, peers=None, ops=True, sweep=True,
               repeats=REPORT_REPEATS, sweep_repeats=SWEEP_REPEATS):
    """The report's measurements, every drafter interleaved with plain decoding on the same prompts, best
    against best: the mode table, per-drafter summaries, ops per step, the tree-size sweep of the first
    drafter. prompts: 1-D token tensors; decode_kwargs (e.g. stop_tokens) go to every mode; peers:
    more modes measured in the same rounds ({name: (decode, kwargs)}, against plain greedy). Returns
    the report (the first drafter's figures also at the top level)."""
    first = drafted[0]
    decode_kwargs = decode_kwargs or {}
    modes = {**report_modes(drafted), **(peers or {})}
    modes = {name: (decode, {**kwargs, **decode_kwargs}) for name, (decode, kwargs) in modes.items()}
    picked = pick_threads(drafted, modes, threads)
    print(f"report: {len(modes)} modes x {len(prompts)} held-out prompts x up to {n_new} tokens, interleaved; "
          f"{len(modes) - len(picked)} at {len(threads)} thread count{'s' * (len(threads) != 1)}"
          + (f", {len(picked)} at the count fastest for them on the first prompt" if picked else ""))
    for decode, kwargs in modes.values():  # warm-up: first calls, tree buffers
        kwargs = dict(kwargs)
        m, tree = kwargs.pop("model", first.model), kwargs.pop("tree", None)
        args = (m, prompts[0].view(1, -1), 4) if tree is None else (m, prompts[0].view(1, -1), 4, tree)
        decode(*args, **kwargs)
    runs = compare(first.model, prompts, n_new, modes, repeats=repeats, threads=threads, picked=picked)
    table = {}
    for name in modes:
        baseline = "plain sampling T=0.7" if "T=0.7" in name else "plain greedy"
        table[name] = summarise(runs, name, baseline, threads)
        table[name]["drafter"] = next((d.name for d in drafted if name.startswith(d.name + " ")), None)
        if name != "plain greedy" and "T=0.7" not in name:
            same = [a == b for a, b in zip(runs[name, table[name]["threads"]]["outputs"],
                                           runs["plain greedy", threads[0]]["outputs"])]
            table[name]["greedy_identical"] = sum(same) / len(same)
    counts = {d.name: count_ops(d.model, prompts[0].view(1, -1), d.tree, n_new, d.decode, d.drafter) if ops else None
              for d in drafted}
    report = {"drafter": first.name, "drafters": {d.name: summarise_drafter(d, table, counts[d.name]) for d in drafted},
              "modes": table, "threads": threads, "prompts": len(prompts), "new_tokens": n_new, "repeats": repeats}
    chosen_name = f"{first.name} greedy, chosen tree ({tree_label(first.tree)})"
    chosen_row, best_threads = table[chosen_name], table[chosen_name]["threads"]
    report.update(tokens_per_step=chosen_row["tokens_per_step"], speedup=chosen_row["speedup"],
                  speedup_1_thread=chosen_row["speedup_same_threads"][threads[0]],
                  greedy_identical=chosen_row["greedy_identical"],
                  greedy_distinct_4=table["plain greedy"]["distinct_4gram"],  # below ~0.5: greedy text loops
                  chosen_tree=tree_json(first.tree), accuracies=first.accuracies, step_costs=first.costs,
                  sampling_tree=None if first.sampling_tree is None else tree_json(first.sampling_tree),
                  accept_lengths=[a for s in runs[chosen_name, best_threads]["stats"] for a in s.accept_lengths],
                  sample=runs[chosen_name, best_threads]["outputs"][0], sweep_threads=best_threads)
    if ops:
        report.update(ops=counts[first.name], ops_ratio=counts[first.name]["ops_ratio"],
                      host_reads_per_step=counts[first.name]["host_reads_per_step"])
    if sweep:  # the first drafter's grown trees of several sizes, greedy, against plain greedy in the same
        sizes = sorted({n for n in SWEEP_SIZES if n <= len(first.order)} | {len(first.tree)})  # rounds, at the
        sweep_modes = {"plain greedy": (generate, {})}                                       # chosen tree's threads
        sweep_modes.update({n: (first.decode, dict(model=first.model, tree=first.order[:n])) for n in sizes})
        sweep_runs = compare(first.model, prompts[:SWEEP_PROMPTS], n_new, sweep_modes, repeats=sweep_repeats,
                             threads=[best_threads])
        report["tree_size_sweep"] = []
        for n in sizes:
            row = summarise(sweep_runs, n, "plain greedy", [best_threads])
            report["tree_size_sweep"].append({"nodes": n, "tokens_per_step": row["tokens_per_step"],
                                              "speedup": row["speedup"], "expected_tokens_per_step":
                                              expected_tokens_per_step(first.order[:n], first.accuracies)})
    torch.set_num_threads(threads[-1])
    return report


def tree_json(tree):
    """A tree as a checkpoint stores it: rank paths as lists, a DynamicTree as its settings."""
    return dataclasses.asdict(tree) if isinstance(tree, DynamicTree) else [list(p) for p in tree]


DRAFTER_CLASSES = {"medusa": MedusaDrafter, "eagle": FeatureDrafter, "mtp": FeatureDrafter}


def drafted(name, model, ckpt):
    """A trained drafter as run_report measures it, from its checkpoint (trees, accuracies, step costs)."""
    extra = {label: as_tree(tree) for label, tree in ckpt.get("extra_trees", {}).items()}
    metrics = ckpt.get("metrics", {})
    training = {"seconds": metrics.get("seconds"),
                "parameters": sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.base.parameters())}
    return Drafted(name, model, common.GENERATE[name], DRAFTER_CLASSES[name], as_tree(ckpt["tree"]),
                   [tuple(p) for p in ckpt["grown_order"]], ckpt["accuracies"], ckpt["step_costs"],
                   [tuple(p) for p in ckpt["sampling_tree"]], extra, training)


def summarise_drafter(d, table, ops):
    """A drafter's row of the comparison: what it cost to train and to run, and what it gives."""
    def mode(prefix):
        rows = [(name, r) for name, r in table.items() if name.startswith(prefix)]
        name, r = max(rows, key=lambda nr: nr[1]["tokens_per_s"])  # its best tree for this mode
        return {"mode": name, "tokens_per_step": r["tokens_per_step"], "tokens_per_s": r["tokens_per_s"],
                "speedup": r["speedup"], "step_cost": r["overhead_per_step"], "threads": r["threads"]}
    greedy = [r for name, r in table.items() if name.startswith(f"{d.name} greedy")]
    return {"parameters": sum(p.numel() for p in d.model.parameters()) - sum(p.numel() for p in d.model.base.parameters()),
            "training": d.training, "tree": tree_json(d.tree),
            "greedy": mode(f"{d.name} greedy"), "typical": mode(f"{d.name} typical"), "exact": mode(f"{d.name} exact"),
            "greedy_identical": min(r["greedy_identical"] for r in greedy),
            "ops_ratio": ops and ops["ops_ratio"], "host_reads_per_step": ops and ops["host_reads_per_step"]}


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
def count_ops(model, prompt, choices, n_new=64, decode=medusa_generate, drafter=MedusaDrafter, **decode_kwargs):
    """Kernel-launching ops per plain token and per tree decoding step (decode: the drafter's decoding,
    drafter: its Drafter class), and host reads per step.

    Plain: the difference between generating 2m and m tokens (m = n/2), per token. Medusa: a whole generation
    minus its prefill, per step. ops_ratio = Medusa ops per step / plain ops per token; on a GPU,
    where a small model's step costs about one launch per op, tokens/step / ops_ratio projects the
    speedup (a projection, not a measurement)."""
    block = getattr(model, "base", model).config.block_size
    n_new = min(n_new, block - prompt.size(1))          # everything within the context
    saved = getattr(model, "draft_dtype", None)
    if saved is not None:  # counted as a GPU decodes: drafting in the base's dtype (common.draft_cheaply)
        model.draft_dtype = None
        try:
            return count_ops(model, prompt, choices, n_new, decode, drafter, **decode_kwargs)
        finally:
            model.draft_dtype = saved
    n_plain = n_new // 2                                 # plain: generate 2 * n_plain and n_plain tokens
    decode(model, prompt, n_new, choices, **decode_kwargs)  # build the tree buffers and their tables first

    def start():  # what a generation does before its first step: the prompt's forward, the drafter's start
        first = drafter(model, choices, prompt.device)
        state, h = prefill(model.base, prompt, extra=first.nodes)
        first.start(state, h)
    counts = []
    for fn in (lambda: generate(model, prompt, n_plain), lambda: generate(model, prompt, 2 * n_plain), start,
               lambda: decode(model, prompt, n_new, choices, **decode_kwargs)):
        with OpCounter() as counter:
            result = fn()
        counts.append((counter, result))
    (short, _), (long, _), (pre, _), (medusa, (_, stats)) = counts
    plain = (long.total - short.total) / n_plain
    per_step = (medusa.total - pre.total) / stats.steps
    return {"plain_ops_per_token": plain, "medusa_ops_per_step": per_step, "ops_ratio": per_step / plain,
            "host_reads_per_step": (medusa.host_reads - pre.host_reads) / stats.steps,
            "plain_host_reads_per_token": (long.host_reads - short.host_reads) / n_plain,
            "tokens_per_step": stats.tokens_per_step,
            "projected_speedup": stats.tokens_per_step / (per_step / plain),
            "medusa_ops": {k: (v - pre.ops[k]) / stats.steps for k, v in medusa.ops.most_common()}}


def format_table(report):
    """The report's table: tokens/s at each thread count, and the speedup best against best."""
    threads = report["threads"]
    lines = ["| mode | tokens/step | " + " | ".join(f"tokens/s, {t} thread{'s' * (t != 1)}" for t in threads)
             + " | speedup (best vs best) | overhead/step (x plain) | distinct 4-grams | = plain greedy |",
             "|---|---|" + "---|" * len(threads) + "---|---|---|---|"]
    for name, r in report["modes"].items():
        def f(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        speeds = " | ".join(f"{r['tokens_per_s_by_threads'][t]:.0f}" + ("*" if t == r["threads"] else "")
                            if t in r["tokens_per_s_by_threads"] else "-" for t in threads)
        lines.append(f"| {name} | {f('tokens_per_step', '.2f')} | {speeds} | "
                     + ("-" if "tokens_per_step" not in r else f"{r['speedup']:.2f}x")
                     + f" | {f('overhead_per_step', '.2f')} | {f('distinct_4gram', '.2f')} | "
                     + (f"{r['greedy_identical']:.0%}" if "greedy_identical" in r else "-") + " |")
    return "\n".join(lines) + "\n\n* = the thread count each mode runs fastest at (- = not run at that count: " \
        "slower for that mode on the first prompt); speedup = its best tokens/s over its plain baseline's best " \
        "tokens/s (sampled modes against plain sampling)."


def format_drafters(report):
    """The comparison of the drafters: each at its best tree and thread count, against plain decoding."""
    lines = ["| drafter | parameters | training | greedy: tokens/step, tokens/s, speedup | step cost (x plain) | "
             "typical T=0.7: speedup | exact T=0.7: tokens/step, speedup | = plain greedy | ops/step (x plain) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, d in report["drafters"].items():
        g, t, e = d["greedy"], d["typical"], d["exact"]
        seconds = d["training"].get("seconds")
        lines.append(f"| {name} | {d['parameters'] / 1e6:.2f}M | " + (f"{seconds:.0f} s" if seconds else "-")
                     + f" | {g['tokens_per_step']:.2f}, {g['tokens_per_s']:.0f}, **{g['speedup']:.2f}x** | "
                     f"{g['step_cost']:.2f} | {t['speedup']:.2f}x | {e['tokens_per_step']:.2f}, {e['speedup']:.2f}x | "
                     f"{d['greedy_identical']:.0%} | " + (f"{d['ops_ratio']:.2f}" if d["ops_ratio"] else "-") + " |")
    return "\n".join(lines) + "\n\nEach drafter at its best tree (of those in the mode table) and thread count, against " \
        "plain decoding at its best; step cost = a step's time over a plain step's, drafting included."


def format_ops(ops):
    return (f"ops per step (kernel-launching aten ops, views excluded): plain {ops['plain_ops_per_token']:.0f} per "
            f"token, Medusa {ops['medusa_ops_per_step']:.0f} per step = {ops['ops_ratio']:.2f}x; host reads per step "
            f"{ops['host_reads_per_step']:.2f}; projected GPU speedup {ops['tokens_per_step']:.2f} tokens/step / "
            f"{ops['ops_ratio']:.2f} = {ops['projected_speedup']:.2f}x (a projection, not a measurement)")


def stamped(results):
    """Results with the date and time (UTC) and the command that measured them, as a JSON file keeps them."""
    return {**results, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", os.path.basename(sys.argv[0]), *sys.argv[1:]])}


def write_report(report, out):
    """report.json (stamped), report.md and the PNGs; prints the table."""
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(stamped(report), f, indent=1, default=str)
    pngs = plot_report(report, out)
    table = format_table(report)
    md = [f"# medusa-mini report ({report['preset']} preset, {report['device']})", "",
          f"{report['prompts']} held-out prompts x {report['new_tokens']} new tokens; each time is the median of "
          f"{report['repeats']} interleaved runs{' (of two, their mean)' * (report['repeats'] == 2)}; the plain "
          "modes and each drafter's chosen tree run at every thread count, the other modes at the count fastest "
          "for them on the first prompt.", "",
          format_drafters(report), "", table, "", format_ops(report["ops"]), "",
          "## Tree size sweep (grown trees, greedy)", "",
          "| nodes | expected tokens/step | measured tokens/step | speedup |", "|---|---|---|---|"]
    md += [f"| {r['nodes']} | {r['expected_tokens_per_step']:.2f} | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x |"
           for r in report["tree_size_sweep"]]
    base = report.get("training", {}).get("base", {})
    if "val_loss_halves" in base:  # every position trained: later positions, with more context, are no worse
        md += ["", f"Base model held-out loss {base['val_loss']:.3f}; over the first and second half of the context's "
               f"positions: {base['val_loss_halves'][0]:.3f} and {base['val_loss_halves'][1]:.3f}."]
    joint = report.get("training", {}).get("heads", {}).get("joint")
    if joint:  # Medusa-2 changed the backbone: show that the base model's quality was kept
        md += ["", "## Medusa-2 (--joint)", "", f"Base model validation loss: {joint['val_loss_before']:.3f} before, "
               f"{joint['val_loss_after']:.3f} after joint training (tokens/step above are with the joint model)."]
    md += ["", "## Sample (chosen tree, greedy)", "", f"Distinct 4-grams in plain greedy text: "
           f"{report['greedy_distinct_4']:.2f} (1.00: no 4-gram repeats).", "", "```", report["sample"], "```", ""]
    md += [f"![{p}]({p})" for p in pngs]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n" + table)
    print("\n" + format_drafters(report))
    print("\n" + format_ops(report["ops"]))
    print(f"\nchosen tree: {len(report['chosen_tree'])} nodes; report written to {out}/report.md and report.json")


def plot_report(report, out):
    """The report's pictures; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)
        files.append(name)

    training = report.get("training", {})
    if training.get("base", {}).get("history") or training.get("heads", {}).get("history"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, part in (("base model (LM loss)", "base"), ("Medusa heads (weighted sum)", "heads")):
            h = training.get(part, {}).get("history")
            if h:
                ax.plot(h["step"], h["loss"], label=label)
        ax.set(title="Training curves", xlabel="step", ylabel="training loss")
        ax.legend()
        save(fig, "training_curves.png")
    h = training.get("base", {}).get("history", {})
    if h.get("seconds"):  # the base model's loss against wall-clock time: what a recipe is judged on
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(h["seconds"], h["loss"], label="training loss")
        ax.axhline(training["base"]["val_loss"], color="0.5", ls="--", label="final held-out loss")
        ax.set(title=f"Base model: loss against time ({report['device']})", xlabel="seconds", ylabel="loss")
        ax.legend()
        save(fig, "loss_vs_time.png")

    acc = report["accuracies"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ks = range(1, len(acc) + 1)
    ax.bar([k - 0.2 for k in ks], [a[0] for a in acc], width=0.4, label="top-1")
    ax.bar([k + 0.2 for k in ks], [sum(a[:5]) for a in acc], width=0.4, label="top-5")
    ax.set(title=f"{report['drafter']}: draft accuracy by depth, greedy decoding (held-out prompts)",
           xlabel="depth k (the draft of token t+k+1)", ylabel="accuracy", xticks=list(ks), ylim=(0, 1))
    ax.legend()
    save(fig, "head_accuracy.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lengths = report["accept_lengths"]
    ax.hist(lengths, bins=[x - 0.5 for x in range(max(lengths) + 2)], rwidth=0.8)
    ax.set(title="Accept lengths per step (chosen tree, greedy)", xlabel="tokens accepted after the root",
           ylabel="steps")
    save(fig, "accept_lengths.png")

    drafters = report.get("drafters", {})
    if len(drafters) > 1:  # the drafters side by side: speedup best against best, per mode
        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.8 / len(drafters)
        for i, (name, d) in enumerate(drafters.items()):
            ax.bar([m + (i - (len(drafters) - 1) / 2) * width for m in range(3)],
                   [d[mode]["speedup"] for mode in ("greedy", "typical", "exact")], width=width, label=name)
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set(title=f"Drafters against plain decoding ({report['device']}, best against best)",
               xticks=range(3), xticklabels=["greedy", "typical T=0.7", "exact T=0.7"], ylabel="x plain decoding")
        ax.legend()
        save(fig, "drafters.png")

    sweep = report["tree_size_sweep"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    nodes = [r["nodes"] for r in sweep]
    ax.plot(nodes, [r["expected_tokens_per_step"] for r in sweep], "o--", label="expected (from accuracies)")
    ax.plot(nodes, [r["tokens_per_step"] for r in sweep], "o-", label="measured")
    ax.set(title="Tokens per step: expected against measured", xlabel="tree nodes (grown tree)",
           ylabel="tokens per step", xscale="log", xticks=nodes, xticklabels=nodes)
    ax.legend()
    save(fig, "expected_vs_measured.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(nodes, [r["speedup"] for r in sweep], "o-", label="measured speedup")
    t = report["sweep_threads"]
    rel = report["step_costs"][t]["relative"]
    ax.plot([int(n) for n in rel], list(rel.values()), "s:", label="step cost / plain step")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set(title=f"Speedup against tree size ({report['device']}, {t} thread{'s' * (t != 1)})",
           xlabel="tree nodes (grown tree)", ylabel="x plain greedy", xscale="log", xticks=nodes, xticklabels=nodes)
    ax.legend()
    save(fig, "speedup_vs_tree_size.png")
    return files


def median_ms(fn, device, repeats=200):
    """Median time of fn() in ms over `repeats` calls, after a few warm-up calls."""
    for _ in range(5):
        fn()
    return statistics.median(timed(fn, device)[0] for _ in range(repeats)) * 1e3


PHASES = {"generate_candidates": "medusa_mini", "tree_decoding": "verify", "evaluate_posterior": "verify",
          "update_inputs": "verify"}  # verify_step's four phases, and the module each is looked up in


@torch.no_grad()
def breakdown(model, prompt, choices, n_new=128, rounds=9):
    """Where a Medusa step's time goes, actual against ideal.

    Actual: the steps of real decoding (mean time inside verify_step), whole generations (their time
    per step, which also spreads the prompt's prefill over the steps), and each phase timed inside
    real decoding (means over the steps). Ideal: on the same cache, the tree forward alone, the
    heads alone and the bookkeeping (candidates, acceptance, cache and token updates) alone, each
    warm and in isolation (medians of 25). The two are measured in alternating rounds, so that a
    machine whose speed drifts (a shared VM's does, within a minute) slows both
    alike: medians over rounds, and a ratio is the median of the rounds' ratios. Returns the
    figures; prints the table."""
    device = prompt.device
    times, originals = {}, {}

    def wrap(owner, name, label):
        originals[(owner, name)] = fn = getattr(owner, name)

        def timed_fn(*a, **k):
            seconds, result = timed(lambda: fn(*a, **k), device)
            times.setdefault(label, []).append(seconds)
            return result
        setattr(owner, name, timed_fn)

    def timed_inside(targets):  # one generation, each (owner, attribute, label) timed inside it
        times.clear()           # -> ({label: mean ms per call}, ms per step of the generation, its stats)
        for owner, attr, label in targets:
            wrap(owner, attr, label)
        try:
            seconds, (_, stats) = timed(lambda: medusa_generate(model, prompt, n_new, choices), device)
        finally:
            for (owner, attr), fn in originals.items():
                setattr(owner, attr, fn)
            originals.clear()
        return {name: statistics.fmean(v) * 1e3 for name, v in times.items()}, seconds / stats.steps * 1e3, stats

    # Ideal: the same work, each part alone on the cache of the prompt.
    drafter = MedusaDrafter(model, choices, device)
    buffers = drafter.full
    state, h = prefill(model.base, prompt, extra=drafter.nodes)
    drafter.start(state, h)
    S = state.tokens.size(1)
    tree_tokens, candidates = generate_candidates(state.logits, drafter.head_logits, buffers)

    def tree_pass():
        out = tree_decoding(model.base, tree_tokens, buffers, state.cache)
        state.cache.rollback(S)
        return out
    h, logits = tree_pass()
    nodes = buffers.retrieve_indices[0, :buffers.depth + 1]

    def bookkeeping():  # everything of a step but the two forwards: candidates, acceptance, updates
        _, cand = generate_candidates(state.logits, drafter.head_logits, buffers)
        best, accept = evaluate_posterior(gather_paths(logits, buffers), cand)
        state.buffer[0, S:S + len(nodes)] = cand[0]
        state.cache.length = S + len(buffers.node_paths)
        state.cache.keep(S, nodes)
        state.cache.rollback(S)
        return best, accept, logits[buffers.rows[0][-1]]

    def plain_forward():  # one plain decoding step on the same cache, for comparison
        out = model.base(prompt[:, -1:], cache=state.cache)
        state.cache.rollback(S)
        return out
    ideal_parts = {"tree forward": tree_pass, "heads": lambda: drafter.stack(h[0], buffers.depth),
                   "bookkeeping": bookkeeping}

    medusa_generate(model, prompt, n_new, choices)  # warm-up
    per_round = []
    for _ in range(rounds):
        plain = timed(lambda: generate(model, prompt, n_new), device)[0] / n_new * 1e3
        row, generation, stats = timed_inside([(verify, "verify_step", "step")])
        row.update({"plain": plain, "generation per step": generation,
                    "plain alone": median_ms(plain_forward, device, 25)})
        row.update(timed_inside([(sys.modules[module], name, name) for name, module in PHASES.items()]
                                + [(HeadStack, "__call__", "heads in decoding")])[0])
        row.update({name: median_ms(fn, device, 25) for name, fn in ideal_parts.items()})
        row["ideal step"] = sum(row[name] for name in ideal_parts)
        row["ratio"] = row["step"] / row["ideal step"]
        row["generation ratio"] = row["generation per step"] / row["ideal step"]
        per_round.append(row)
    med = {key: statistics.median(row[key] for row in per_round) for key in per_round[0]}
    plain, step = med["plain"], med["step"]

    print(f"{rounds} rounds, each: a plain generation, a Medusa generation, one with its phases timed, "
          f"and each ideal part alone (medians of 25); medians over the rounds")
    print(f"plain step {plain:.2f} ms in real decoding; Medusa step {step:.2f} ms ({step / plain:.2f}x) "
          f"with a {len(choices)}-node tree, {stats.tokens_per_step:.2f} tokens/step")
    print(f"(whole generations: {med['generation per step']:.2f} ms per Medusa step, the prompt's prefill "
          f"spread over the steps; plain decoding's {plain:.2f} ms per token includes its prefill too)")
    print("\nactual: each phase inside real decoding, mean over the steps")
    for name in list(PHASES) + ["heads in decoding"]:
        label = "heads (drafter.commit)" if name == "heads in decoding" else name  # after the four phases
        print(f"  {label:24s} {med[name]:7.3f} ms ({med[name] / plain:.2f}x a plain step)")
    print("\nideal: each part alone on the same cache, warm")
    for name in list(ideal_parts) + ["ideal step"]:
        print(f"  {name:24s} {med[name]:7.3f} ms ({med[name] / plain:.2f}x a plain step)")
    print(f"  {'(a plain step alone)':24s} {med['plain alone']:7.3f} ms")
    ratios = sorted(row["ratio"] for row in per_round)
    print(f"\nactual step / ideal step = {med['ratio']:.2f} (rounds from {ratios[0]:.2f} to {ratios[-1]:.2f}); "
          f"whole generations per step / ideal step = {med['generation ratio']:.2f}")
    return {"plain_step_ms": plain, "step_ms": step, "generation_ms_per_step": med["generation per step"],
            "tokens_per_step": stats.tokens_per_step,
            "actual_ms": {name: med[name] for name in list(PHASES) + ["heads in decoding"]},
            "ideal_ms": {name: med[name] for name in ideal_parts}, "ideal_step_ms": med["ideal step"],
            "plain_alone_ms": med["plain alone"], "actual_over_ideal": med["ratio"],
            "generation_over_ideal": med["generation ratio"], "rounds": per_round}


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


def chi_square(counts, probs):
    """Pearson's chi-square test of draws against the probabilities they should follow: counts and probs
    of the same shape. Cells expecting fewer than 5 draws are pooled into one, when there are any.

    Returns (p-value, the cell (an index into probs) contributing most, its observed and expected
    counts). A p-value far below the false alarm rate chosen (1e-3 in the tests) says the draws do not
    follow the probabilities."""
    n = counts.sum()
    expected = probs.flatten().double() * n
    observed = counts.flatten().double()
    contribution = (observed - expected) ** 2 / expected
    small = expected < 5
    worst = int(contribution.masked_fill(small, -1).argmax())
    if small.any():  # no pooled cell when none is small: it would be 0 / 0
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))
    cell = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), probs.shape))
    return p, cell, int(counts.flatten()[worst]), float(probs.flatten()[worst] * n)


def accepted_depth(ranks, tree):
    """How deep a sample goes into the tree: ranks[k] is the rank of its token k+1 after the root in
    head k+1's list (-1: not in it); the tree is a set of rank paths, prefix-closed."""
    d = 0
    while d < len(ranks) and tuple(ranks[:d + 1]) in tree:
        d += 1
    return d


@torch.no_grad()
def exact_sampling_ceiling(model, prompts, temperature, sizes, new_tokens=96, every=4, draws=384, ranked=256, ranks=10,
                           eagle=None):
    """Exact sampling's tokens/step with our heads' proposals, the best any heads could make, and the
    best a drafter conditioned on its path could make (and EAGLE's, when an EagleModel is given).

    The tree walk is lossless, so a step commits the root and then the longest prefix of a sample from
    the model that the tree holds: tokens/step can be measured by sampling, without decoding. At every
    `every`-th position of a sample of new_tokens from each prompt, `draws` continuations of the root
    and len(model.heads) tokens are drawn. Each set of proposals ranks the drawn tokens at each depth:
    - heads: our heads' top guesses, made before the root is drawn;
    - ceiling: the tokens ranked by how often the first `ranked` draws hold them at that depth: the
      model's own distribution of the tokens after the root, the most a head can know (it guesses
      before the root is drawn, the same guesses on every branch);
    - conditional: the model's own top tokens given each draw's path so far (root included): what a
      drafter that conditions on the tokens before it could know at best;
    - eagle: the EAGLE layer's top tokens along each draw's path (eagle.chain_outputs).
    Trees are grown from each set's accuracies on the first `ranked` draws and scored on the others.
    Returns {"heads", "ceiling", "conditional"[, "eagle"]: {size: tokens/step}, "positions": count}."""
    base = model.base
    D, V = len(model.heads), base.config.vocab_size
    names = ["heads", "ceiling", "conditional"] + (["eagle"] if eagle is not None else [])
    found = {name: [] for name in names}           # per position: (draws, D) ranks, -1 where not within `ranks`
    for prompt in prompts:
        sample = generate(model, prompt.view(1, -1), new_tokens, temperature)[0]
        last = min(sample.numel(), base.config.block_size - D - 1)  # the draws must fit in the context
        for t in range(prompt.numel(), last + 1, every):
            context = sample[None, :t]                                                   # (1, t)
            seq = generate(model, context.expand(draws, -1), D + 1, temperature)        # (draws, t + D + 1)
            drawn = seq[:, t + 1:]                                                       # (draws, D) after the root
            h = base.hidden(seq)                                                         # (draws, t + D + 1, C)
            heads = model.head_logits(h[0, t - 1]).topk(ranks, -1).indices               # (D, ranks), before the root
            counts = [torch.bincount(drawn[:ranked, k], minlength=V) for k in range(D)]  # D x (V,)
            ceiling = torch.stack([c.topk(ranks).indices for c in counts])               # (D, ranks)
            found["heads"].append(_rank_in_lists(heads, drawn, ranks))
            found["ceiling"].append(_rank_in_lists(ceiling, drawn, ranks))
            logits = base.lm_head(h[:, t:t + D])                                         # (draws, D, V): given the path
            found["conditional"].append(_rank_in_logits(logits, drawn, ranks))
            if eagle is not None:  # the entries at position t - 1 draft depth d along each draw's path
                outs = [layer.norm_out(out[:, t - 1]) for layer, out in chain_outputs(eagle, seq, D, h)]
                found["eagle"].append(_rank_in_logits(base.lm_head(torch.stack(outs, 1)), drawn, ranks))

    result = {"positions": len(found["heads"])}
    for name in names:
        per_position = torch.stack(found[name])                                          # (positions, draws, D)
        train, test = per_position[:, :ranked].flatten(0, 1), per_position[:, ranked:].flatten(0, 1)
        reached = torch.cumprod(torch.cat([torch.ones_like(train[:, :1]), train[:, :-1] >= 0], 1), 1).bool()
        accuracies = [[float(((train[:, k] == r) & reached[:, k]).sum() / reached[:, k].sum().clamp(min=1))
                       for r in range(ranks)] for k in range(D)]                        # given the path in reach
        if name in ("heads", "ceiling"):  # guesses made before the root: each depth's own frequency
            accuracies = [[float((train[:, k] == r).float().mean()) for r in range(ranks)] for k in range(D)]
        order = grow_tree(accuracies, max(sizes))
        rows = test.tolist()
        result[name] = {n: statistics.fmean(1 + accepted_depth(r, set(order[:n])) for r in rows) for n in sizes}
    return result


def _rank_in_lists(lists, drawn, ranks):
    """lists (D, ranks) token ids per depth, drawn (N, D) -> (N, D): each drawn token's rank in its depth's
    list, or -1."""
    hit = drawn[:, :, None] == lists                                                     # (N, D, ranks)
    return torch.where(hit.any(-1), hit.int().argmax(-1), -1)


def _rank_in_logits(logits, drawn, ranks):
    """logits (N, D, V) per draw and depth, drawn (N, D) -> (N, D): the drawn token's rank in them (how many
    tokens score higher), or -1 past `ranks`."""
    rank = (logits > logits.gather(-1, drawn[..., None])).sum(-1)                         # (N, D)
    return torch.where(rank < ranks, rank, -1)


def format_ceiling(ceiling, temperature):
    sizes = list(ceiling["heads"])
    lines = [f"exact sampling at T={temperature}, tokens/step on {ceiling['positions']} positions of sampled text",
             "| proposals | " + " | ".join(f"{n} nodes" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    labels = {"heads": "our Medusa heads", "ceiling": "any Medusa heads at best: the model's own distribution of "
              "each future token (the ceiling)", "conditional": "a perfect conditional drafter: the model's own top "
              "tokens given each node's path", "eagle": "our EAGLE layer"}
    for name, label in labels.items():
        if name in ceiling:
            lines.append(f"| {label} | " + " | ".join(f"{ceiling[name][n]:.2f}" for n in sizes) + " |")
    return "\n".join(lines)
