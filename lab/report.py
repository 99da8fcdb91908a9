"""The report's measurements: every trained drafter against plain decoding of the same model, on the same
held-out prompts, interleaved, best against best (lab/timing.py). train_heads.py measures it at the end of a
run, benchmark.py again on a finished one; lab/report_files.py writes it down, lab/plots.py draws it.
"""
from dataclasses import dataclass, field

import torch

from lab import timing
from lab.ops import count_ops
from lab.dtypes import dtype_name
from lab.timing import Mode
from lab.tree_choice import SAMPLE_T, Trees, tree_json, tree_label
from medusa_mini import generate
from tree import expected_tokens_per_step

REPORT_PROMPT, REPORT_REPEATS = 32, 2                                # held-out prompt tokens, rounds per prompt
SWEEP_PROMPTS, SWEEP_REPEATS, SWEEP_SIZES = 5, 2, (1, 2, 4, 8, 16, 32, 64)  # the tree-size sweep


@dataclass
class Drafted:
    """One trained drafter, as the report measures it."""
    kind: object                  # its lab.drafters.DrafterKind
    model: torch.nn.Module        # carries .base and the drafter's weights
    trees: Trees                  # its trees for the model's decoding dtype
    training: dict = field(default_factory=dict)  # what training it took: parameters, seconds

    @property
    def name(self):
        return self.kind.name


def parameters(model) -> int:
    """The drafter's own parameters: the model's, less its base's."""
    return sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.base.parameters())


def report_modes(drafted, sampled=SAMPLE_T) -> dict:
    """The report's modes: plain greedy and sampling, then each drafter's greedy trees, typical acceptance
    and exact sampling. The plain modes and each drafter's chosen greedy tree run at every thread count;
    compare picks one for the rest."""
    plain_sampled = f"plain sampling T={sampled}"
    modes = {"plain greedy": Mode(generate), plain_sampled: Mode(generate, dict(temperature=sampled),
                                                                  sampling="sampled", baseline=plain_sampled)}
    for d in drafted:
        t = d.trees

        def mode(tree, sampling="greedy", every=False):
            kwargs = {} if sampling == "greedy" else dict(temperature=sampled, sampling=sampling)
            baseline = "plain greedy" if sampling == "greedy" else plain_sampled
            return Mode(d.kind.generate, kwargs, d.model, tree, d.name, sampling, baseline, every)
        modes[f"{d.name} greedy, chosen tree ({tree_label(t.tree)})"] = mode(t.tree, every=True)
        for label, tree in t.extra.items():
            modes[f"{d.name} greedy, {label} ({tree_label(tree)})"] = mode(tree)
        modes[f"{d.name} typical T={sampled}, chosen tree"] = mode(t.tree, "typical")
        modes[f"{d.name} exact T={sampled}, chosen tree"] = mode(t.tree, "exact")
        if t.sampling_tree is not None:  # exact sampling on a tree grown for it
            modes[f"{d.name} exact T={sampled}, sampling tree ({tree_label(t.sampling_tree)})"] = mode(
                t.sampling_tree, "exact")
    return modes


def summarise_drafter(d, modes, table, ops):
    """A drafter's row of the comparison: what it cost to train and to run, and what it gives."""
    def best(sampling):
        rows = [(name, table[name]) for name, m in modes.items() if m.drafter == d.name and m.sampling == sampling]
        name, r = max(rows, key=lambda nr: nr[1]["tokens_per_s"])  # its best tree for this mode
        return {"mode": name, "tokens_per_step": r["tokens_per_step"], "tokens_per_s": r["tokens_per_s"],
                "speedup": r["speedup"], "step_cost": r["overhead_per_step"], "threads": r["threads"]}
    greedy = [table[name] for name, m in modes.items() if m.drafter == d.name and m.sampling == "greedy"]
    return {"parameters": parameters(d.model), "training": d.training, "tree": tree_json(d.trees.tree),
            "greedy": best("greedy"), "typical": best("typical"), "exact": best("exact"),
            "greedy_identical": min(r["greedy_identical"] for r in greedy),
            "ops_ratio": ops and ops["ops_ratio"], "host_reads_per_step": ops and ops["host_reads_per_step"]}


REFERENCE = "plain greedy, float32"  # the float32 model's plain greedy, where the drafters decode in another dtype


