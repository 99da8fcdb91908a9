"""Every trained drafter against plain KV-cached decoding of the same model, in the same process, interleaved.

    python benchmark.py --out out                  # re-run the report on the drafters in out/ (medusa.pt, eagle.pt)
    python benchmark.py --out out --breakdown      # where a step's time goes, ideal against actual
    python benchmark.py --out out --ops            # kernel-launching ops per step: the GPU proxy
    python benchmark.py --out out --ceiling        # exact sampling: our drafters against the best any heads could do
    python benchmark.py --out out --nodes 4,10,16  # greedy, every drafter on its own grown tree of each size

Every figure is a median over interleaved repeats: on a small shared machine, timings drift, and
running the sides one after the other would hand the drift to one of them. Each side runs at every
CPU thread count from 1 to the number of cores, and a speedup compares each side at its own best
count. Writes out/report.json, out/report.md and PNGs (or what the one measurement asked for), and
prints the table.
"""
import argparse
import os
import sys

import torch

from lab import checkpoints, cli, drafters, folder, gpt_pipeline, probes, report, timing
from lab.cli import RunError, UsageError
from lab.devices import DTYPES, add_dtype_flag, chosen_dtype, decoding_copy, draft_cheaply, pick_device
from lab.trees import tree_label, trees_of


