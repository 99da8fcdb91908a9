"""The report's pictures: training curves, draft accuracy by depth, accept lengths, the drafters side by side,
and the tree-size sweep (lab/report_files.write_report calls it)."""
import io
import os

from lab import folder


def plot_report(report, out):
    """The report's pictures, each written atomically; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []

    def save(fig, name):
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        folder.write_atomically(os.path.join(out, name), lambda f: f.write(buffer.getvalue()))
        files.append(name)

    training = report.get("training", {})
    curves = {label: training.get(part, {}).get("history") for label, part in
              (("base model (LM loss)", "base"), ("first drafter (its loss)", report["drafter"]))}
    if any(curves.values()):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, h in curves.items():
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

    sweep = report.get("tree_size_sweep")
    if sweep:
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