def run_report(drafted, prompts, n_new, threads, decode_kwargs=None, peers=None, ops=True, sweep=True,
               repeats=REPORT_REPEATS, sweep_repeats=SWEEP_REPEATS, reference=None, engine=None):
    """The report's measurements, every drafter interleaved with plain decoding on the same prompts, best
    against best: the mode table, per-drafter summaries, ops per step, the tree-size sweep of the first
    drafter. prompts: 1-D token tensors; decode_kwargs (e.g. stop_tokens) go to every mode; peers: more
    modes measured in the same rounds ({label: Mode}, against plain greedy or their own baseline); engine:
    what the peers' runs say beside ours (engine(runs, modes, table) -> dict: lab/llama_cpp.py, side_by_side),
    kept as report["engine"]. reference: the float32 base,
    where the drafted models decode in another dtype: its plain greedy runs in the same rounds, the
    precision's agreement with it is measured (precision_agreement) and each drafter is also compared
    with the fastest plain decoding at either precision. Returns the report (the first drafter's figures
    also at the top level)."""
    first = drafted[0]
    modes = {**report_modes(drafted), **(peers or {})}
    if reference is not None:
        modes[REFERENCE] = Mode(generate, model=reference)
    for mode in modes.values():
        mode.kwargs = {**mode.kwargs, **(decode_kwargs or {})}
    spread = [m for m in modes.values() if not m.every_thread_count]
    print(f"report: {len(modes)} modes x {len(prompts)} held-out prompts x up to {n_new} tokens, interleaved; "
          f"{len(modes) - len(spread)} at {len(threads)} thread count{'s' * (len(threads) != 1)}"
          + (f", {len(spread)} at the count fastest for them on the first prompt" if len(threads) > 1 and spread else ""))
    for mode in modes.values():  # warm-up: first calls, tree buffers
        mode.run(first.model, prompts[0].view(1, -1), 4)
    runs = timing.compare(first.model, prompts, n_new, modes, repeats=repeats, threads=threads)
    table = {}
    for name, mode in modes.items():
        table[name] = timing.summarise(runs, name, mode.baseline, threads)
        table[name]["drafter"] = mode.drafter
        if name != "plain greedy" and mode.sampling == "greedy":
            table[name]["greedy_identical"] = timing.identical_share(runs, name, "plain greedy", threads)
    counts = {d.name: count_ops(d.kind, d.model, prompts[0].view(1, -1), d.trees.tree, n_new) if ops else None
              for d in drafted}
    report = {"drafter": first.name, "modes": table, "threads": threads, "prompts": len(prompts),
              "new_tokens": n_new, "repeats": repeats,
              "drafters": {d.name: summarise_drafter(d, modes, table, counts[d.name]) for d in drafted}}
    chosen_name = f"{first.name} greedy, chosen tree ({tree_label(first.trees.tree)})"
    chosen_row, best_threads = table[chosen_name], table[chosen_name]["threads"]
    report.update(tokens_per_step=chosen_row["tokens_per_step"], speedup=chosen_row["speedup"],
                  speedup_1_thread=chosen_row["speedup_same_threads"][threads[0]],
                  greedy_identical=chosen_row["greedy_identical"],
                  greedy_distinct_4=table["plain greedy"]["distinct_4gram"],  # below ~0.5: greedy text loops
                  chosen_tree=tree_json(first.trees.tree), accuracies=first.trees.accuracies,
                  step_costs=first.trees.costs,
                  sampling_tree=None if first.trees.sampling_tree is None else tree_json(first.trees.sampling_tree),
                  accept_lengths=[a for s in runs[chosen_name, best_threads]["stats"] for a in s.accept_lengths],
                  sample=runs[chosen_name, best_threads]["outputs"][0], sweep_threads=best_threads)
    if reference is not None:
        report["precision"] = precision_agreement(runs, modes, table, reference, prompts, threads)
    if engine is not None:
        report["engine"] = engine(runs, modes, table)
    if ops:
        report.update(ops=counts[first.name], ops_ratio=counts[first.name]["ops_ratio"],
                      host_reads_per_step=counts[first.name]["host_reads_per_step"])
    if sweep:  # the first drafter's grown trees of several sizes, greedy, against plain greedy, at the chosen
        order = first.trees.order  # tree's thread count
        sizes = sorted({n for n in SWEEP_SIZES if n <= len(order)} | {len(first.trees.tree)})
        sweep_modes = {"plain greedy": Mode(generate)}
        sweep_modes.update({n: Mode(first.kind.generate, model=first.model, tree=order[:n], drafter=first.name)
                            for n in sizes})
        sweep_runs = timing.compare(first.model, prompts[:SWEEP_PROMPTS], n_new, sweep_modes, repeats=sweep_repeats,
                                    threads=[best_threads])
        report["tree_size_sweep"] = []
        for n in sizes:
            row = timing.summarise(sweep_runs, n, "plain greedy", [best_threads])
            report["tree_size_sweep"].append({"nodes": n, "tokens_per_step": row["tokens_per_step"],
                                              "speedup": row["speedup"], "expected_tokens_per_step":
                                              expected_tokens_per_step(order[:n], first.trees.accuracies)})
    return report


