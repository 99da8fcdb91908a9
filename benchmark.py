"""Medusa against plain KV-cached decoding of the same model, in the same process, interleaved.

    python benchmark.py --out out --threads 1      # re-run the report on a trained out/heads.pt

Every figure is a median over interleaved repeats: on a small shared machine, timings drift, and
running the sides one after the other would hand the drift to one of them. Writes out/report.json,
out/report.md and PNGs, and prints the table.
"""
import argparse
import json
import os
import statistics
import time

import sys

import torch

import common
from common import random_prompts, sync
from medusa_mini import generate, medusa_generate
from tree import dense_tree, expected_tokens_per_step

DENSE_WIDTHS = [3, 3, 2]  # 3 + 9 + 18 = 30 nodes: the dense tree the report compares against


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t0, result


@torch.no_grad()
def measure_step_costs(model, order, val_ids, device, sizes=None, repeats=5, n_new=48):
    """Time of one Medusa step with the first n nodes of `order`, relative to one plain decoding step.

    Measured as decoding really runs, not as an isolated step: whole greedy generations of n_new
    tokens from a held-out prompt (so per-step bookkeeping and weights fetched afresh each step are
    counted), Medusa time per step over plain time per token, sizes interleaved, medians."""
    sizes = sizes or [n for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64) if n <= len(order)]
    prompt = torch.as_tensor(val_ids[:64].astype("int64"), device=device).view(1, -1)
    per_step = {n: [] for n in ["plain"] + sizes}
    for _ in range(repeats):
        seconds, _ = timed(lambda: generate(model, prompt, n_new), device)
        per_step["plain"].append(seconds / n_new)
        for n in sizes:
            seconds, (_, stats) = timed(lambda: medusa_generate(model, prompt, n_new, order[:n]), device)
            per_step[n].append(seconds / stats.steps)
    plain = statistics.median(per_step["plain"])
    return {"plain_step_ms": plain * 1e3,
            "step_ms": {n: statistics.median(per_step[n]) * 1e3 for n in sizes},
            "relative": {n: statistics.median(per_step[n]) / plain for n in sizes}}


def distinct_4gram_ratio(tokens):
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / max(len(grams), 1)


@torch.no_grad()
def compare(model, prompts, n_new, modes, repeats):
    """Run every mode on every prompt `repeats` times, interleaved (the order rotates each round).

    modes: {name: (kind, kwargs)} with kind "plain" or "medusa". Returns per mode: median seconds per
    prompt, outputs, and the Medusa stats of the last repeat."""
    names = list(modes)
    runs = {name: {"seconds": [], "outputs": [], "stats": []} for name in names}
    for p, prompt in enumerate(prompts):
        idx = prompt.view(1, -1)
        per_prompt = {name: [] for name in names}
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                kind, kwargs = modes[name]
                torch.manual_seed(1000 * p + r)  # sampled modes: the same seeds for every mode
                if kind == "plain":
                    seconds, out = timed(lambda: generate(model, idx, n_new, **kwargs), idx.device)
                    stats = None
                else:
                    seconds, (out, stats) = timed(lambda: medusa_generate(model, idx, n_new, **kwargs), idx.device)
                per_prompt[name].append(seconds)
                if r == repeats - 1:
                    runs[name]["outputs"].append(out[0, idx.size(1):].tolist())
                    runs[name]["stats"].append(stats)
        for name in names:
            runs[name]["seconds"].append(statistics.median(per_prompt[name]))
    return runs


def summarise(run, plain_run, n_new):
    """Tokens per step, speed and speedup of one mode against its plain baseline."""
    seconds, plain_seconds = sum(run["seconds"]), sum(plain_run["seconds"])
    tokens = n_new * len(run["seconds"])
    row = {"tokens_per_s": tokens / seconds, "speedup": plain_seconds / seconds,
           "distinct_4gram": statistics.mean(distinct_4gram_ratio(o) for o in run["outputs"])}
    if run["stats"][0] is not None:
        steps = sum(s.steps for s in run["stats"])
        row["tokens_per_step"] = tokens / steps
        # overhead = time of a Medusa step / time of a plain decoding step (one token)
        row["overhead_per_step"] = (seconds / steps) / (plain_seconds / tokens)
    return row