def node_counts(text):
    """--nodes 4,10,16 -> [4, 10, 16]."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give tree sizes as numbers, e.g. 4,10,16") from None
    if not sizes or min(sizes) < 1 or max(sizes) > 64:
        raise argparse.ArgumentTypeError(f"{text!r}: every tree size must be from 1 to 64")
    return sizes


def parse_args(argv=None):
    p = cli.ArgumentParser(description="Re-run the report on the trained drafters in a folder.")
    p.add_argument("--out", type=cli.text, default="out", help="folder holding the drafters' checkpoints (medusa.pt, "
                                                               "eagle.pt, ...) and the tokenizer; the results go here")
    p.add_argument("--threads", type=cli.threads, help="torch CPU threads (default: every count from 1 to the cores)")
    p.add_argument("--device", type=cli.text, help="cuda, mps or cpu; default: the first available in that order")
    add_dtype_flag(p)
    p.add_argument("--prompts", type=cli.integer(1, 1000), help="held-out prompts (default: the run's)")
    p.add_argument("--tokens", type=cli.integer(1, 8192), help="new tokens per prompt (default: the run's)")
    p.add_argument("--drafter", choices=drafters.names(),
                   help="with --breakdown or --ops: this drafter only (default: each one in the folder)")
    p.add_argument("--breakdown", action="store_true",
                   help="only time the parts of a drafted step (chosen tree), actual against ideal")
    p.add_argument("--ops", action="store_true", help="only count kernel-launching ops and host reads per step")
    p.add_argument("--ceiling", action="store_true",
                   help="only measure exact sampling at T=0.7: our drafters, the best any Medusa heads could do and "
                        "the best a conditional drafter could do")
    p.add_argument("--nodes", type=node_counts, metavar="N,N,...",
                   help="only greedy decoding, every drafter on its own grown tree of each size, against plain "
                        "greedy: tokens/step at equal tree size; writes OUT/equal_trees.json")
    a = p.parse_args(argv)
    if a.breakdown + a.ops + a.ceiling + bool(a.nodes) > 1:
        raise UsageError("--breakdown, --ops, --ceiling and --nodes each measure one thing: give one of them")
    if (a.breakdown or a.ops) and a.prompts is not None:
        raise UsageError("--prompts: --breakdown and --ops measure one held-out prompt")
    if a.drafter and not (a.breakdown or a.ops):
        raise UsageError("--drafter picks the drafter --breakdown or --ops measures; the report measures them all")
    a.device = pick_device(a.device)
    return a


def main(argv=None):
    a = parse_args(argv)
    present = [n for n in drafters.names() if os.path.exists(os.path.join(a.out, f"{n}.pt"))]
    if a.drafter:
        present = [a.drafter] if a.drafter in present else []
    if not present:
        raise RunError(f"no drafter in {a.out}/ ({', '.join(f'{n}.pt' for n in drafters.names())}): "
                       f"run train_heads.py first")
    folder.check_writable(a.out)  # before minutes of measuring
    if a.threads:
        torch.set_num_threads(a.threads)
    drafted, reference = [], None
    dtype = chosen_dtype(a.dtype, a.device, "gpt")
    for name in present:
        path = os.path.join(a.out, f"{name}.pt")
        model, ckpt = checkpoints.load_model(path, a.device, drafter=name, base_kind="gpt")
        try:
            chosen = trees_of(ckpt, dtype)
        except KeyError:
            raise RunError(f"{path} has no tree yet: run train_heads.py to the end first") from None
        reference = reference or (None if dtype == "float32" else model.base)  # the float32 model, beside
        drafted.append(report.Drafted(drafters.get(name), draft_cheaply(decoding_copy(model, DTYPES[dtype]), a.device, "gpt"),
                                      chosen, {"seconds": ckpt.get("metrics", {}).get("seconds"),
                                               "parameters": report.parameters(model)}))
    path = os.path.join(a.out, f"{present[0]}.pt")
    ckpt, run = gpt_pipeline.reopen(path, a.device)
    run.report_prompts = a.prompts or run.report_prompts
    run.report_tokens = a.tokens or run.report_tokens
    enc = checkpoints.load_tokenizer(path, ckpt)
    val_ids = gpt_pipeline.held_out_ids(run, enc)
    with folder.locked(a.out):
        return measure(a, run, drafted, enc, val_ids, reference)


def measure(a, run, drafted, enc, val_ids, reference=None):
    device = a.device
    if a.ceiling:  # T = 0.7, as the report's sampled modes
        torch.manual_seed(run.seed)
        prompts = gpt_pipeline.random_prompts(val_ids, a.prompts or 10, 32, run.seed + 7, device)
        depth = min(d.kind.depth(d.model, run) for d in drafted)
        ceiling = probes.exact_sampling_ceiling(drafted[0].model.base, {d.name: (d.kind, d.model) for d in drafted},
                                                prompts, 0.7, [4, 10, 16, 32, 64], depth,
                                                new_tokens=a.tokens or 96)
        report.write_json(os.path.join(a.out, "ceiling.json"), ceiling)
        print(probes.format_ceiling(ceiling, 0.7))
        return ceiling
    if a.breakdown or a.ops:
        prompt = gpt_pipeline.random_prompts(val_ids, 1, 32, run.seed + 5, device)
        results = {}
        for d in drafted:
            print(f"\n{d.name}, chosen tree ({tree_label(d.trees.tree)}):")
            if a.ops:
                results[d.name] = probes.count_ops(d.kind, d.model, prompt, d.trees.tree, run.report_tokens)
                print(probes.format_ops(results[d.name]))
            else:
                results[d.name] = probes.breakdown(d.kind, d.model, prompt, d.trees.tree, run.report_tokens)
        report.write_json(os.path.join(a.out, "ops.json" if a.ops else "breakdown.json"), results)
        return results
    prompts = gpt_pipeline.random_prompts(val_ids, run.report_prompts, report.REPORT_PROMPT, run.seed + 5, device)
    threads = timing.thread_counts(device, a.threads)
    if a.nodes:
        table = report.equal_trees(drafted, prompts, run.report_tokens, a.nodes, threads)
        report.write_json(os.path.join(a.out, "equal_trees.json"), table)
        return table
    result = report.run_report(drafted, prompts, run.report_tokens, threads, reference=reference)
    result.update(preset=run.preset, device=str(device),
                  sample=enc.decode(prompts[0].tolist()) + "[...]" + enc.decode(result["sample"]))
    report.write_report(result, a.out)
    return result


if __name__ == "__main__":
    sys.exit(cli.finish(main))
