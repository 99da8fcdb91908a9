"""Ablations on a finished run: heads that share lm_head; a base trained with multi-token prediction; EAGLE's
loss; SmolLM2's EAGLE budget.

    python ablation.py --out out            # after `python train_heads.py`; trains out/shared/, prints the table
    python ablation.py --out out --mtp 1    # a base with 1 MTP module, trained as long as out/base.pt was
    python ablation.py --out out --eagle-loss tokens   # EAGLE's layer trained on the token loss alone
    python ablation.py --out out/smollm2 --eagle-budget   # SmolLM2's EAGLE: more text, or more steps?

EAGLE's loss (--eagle-loss tokens): EAGLE-1 regresses the next feature (SmoothL1) and adds 0.1 x the
token cross-entropy; EAGLE-3 drops the feature term. A second layer, trained as out/eagle.pt was but
with the token loss alone, on the same base and distilled text (out/eagle-tokens/), against the first:
top-1 by depth of teacher-forced chains on greedy held-out text, and tokens/step and speed, greedy, on
the report's prompts, each layer on its own grown tree of the chosen size and on EAGLE-2's dynamic
tree. Writes out/ablation_eagle_loss.json.

MTP (--mtp D): DeepSeek-V3's modules change pretraining, so they are judged by what they do to the
base model, at equal training time (a step with the modules costs more, so the MTP base takes fewer):
the main head's held-out loss, the time per step, and how repetitive greedy text is (distinct
4-grams). Gloeckle et al. (arXiv 2404.19737, section 3.1) found multi-token prediction hurts small
models. Trains out/mtpD-equal-time/; writes out/ablation_mtpD.json.

SmolLM2's EAGLE budget (--eagle-budget, after `train_heads.py --base smollm2 --drafters eagle`): the
layer trained on half the distilled answers for all the steps, and on all of them for half the steps,
against the run's own layer, on the held-out answers: top-1 by depth and the tokens/step expected of
grown trees. What doubling each would buy, read backwards: where the next minutes of budget pay.
Writes OUT/ablation_eagle_budget.json.

Shared lm_head (the default):
The paper gives each head its own copy of the vocabulary projection (W2 = a copy of lm_head, then
trained). The ablation projects through the base model's own frozen lm_head instead, so that a head is only
its residual block (EAGLE's draft layer reads its tokens through the frozen lm_head this way; Hydra's
heads keep a projection each). With a small model and a 2048-token vocabulary, a copied projection is a
sixth of the base model's parameters per head; on SmolLM2 it would be 28M per head.

Both kinds of heads are trained the same way, on the same base model and the same self-distilled
text (train_heads.py with --share-lm-head, reusing out/'s base model and text), and choose their own
tree. Then both are decoded side by side, interleaved with plain decoding, every side at every
thread count. Writes out/ablation.json.
"""
import json
import os
import shutil
import sys
import time

import torch

import common
import grading
import measure
import training
from eagle import DynamicTree, EagleModel, chain_accuracies, eagle_generate
from medusa_mini import generate
from tree import expected_tokens_per_step, grow_tree


def head_parameters(model):
    return sum(p.numel() for head in model.heads for p in head.parameters())