def run_report(model, enc, val_ids, chosen, order, accuracies, costs, args, training=None):
    """The report's measurements: the mode table, the tree-size sweep, and what was trained."""
    device = next(model.parameters()).device
    n_new = args.report_tokens
    prompts = random_prompts(val_ids, args.report_prompts, 32, args.seed + 5, device)
    big = order[:64]
    dense = dense_tree(DENSE_WIDTHS[:len(model.heads)])
    modes = {
        "plain greedy": ("plain", {}),
        f"medusa greedy, chosen tree ({len(chosen)} nodes)": ("medusa", dict(choices=chosen)),
        f"medusa greedy, grown tree ({len(big)} nodes)": ("medusa", dict(choices=big)),
        f"medusa greedy, dense {'x'.join(map(str, DENSE_WIDTHS))} ({len(dense)} nodes)": ("medusa", dict(choices=dense)),
        "plain sampling T=0.7": ("plain", dict(temperature=0.7)),
        "medusa typical T=0.7, chosen tree": ("medusa", dict(choices=chosen, temperature=0.7, sampling="typical")),
        "medusa exact T=0.7, chosen tree": ("medusa", dict(choices=chosen, temperature=0.7, sampling="exact")),
    }
    print(f"report: {len(modes)} modes x {len(prompts)} held-out prompts x {n_new} tokens, interleaved")
    runs = compare(model, prompts, n_new, modes, repeats=3)
    table = {}
    for name, run in runs.items():
        baseline = runs["plain sampling T=0.7" if "T=0.7" in name else "plain greedy"]
        table[name] = summarise(run, baseline, n_new)
        if "greedy" in name and name != "plain greedy":
            same = [a == b for a, b in zip(run["outputs"], runs["plain greedy"]["outputs"])]
            table[name]["greedy_identical"] = sum(same) / len(same)
    chosen_name = next(n for n in modes if "chosen tree" in n and "greedy" in n)

    # Tree-size sweep: grown trees of several sizes, greedy, against plain greedy in the same rounds.
    sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= len(order)} | {len(chosen)})
    sweep_modes = {"plain greedy": ("plain", {})}
    sweep_modes.update({n: ("medusa", dict(choices=order[:n])) for n in sizes})
    sweep_runs = compare(model, prompts[:5], n_new, sweep_modes, repeats=2)
    sweep = []
    for n in sizes:
        row = summarise(sweep_runs[n], sweep_runs["plain greedy"], n_new)
        sweep.append({"nodes": n, "expected_tokens_per_step": expected_tokens_per_step(order[:n], accuracies),
                      "tokens_per_step": row["tokens_per_step"], "speedup": row["speedup"]})

    chosen_row = table[chosen_name]
    accept_lengths = [a for s in runs[chosen_name]["stats"] for a in s.accept_lengths]
    sample = runs[chosen_name]["outputs"][0]
    return {
        "tokens_per_step": chosen_row["tokens_per_step"], "speedup": chosen_row["speedup"],
        "greedy_identical": chosen_row["greedy_identical"],
        "device": str(device), "threads": torch.get_num_threads(), "preset": args.preset,
        "prompts": len(prompts), "new_tokens": n_new, "chosen_tree": [list(p) for p in chosen],
        "modes": table, "tree_size_sweep": sweep, "accept_lengths": accept_lengths,
        "accuracies": accuracies, "step_costs": costs, "training": training or {},
        "sample": enc.decode(prompts[0].tolist()) + "[...]" + enc.decode(sample),
    }