@torch.no_grad()
def precision_agreement(runs, modes, table, reference, prompts, threads):
    """How far greedy decoding in the drafted models' dtype follows the float32 model's greedy text, from the
    report's own runs: for plain greedy and each drafter's greedy modes, the tokens written before the first
    one that differs from the float32 text, per prompt (all of them: identical), and the float32 model's
    top-2 logit margin at that position (how near a tie it was). Speculation adds no error of its own when
    a drafter's runs agree about as long as plain decoding's (agreed_vs_plain near 1). Also each mode's
    speed against the fastest plain decoding at either precision (best against best across precisions)."""
    def output(name):
        t = next(t for t in threads if (name, t) in runs)
        return runs[name, t]["outputs"]
    ref = output(REFERENCE)
    margins = []
    for prompt, tokens in zip(prompts, ref):
        seq = torch.cat([prompt, torch.tensor(tokens, dtype=prompt.dtype, device=prompt.device)])  # (S + n,)
        logits = reference(seq.view(1, -1))[0, prompt.numel() - 1:]    # (1, S + n) -> (n + 1, V): the n + 1 next tokens
        top2 = logits.float().topk(2, dim=-1).values                     # (n + 1, 2)
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
    fastest_plain = max(table[name]["tokens_per_s"] for name in ("plain greedy", REFERENCE))
    rows = {}
    for name, mode in modes.items():
        if mode.sampling != "greedy" or name == REFERENCE or (mode.drafter is None and name != "plain greedy"):
            continue
        agreed = []
        for out, r in zip(output(name), ref):
            n = next((i for i, (a, b) in enumerate(zip(out, r)) if a != b), min(len(out), len(r)))
            agreed.append(n)
        rows[name] = {"agreed": agreed, "mean_agreed": sum(agreed) / len(agreed),
                      "identical": sum(a == len(r) for a, r in zip(agreed, ref)),
                      "margin_at_divergence": [None if a == len(r) else m[a] for a, r, m in zip(agreed, ref, margins)],
                      "vs_fastest_plain": table[name]["tokens_per_s"] / fastest_plain}
    plain = rows["plain greedy"]["mean_agreed"]
    for row in rows.values():
        row["agreed_vs_plain"] = row["mean_agreed"] / plain if plain else float("nan")
    dtype = dtype_name(next(m.model for m in modes.values() if m.drafter).base.lm_head.weight.dtype)
    return {"dtype": dtype, "prompts": len(prompts), "modes": rows, "fastest_plain_tokens_per_s": fastest_plain,
            "fastest_plain": max(("plain greedy", REFERENCE), key=lambda n: table[n]["tokens_per_s"])}


def equal_trees(drafted, prompts, n_new, sizes, threads, repeats=REPORT_REPEATS):
    """Greedy decoding with every drafter on its own grown tree of each size (the first n nodes of the
    order its accuracies grew: the tree grow_tree picks for n), interleaved with plain greedy: tokens per
    step and speed at equal tree size. Prints the table and returns {"n nodes": {name: summarise's row +
    "greedy_identical"}}. A size past a drafter's grown order is skipped for it, and said."""
    modes = {"plain greedy": Mode(generate)}
    for d in drafted:
        for n in sizes:
            if n <= len(d.trees.order):
                modes[f"{d.name}, {n} nodes"] = Mode(d.kind.generate, model=d.model, tree=d.trees.order[:n],
                                                     drafter=d.name)
            else:
                print(f"equal trees: {d.name}'s grown order has {len(d.trees.order)} nodes, not {n}")
    print(f"equal trees: {len(modes)} modes x {len(threads)} thread counts x {len(prompts)} held-out prompts x "
          f"{n_new} tokens, interleaved")
    runs = timing.compare(drafted[0].model, prompts, n_new, modes, repeats, threads)
    table = {}
    print("\n| tree | drafter | tokens/step | tokens/s (best) | speedup (best vs best) | step cost (x plain) "
          "| = plain greedy |\n|---|---|---|---|---|---|---|")
    for n in sizes:
        for d in drafted:
            name = f"{d.name}, {n} nodes"
            if name not in modes:
                continue
            row = timing.summarise(runs, name, "plain greedy", threads)
            row["greedy_identical"] = timing.identical_share(runs, name, "plain greedy", threads)
            table.setdefault(f"{n} nodes", {})[d.name] = row
            print(f"| {n} nodes | {d.name} | {row['tokens_per_step']:.2f} | {row['tokens_per_s']:.0f} ({row['threads']} "
                  f"thr) | {row['speedup']:.2f}x | {row['overhead_per_step']:.2f} | {row['greedy_identical']:.0%} |")
    return table


