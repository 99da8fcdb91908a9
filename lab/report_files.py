"""The report written down: report.json (stamped with its date and command), report.md with its tables, and
the printed tables (lab/report.py measures it; lab/plots.py draws its pictures).
"""
import os
import sys
import time

from lab import folder, llama_cpp, ops
from lab.plots import plot_report
from lab.report import REFERENCE


def format_precision(precision):
    """The agreement table: each greedy mode in the decoding dtype against the float32 model's greedy text."""
    dtype = precision["dtype"]
    lines = [f"| greedy, {dtype} | tokens agreeing with float32 greedy: mean (per prompt) | identical to the end "
             "| float32 top-2 margin where it leaves | against plain's agreement | tokens/s against the fastest "
             "plain |", "|---|---|---|---|---|---|"]
    for name, r in precision["modes"].items():
        margins = ", ".join(f"{m:.2f}" for m in r["margin_at_divergence"] if m is not None) or "-"
        lines.append(f"| {name} | {r['mean_agreed']:.1f} ({' '.join(map(str, r['agreed']))}) | {r['identical']}/"
                     f"{precision['prompts']} | {margins} | {r['agreed_vs_plain']:.2f} | {r['vs_fastest_plain']:.2f}x |")
    return "\n".join(lines) + (f"\n\nThe fastest plain decoding here: {precision['fastest_plain']} "
                               f"({precision['fastest_plain_tokens_per_s']:.0f} tokens/s); `{REFERENCE}` is the "
                               f"float32 model, timed in the same rounds.")


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
        "plain decoding at its best; step cost = a step's time over a plain step's, drafting included; = plain " \
        "greedy: the prompts whose text is plain greedy's, for the least of its greedy trees (every prompt, in float32)."


def stamped(results):
    """Results with the date and time (UTC) and the command that measured them, as a JSON file keeps them."""
    return {**results, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", os.path.basename(sys.argv[0]), *sys.argv[1:]])}


def write_json(path, results):
    """results, stamped, to a JSON file (atomically)."""
    folder.write_json(path, stamped(results), indent=1, default=str)


def write_report(report, out):
    """report.json (stamped), report.md and the PNGs, each written atomically; prints the tables."""
    write_json(os.path.join(out, "report.json"), report)
    pngs = plot_report(report, out)
    table = format_table(report)
    repeats = report["repeats"]
    md = [f"# medusa-mini report ({report['preset']} preset, {report['device']})", "",
          f"{report['prompts']} held-out prompts x {report['new_tokens']} new tokens; each time is the median of "
          f"{repeats} interleaved runs{' (of two, their mean)' * (repeats == 2)}; the plain "
          "modes and each drafter's chosen tree run at every thread count, the other modes at the count fastest "
          "for them on the first prompt.", "", format_drafters(report), "", table, ""]
    if "precision" in report:
        md += [f"## {report['precision']['dtype']} against float32", "", format_precision(report["precision"]), ""]
    if report.get("engine"):
        md += ["## Another engine", "", llama_cpp.format_side_by_side(report["engine"]), ""]
    if "ops" in report:
        md += [ops.format_ops(report["ops"]), ""]
    if "tree_size_sweep" in report:
        md += ["## Tree size sweep (grown trees, greedy)", "",
               "| nodes | expected tokens/step | measured tokens/step | speedup |", "|---|---|---|---|"]
        md += [f"| {r['nodes']} | {r['expected_tokens_per_step']:.2f} | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x |"
               for r in report["tree_size_sweep"]]
    base = report.get("training", {}).get("base", {})
    if "val_loss_halves" in base:  # every position trained: later positions, with more context, are no worse
        md += ["", f"Base model held-out loss {base['val_loss']:.3f}; over the first and second half of the context's "
               f"positions: {base['val_loss_halves'][0]:.3f} and {base['val_loss_halves'][1]:.3f}."]
    for name, training in report.get("training", {}).items():
        if isinstance(training, dict) and "base_loss" in training:  # a drafter's stage trained the base (Medusa-2)
            loss = training["base_loss"]
            md += ["", f"## {name}: the base trained too", "", f"Base model held-out loss: {loss['before']:.3f} before, "
                   f"{loss['after']:.3f} after (tokens/step above are with the base as {name} left it)."]
    md += ["", "## Sample (chosen tree, greedy)", "", f"Distinct 4-grams in plain greedy text: "
           f"{report['greedy_distinct_4']:.2f} (1.00: no 4-gram repeats).", "", "```", str(report["sample"]), "```", ""]
    md += [f"![{p}]({p})" for p in pngs]
    folder.write_text(os.path.join(out, "report.md"), "\n".join(md) + "\n")
    print("\n" + table)
    print("\n" + format_drafters(report))
    if "precision" in report:
        print("\n" + format_precision(report["precision"]))
    if report.get("engine"):
        print("\n" + llama_cpp.format_side_by_side(report["engine"]))
    if "ops" in report:
        print("\n" + ops.format_ops(report["ops"]))
    print(f"\nchosen tree: {len(report['chosen_tree'])} nodes; report written to {out}/report.md and report.json")