def format_table(report):
    lines = ["| mode | tokens/step | tokens/s | speedup | overhead/step (x plain) | distinct 4-grams | = plain greedy |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["modes"].items():
        def f(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        lines.append(f"| {name} | {f('tokens_per_step', '.2f')} | {f('tokens_per_s', '.0f')} | {f('speedup', '.2f')}x"
                     f" | {f('overhead_per_step', '.2f')} | {f('distinct_4gram', '.2f')} | "
                     + (f"{r['greedy_identical']:.0%}" if "greedy_identical" in r else "-") + " |")
    return "\n".join(lines)


def write_report(report, out):
    """report.json, report.md and the PNGs; prints the table."""
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    pngs = plot_report(report, out)
    table = format_table(report)
    md = [f"# medusa-mini report ({report['preset']} preset, {report['device']}, {report['threads']} threads)", "",
          f"{report['prompts']} held-out prompts x {report['new_tokens']} new tokens; times are medians of "
          "3 interleaved runs. Speedup = plain time / Medusa time for the same model and tokens "
          "(sampled modes against plain sampling).", "", table, "",
          "## Tree size sweep (grown trees, greedy)", "",
          "| nodes | expected tokens/step | measured tokens/step | speedup |", "|---|---|---|---|"]
    md += [f"| {r['nodes']} | {r['expected_tokens_per_step']:.2f} | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x |"
           for r in report["tree_size_sweep"]]
    joint = report.get("training", {}).get("heads", {}).get("joint")
    if joint:  # Medusa-2 changed the backbone: show that the base model's quality was kept
        md += ["", "## Medusa-2 (--joint)", "", f"Base model validation loss: {joint['val_loss_before']:.3f} before, "
               f"{joint['val_loss_after']:.3f} after joint training (tokens/step above are with the joint model)."]
    md += ["", "## Sample (chosen tree, greedy)", "", "```", report["sample"], "```", ""]
    md += [f"![{p}]({p})" for p in pngs]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n" + table)
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

    acc = report["accuracies"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ks = range(1, len(acc) + 1)
    ax.bar([k - 0.2 for k in ks], [a[0] for a in acc], width=0.4, label="top-1")
    ax.bar([k + 0.2 for k in ks], [sum(a[:5]) for a in acc], width=0.4, label="top-5")
    ax.set(title="Head accuracy during greedy decoding (held-out prompts)", xlabel="head k (guesses token t+k+1)",
           ylabel="accuracy", xticks=list(ks), ylim=(0, 1))
    ax.legend()
    save(fig, "head_accuracy.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lengths = report["accept_lengths"]
    ax.hist(lengths, bins=[x - 0.5 for x in range(max(lengths) + 2)], rwidth=0.8)
    ax.set(title="Accept lengths per step (chosen tree, greedy)", xlabel="tokens accepted after the root",
           ylabel="steps")
    save(fig, "accept_lengths.png")

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
    rel = report["step_costs"]["relative"]
    ax.plot([int(n) for n in rel], list(rel.values()), "s:", label="step cost / plain step")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set(title=f"Speedup against tree size ({report['device']}, {report['threads']} threads)",
           xlabel="tree nodes (grown tree)", ylabel="x plain greedy", xscale="log", xticks=nodes, xticklabels=nodes)
    ax.legend()
    save(fig, "speedup_vs_tree_size.png")
    return files


@torch.no_grad()
def breakdown(model, prompt, choices, n_new=128):
    """Where a Medusa step's time goes: each phase timed inside real decoding (medians, in ms),
    next to one plain decoding step. Wraps the phases for the duration of one run."""
    import medusa_mini
    times, originals = {}, {}

    def wrap(owner, name, label):
        originals[(owner, name)] = fn = getattr(owner, name)

        def timed_fn(*a, **k):
            t0 = time.perf_counter()
            result = fn(*a, **k)
            times.setdefault(label, []).append(time.perf_counter() - t0)
            return result
        setattr(owner, name, timed_fn)

    plain = min(timed(lambda: generate(model, prompt, n_new), prompt.device)[0] for _ in range(3)) / n_new
    medusa_generate(model, prompt, n_new, choices)  # warm-up
    for name in ("generate_candidates", "tree_decoding", "evaluate_posterior", "update_inputs"):
        wrap(medusa_mini, name, f"{name}")
    wrap(model, "head_logits", "  of which the heads")
    try:
        seconds, (_, stats) = timed(lambda: medusa_generate(model, prompt, n_new, choices), prompt.device)
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn) if owner is medusa_mini else delattr(owner, name)
    print(f"plain step {plain * 1e3:.2f} ms; Medusa step {seconds / stats.steps * 1e3:.2f} ms "
          f"({seconds / stats.steps / plain:.2f}x) with a {len(choices)}-node tree, {stats.tokens_per_step:.2f} tokens/step")
    for label in ("generate_candidates", "tree_decoding", "evaluate_posterior", "update_inputs", "  of which the heads"):
        values = times[label]
        print(f"  {label:24s} {statistics.median(values) * 1e3:6.3f} ms ({statistics.median(values) / plain:.2f}x a plain step)")


def main(argv=None):
    p = argparse.ArgumentParser(description="Re-run the report on a trained checkpoint (out/heads.pt).")
    p.add_argument("--out", default="out", help="folder holding heads.pt and the tokenizer; the report goes here")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")
    p.add_argument("--device", help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--prompts", type=int, help="held-out prompts (default: the preset's)")
    p.add_argument("--tokens", type=int, help="new tokens per prompt (default: the preset's)")
    p.add_argument("--breakdown", action="store_true", help="only time the phases of a Medusa step (chosen tree)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = common.pick_device(a.device)
    model, ckpt = common.load_medusa(os.path.join(a.out, "heads.pt"), device)
    if "tree" not in ckpt:
        raise ValueError(f"{a.out}/heads.pt has no tree yet: run train_heads.py to the end first")
    settings = ckpt["settings"]
    args = common.run_args(settings["preset"], a.out, **{k: v for k, v in settings.items() if k != "preset"})
    args.report_prompts = a.prompts or args.report_prompts
    args.report_tokens = a.tokens or args.report_tokens
    enc, _, _, val_ids = common.prepare_data(args)
    if a.breakdown:
        prompt = random_prompts(val_ids, 1, 32, args.seed + 5, device)
        return breakdown(model, prompt, [tuple(p) for p in ckpt["tree"]])
    order = [tuple(p) for p in ckpt["grown_order"]]
    report = run_report(model, enc, val_ids, [tuple(p) for p in ckpt["tree"]], order, ckpt["accuracies"],
                        ckpt["step_costs"], args)
    write_report(report, a.out)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a missing, corrupt or foreign checkpoint: one line, no traceback
        sys.exit(f"error: {e}")