def main(argv=None):
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out", help="the folder `python train_heads.py` wrote (paper heads)")
    p.add_argument("--threads", type=int, help="one CPU thread count (default: every count from 1 to the cores)")
    p.add_argument("--device", help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--mtp", type=int, metavar="D", help="instead: a base trained with D MTP modules, at equal time")
    p.add_argument("--eagle-loss", choices=["tokens"], help="instead: EAGLE's layer trained on this loss against "
                   "EAGLE-1's")
    p.add_argument("--eagle-budget", action="store_true", help="instead (SmolLM2): EAGLE on half the text, and on "
                   "all of it for half the steps")
    a = p.parse_args(argv)
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads {a.threads}: must be at least 1")
    if a.mtp is not None and a.mtp < 1:
        raise ValueError(f"--mtp {a.mtp}: must be at least 1")
    grading.require(None, "ablation.py")  # in a student copy: every assignment written
    device = common.pick_device(a.device)
    if sum(map(bool, (a.mtp, a.eagle_loss, a.eagle_budget))) > 1:
        raise ValueError("--mtp, --eagle-loss and --eagle-budget are three ablations: run them one at a time")
    if a.mtp:
        return mtp_base(a, device)
    if a.eagle_loss:
        return eagle_losses(a, device)
    if a.eagle_budget:
        return eagle_budget(a, device)
    paper, ckpt = common.load_model(os.path.join(a.out, "medusa.pt"), device, drafter="medusa")
    if "tree" not in ckpt:
        raise ValueError(f"{a.out}/medusa.pt has no tree yet: run train_heads.py to the end first")
    if ckpt["settings"].get("share_lm_head"):
        raise ValueError(f"{a.out}/medusa.pt already shares the lm_head: point --out at a run with the paper's heads")

    # The shared-head run reuses the paper run's base model, tokenizer, token ids and distilled text.
    shared_out = os.path.join(a.out, "shared")
    copy_data(a.out, shared_out, ("base.pt", "bpe", "train_ids", "val_ids", "distill.pt"))
    settings = ckpt["settings"]
    run = {k: v for k, v in settings.items() if k != "preset"}
    training.run(common.run_args(settings["preset"], shared_out, device, **{**run, "share_lm_head": True,
                                                                            "threads": a.threads}))
    shared, shared_ckpt = common.load_model(os.path.join(shared_out, "medusa.pt"), device, drafter="medusa")

    args = common.run_args(settings["preset"], a.out, device, **run)
    _, _, _, val_ids = common.prepare_data(args)
    prompts = common.random_prompts(val_ids, args.report_prompts, 32, args.seed + 5, device)
    threads = measure.thread_counts(device, a.threads)
    trees = {"paper": [tuple(q) for q in ckpt["tree"]], "shared": [tuple(q) for q in shared_ckpt["tree"]]}
    modes = {"plain greedy": ("plain", {}),
             "paper": ("medusa", dict(choices=trees["paper"])),
             "shared": ("medusa", dict(choices=trees["shared"], model=shared))}
    print(f"ablation: 3 modes x {len(threads)} thread counts x {len(prompts)} held-out prompts x "
          f"{args.report_tokens} tokens, interleaved")
    runs = measure.compare(paper, prompts, args.report_tokens, modes, repeats=3, threads=threads)
    rows = {}
    for name, model, c in (("paper", paper, ckpt), ("shared", shared, shared_ckpt)):
        row = measure.summarise(runs, name, "plain greedy", threads, args.report_tokens)
        same = [x == y for x, y in zip(runs[name, threads[0]]["outputs"], runs["plain greedy", threads[0]]["outputs"])]
        rows[name] = {"head_parameters": head_parameters(model), "base_parameters": sum(
                          q.numel() for q in model.base.parameters()),
                      "head_top1_greedy": [acc[0] for acc in c["accuracies"]], "tree_nodes": len(trees[name]),
                      "greedy_identical": sum(same) / len(same), **row}
    print("\n| heads | parameters (all heads) | head top-1 on greedy text | tree | tokens/step | tokens/s (best) "
          "| speedup (best vs best) | = plain greedy |\n|---|---|---|---|---|---|---|---|")
    for name, label in (("paper", "own copy of lm_head (paper)"), ("shared", "shared frozen lm_head")):
        r = rows[name]
        print(f"| {label} | {r['head_parameters'] / 1e6:.2f}M ({r['head_parameters'] / r['base_parameters']:.0%} of the "
              f"base) | {' '.join(f'{x:.2f}' for x in r['head_top1_greedy'])} | {r['tree_nodes']} nodes | "
              f"{r['tokens_per_step']:.2f} | {r['tokens_per_s']:.0f} ({r['threads']} thr) | {r['speedup']:.2f}x | "
              f"{r['greedy_identical']:.0%} |")
    with open(os.path.join(a.out, "ablation.json"), "w") as f:
        json.dump(measure.stamped(rows), f, indent=1, default=str)
    return rows


def mtp_base(a, device):
    """The plain base of a finished run against a base trained with a.mtp MTP modules for the same time."""
    _, ckpt = common.load_model(os.path.join(a.out, "medusa.pt"), device, drafter="medusa")
    settings = {k: v for k, v in ckpt["settings"].items() if k != "preset"}
    plain_ckpt = common.load_checkpoint(os.path.join(a.out, "base.pt"), device=device)
    seconds = plain_ckpt["metrics"]["seconds"]
    out = os.path.join(a.out, f"mtp{a.mtp}-equal-time")
    copy_data(a.out, out, ("bpe", "train_ids", "val_ids"))
    args = common.run_args(ckpt["settings"]["preset"], out, device, **settings, mtp=a.mtp, threads=a.threads)
    enc, tokenizer, train_ids, val_ids = common.prepare_data(args)
    plain = common.build_base(plain_ckpt["base"], device)
    plain.load_state_dict(plain_ckpt["model"])
    ratio = training.mtp_step_ratio(args, plain.config, device)  # a step with the modules / one without
    args.base_steps = max(1, round(args.base_steps / ratio))
    print(f"ablation: a step with {a.mtp} MTP module{'s' * (a.mtp > 1)} takes {ratio:.2f}x one without: "
          f"{args.base_steps} steps for the {seconds:.0f}s the plain base trained")
    mtp, metrics, _ = training.stage_base(args, plain.config, tokenizer, train_ids, val_ids, device)
    prompts = common.random_prompts(val_ids, args.report_prompts, 32, args.seed + 5, device)
    rows = {"plain": {"steps": plain_ckpt["step"], "seconds": seconds, **training.base_quality(
                plain, val_ids, args, device, prompts)},
            f"mtp {a.mtp}": {"steps": args.base_steps, "seconds": metrics["seconds"], **training.base_quality(
                mtp, val_ids, args, device, prompts)}}
    print("\n| base | steps | training time | s per step | held-out loss (main head) | distinct 4-grams, greedy |"
          "\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['steps']} | {r['seconds']:.0f} s | {r['seconds'] / r['steps']:.3f} | {r['val_loss']:.3f} "
              f"| {r['distinct_4gram']:.2f} |")
    with open(os.path.join(a.out, f"ablation_mtp{a.mtp}.json"), "w") as f:
        json.dump(measure.stamped(rows), f, indent=1)
    return rows


def eagle_losses(a, device):
    """out/eagle.pt's layer (EAGLE-1's loss) against one trained the same way on the token loss alone."""
    ref, ckpt = common.load_model(os.path.join(a.out, "eagle.pt"), device, drafter="eagle")
    if "tree" not in ckpt:
        raise ValueError(f"{a.out}/eagle.pt has no tree yet: run `train_heads.py --drafters medusa,eagle` to the end first")
    settings = {k: v for k, v in ckpt["settings"].items() if k != "preset"}
    out = os.path.join(a.out, f"eagle-{a.eagle_loss}")
    copy_data(a.out, out, ("base.pt", "bpe", "train_ids", "val_ids", "distill.pt"))
    args = common.run_args(ckpt["settings"]["preset"], out, device, **{**settings, "eagle_loss": a.eagle_loss,
                                                                        "threads": a.threads})
    _, tokenizer, train_ids, val_ids = common.prepare_data(args)
    other, metrics = training.stage_eagle(args, ref.base, ref.base.config, tokenizer, train_ids, val_ids, device)
    models = {"eagle1": (ref, ckpt["metrics"]), a.eagle_loss: (other.eval(), metrics)}

    eval_prompts = common.random_prompts(val_ids, args.eval_prompts, training.EVAL_PROMPT, args.seed + 4, device)
    seq = generate(ref.base, eval_prompts, training.EVAL_NEW)
    nodes = len(ckpt["tree"])
    modes, rows = {"plain greedy": (generate, {})}, {}
    for name, (model, m) in models.items():
        acc = chain_accuracies(model, seq, training.EVAL_PROMPT - 1, args.eagle_depth, args.rank_depth)
        tree = grow_tree(acc, nodes)
        rows[name] = {"seconds": m["seconds"], "top1_by_depth": [x[0] for x in acc],
                      "expected_tokens_per_step": expected_tokens_per_step(tree, acc)}
        modes[f"{name}, grown tree"] = (eagle_generate, dict(model=model, tree=tree))
        modes[f"{name}, dynamic tree"] = (eagle_generate, dict(model=model, tree=DynamicTree(
            topk=min(4, nodes), nodes=nodes, depth=min(args.eagle_depth, nodes))))
    prompts = common.random_prompts(val_ids, args.report_prompts, measure.REPORT_PROMPT, args.seed + 5, device)
    threads = measure.thread_counts(device, a.threads)
    print(f"ablation: {len(modes)} modes x {len(threads)} thread counts x {len(prompts)} held-out prompts x "
          f"{args.report_tokens} tokens, interleaved")
    runs = measure.compare(ref, prompts, args.report_tokens, modes, repeats=3, threads=threads)
    print(f"\n| loss | training | top-1 by depth (teacher-forced) | tree ({nodes} nodes) | tokens/step | tokens/s "
          "(best) | speedup (best vs best) | = plain greedy |\n|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        for tree in ("grown tree", "dynamic tree"):
            row = measure.summarise(runs, f"{name}, {tree}", "plain greedy", threads, args.report_tokens)
            same = [x == y for x, y in zip(runs[f"{name}, {tree}", threads[0]]["outputs"],
                                           runs["plain greedy", threads[0]]["outputs"])]
            r[tree] = {**row, "greedy_identical": sum(same) / len(same)}
            print(f"| {name} | {r['seconds']:.0f} s | {' '.join(f'{x:.2f}' for x in r['top1_by_depth'])} | {tree} | "
                  f"{row['tokens_per_step']:.2f} | {row['tokens_per_s']:.0f} ({row['threads']} thr) | "
                  f"{row['speedup']:.2f}x | {r[tree]['greedy_identical']:.0%} |")
    with open(os.path.join(a.out, "ablation_eagle_loss.json"), "w") as f:
        json.dump(measure.stamped(rows), f, indent=1, default=str)
    return rows


def eagle_budget(a, device, sizes=(8, 16)):
    """SmolLM2's EAGLE layer (OUT/eagle.pt) against two trained on half its budget: half the text, half the steps."""
    import smollm
    import smollm_heads
    path = os.path.join(a.out, "eagle.pt")
    if not os.path.exists(path) or common.read_checkpoint(path).get("base", {}).get("kind") != "smollm2":
        raise ValueError(f"{path}: no SmolLM2 EAGLE layer; run `train_heads.py --base smollm2 --drafters eagle "
                         f"--out {a.out}` first")
    ckpt = common.read_checkpoint(path)
    cache = common.read_checkpoint(os.path.join(a.out, "distill.pt"))
    (h, y, _), (val_h, val_y, val_start) = cache["train"], cache["held_out"]
    if a.threads:
        torch.set_num_threads(a.threads)
    base = smollm.load_smollm2(smollm_heads.BLOCK_SIZE).to(device).requires_grad_(False)
    vocab = y[y >= 0].unique()  # as the run's: the drafting vocabulary of all the answers
    steps, lr, seed = ckpt["settings"]["steps"], ckpt["settings"]["lr"], ckpt["settings"]["seed"]
    rows = {f"{len(h)} answers, {steps} steps (the run's)": (ckpt["seconds"], ckpt["accuracies"])}
    for label, n, k in ((f"{len(h) // 2} answers, {steps} steps", len(h) // 2, steps),
                        (f"{len(h)} answers, {steps // 2} steps", len(h), steps // 2)):
        model = EagleModel(base).eval()
        t0 = time.time()
        with torch.enable_grad():
            smollm_heads.train_eagle(model, h[:n], y[:n], vocab, steps=k, lr=lr, seed=seed)
        rows[label] = (time.time() - t0, smollm_heads.eagle_accuracies(model, val_h, val_y, val_start,
                                                                      smollm_heads.EAGLE_DEPTH, vocab=vocab))
    print("\n| EAGLE trained on | training | held-out top-1 by depth | " +
          " | ".join(f"expected tokens/step, {s} nodes" for s in sizes) + " |\n|---|---|---|" + "---|" * len(sizes))
    table = {}
    for label, (seconds, acc) in rows.items():
        expected = {s: expected_tokens_per_step(grow_tree(acc, s), acc) for s in sizes}
        table[label] = {"seconds": seconds, "top1_by_depth": [x[0] for x in acc], "expected_tokens_per_step": expected}
        print(f"| {label} | {seconds:.0f} s | {' '.join(f'{x[0]:.2f}' for x in acc)} | "
              + " | ".join(f"{expected[s]:.2f}" for s in sizes) + " |")
    with open(os.path.join(a.out, "ablation_eagle_budget.json"), "w") as f:
        json.dump(measure.stamped(table), f, indent=1)
    return table


def copy_data(src, dst, prefixes):
    """Files of a finished run (tokenizer, token ids, ...) copied into another run's folder, to be reused."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.startswith(prefixes) and not os.path.exists(os.path.join(dst, name)):
            shutil.copy2(os.path.join(src, name), dst)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")
