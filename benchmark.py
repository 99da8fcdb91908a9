"""Every trained drafter against plain KV-cached decoding of the same model, in the same process, interleaved.

    python benchmark.py --out out                  # re-run the report on the drafters in out/ (medusa.pt, eagle.pt)
    python benchmark.py --out out --breakdown      # where a step's time goes, ideal against actual
    python benchmark.py --out out --ops            # kernel-launching ops per step: the GPU proxy
    python benchmark.py --out out --ceiling        # exact sampling: our heads against the best any heads could do
    python benchmark.py --out out --nodes 4,10,16  # greedy, every drafter on its own grown tree of each size

Every figure is a median over interleaved repeats: on a small shared machine, timings drift, and
running the sides one after the other would hand the drift to one of them. Each side runs at every
CPU thread count from 1 to the number of cores, and a speedup compares each side at its own best
count. Writes out/report.json, out/report.md and PNGs, and prints the table.
"""
import argparse
import json
import os
import sys

import torch

import common
import grading
import measure
from common import random_prompts


def node_counts(text):
    """--nodes 4,10,16 -> [4, 10, 16]."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give tree sizes as numbers, e.g. 4,10,16") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every tree size must be at least 1")
    return sizes


def main(argv=None):
    p = common.ArgumentParser(description="Re-run the report on the trained drafters in a folder.")
    p.add_argument("--out", default="out", help="folder holding medusa.pt (and eagle.pt) and the tokenizer; "
                                                "the report goes here")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: every count from 1 to the cores)")
    p.add_argument("--device", help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--prompts", type=int, help="held-out prompts (default: the preset's)")
    p.add_argument("--tokens", type=int, help="new tokens per prompt (default: the preset's)")
    p.add_argument("--breakdown", action="store_true",
                   help="only time the phases of a Medusa step (chosen tree), actual against ideal")
    p.add_argument("--ops", action="store_true", help="only count kernel-launching ops and host reads per step")
    p.add_argument("--ceiling", action="store_true",
                   help="only measure exact sampling at T=0.7: our heads, the best any heads could do, the best a "
                        "conditional drafter could do, and our EAGLE layer where there is one")
    p.add_argument("--nodes", type=node_counts, metavar="N,N,...",
                   help="only greedy decoding, every drafter on its own grown tree of each size, against plain "
                        "greedy: tokens/step at equal tree size; writes OUT/equal_trees.json")
    a = p.parse_args(argv)
    for flag in ("threads", "prompts", "tokens"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise ValueError(f"--{flag} {getattr(a, flag)}: must be at least 1")
    if a.breakdown + a.ops + a.ceiling + bool(a.nodes) > 1:
        raise ValueError("--breakdown, --ops, --ceiling and --nodes each measure one thing: give one of them")
    grading.require(None, "benchmark.py")  # in a student copy: every assignment written
    if a.threads:
        torch.set_num_threads(a.threads)
    device = common.pick_device(a.device)
    names = [d for d in common.GENERATE if os.path.exists(os.path.join(a.out, f"{d}.pt"))]
    if not names:
        raise ValueError(f"no drafter in {a.out}/ (medusa.pt, eagle.pt): run train_heads.py first")
    models = {d: common.load_model(os.path.join(a.out, f"{d}.pt"), device, drafter=d, base_kind="gpt") for d in names}
    for d, (_, ckpt) in models.items():
        if "tree" not in ckpt:
            raise ValueError(f"{a.out}/{d}.pt has no tree yet: run train_heads.py to the end first")
    first, ckpt = models[names[0]]
    settings = ckpt["settings"]
    args = common.run_args(settings["preset"], a.out, device, **{k: v for k, v in settings.items() if k != "preset"})
    args.report_prompts = a.prompts or args.report_prompts
    args.report_tokens = a.tokens or args.report_tokens
    enc, _, _, val_ids = common.prepare_data(args)
    if a.ceiling or a.breakdown or a.ops:  # Medusa's own measurements
        if "medusa" not in models:
            raise ValueError(f"--ceiling, --breakdown and --ops measure Medusa's heads: {a.out}/medusa.pt is missing")
        model, ckpt = models["medusa"]
        tree = [tuple(p) for p in ckpt["tree"]]
    if a.ceiling:  # T = 0.7, as the report's sampled modes
        torch.manual_seed(args.seed)
        prompts = random_prompts(val_ids, a.prompts or 10, 32, args.seed + 7, device)
        eagle = models.get("eagle", (None,))[0]  # scored too, where the run trained one
        return print(measure.format_ceiling(measure.exact_sampling_ceiling(model, prompts, 0.7, [4, 10, 16, 32, 64],
                                                                           eagle=eagle), 0.7))
    if a.breakdown or a.ops:
        prompt = random_prompts(val_ids, 1, 32, args.seed + 5, device)
        if a.ops:
            return print(measure.format_ops(measure.count_ops(model, prompt, tree, args.report_tokens)))
        return measure.breakdown(model, prompt, tree, args.report_tokens)
    prompts = random_prompts(val_ids, args.report_prompts, measure.REPORT_PROMPT, args.seed + 5, device)
    if a.nodes:
        table = measure.equal_trees(models, prompts, args.report_tokens, a.nodes, measure.thread_counts(device, a.threads))
        with open(os.path.join(a.out, "equal_trees.json"), "w") as f:
            json.dump(measure.stamped(table), f, indent=1)
        return table
    report = measure.run_report([measure.drafted(d, m, c) for d, (m, c) in models.items()], prompts,
                                args.report_tokens, measure.thread_counts(device, a.threads))
    report.update(preset=args.preset, device=str(device),
                  sample=enc.decode(prompts[0].tolist()) + "[...]" + enc.decode(report["sample"]))
    measure.write_report(report, a.out)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a bad flag, a missing, corrupt or foreign checkpoint: one line, no traceback
        sys.exit(f"error: {e}")
