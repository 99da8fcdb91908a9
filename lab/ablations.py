"""Ablations on a finished run (ablation.py): each trains one variant beside the run's own drafter, on the
same base and text, and compares the two interleaved.

- shared_lm_head: Medusa heads that project through the frozen lm_head against the paper's own copy each.
- mtp_base: a base trained with MTP modules against the plain one, at equal training time.
- eagle_loss: EAGLE's layer trained on the token loss alone (EAGLE-3's) against EAGLE-1's loss.
- eagle_budget: SmolLM2's EAGLE layer on half its text, and on all of it for half its steps.
"""
import dataclasses
import os
import shutil
import time

import torch

from lab import bases, checkpoints, drafters, gpt_stages, pipeline, report, report_files, runs, smollm_stages, timing
from lab import tree_choice
from lab.cli import RunError
from lab.dtypes import DTYPES, chosen_dtype, decoding_copy
from lab.timing import Mode
from lab.train_drafters import TrainingData
from lab.tree_choice import trees_of
from medusa_mini import generate
from tree import expected_tokens_per_step, grow_tree


def copy_data(src, dst, prefixes):
    """Files of a finished run (tokenizer, token ids, ...) copied into another run's folder, to be reused."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.startswith(prefixes) and not os.path.exists(os.path.join(dst, name)):
            shutil.copy2(os.path.join(src, name), dst)


def of_stages(path, ckpt, stages, what):
    """One line unless the checkpoint belongs to a base whose pipeline runs `stages` (the ablation needs them)."""
    kind = bases.of_checkpoint(ckpt, path)
    if kind.stages is not stages:
        raise RunError(f"{path} holds a drafter for {kind.label}: {what}")


def finished(out, name, device, dtype="auto"):
    """(model, checkpoint, its chosen trees, the decoding dtype's name) of a finished drafter of a tiny-GPT run, to
    decode in `dtype` (auto: the base's choice, printed)."""
    path = os.path.join(out, f"{name}.pt")
    model, ckpt = runs.load_model(path, device, drafter=name)
    of_stages(path, ckpt, gpt_stages, "this ablation trains the tiny GPT's drafters again; point --out at its run")
    dtype = dtype if dtype != "auto" else chosen_dtype(dtype, device, bases.of_checkpoint(ckpt, path))
    try:
        return decoding_copy(model, DTYPES[dtype]), ckpt, trees_of(ckpt, dtype, path), dtype
    except KeyError:
        raise RunError(f"{path} has no tree yet: run `train_heads.py --drafters {name}` to the end first") from None


def compare_two(run, models, threads, device, val_ids):
    """{label: (kind, model, tree)} decoded greedily beside plain greedy, interleaved: summarise's rows."""
    prompts = gpt_stages.random_prompts(val_ids, run.report_prompts, report.REPORT_PROMPT, run.seed + 5, device)
    modes = {"plain greedy": Mode(generate)}
    for label, (kind, model, tree) in models.items():
        modes[label] = Mode(kind.generate, model=model, tree=tree, drafter=kind.name)
    print(f"ablation: {len(modes)} modes x {len(threads)} thread counts x {len(prompts)} held-out prompts x "
          f"{run.report_tokens} tokens, interleaved")
    first = next(iter(models.values()))[1]
    runs = timing.compare(first, prompts, run.report_tokens, modes, repeats=3, threads=threads)
    return {label: {**timing.summarise(runs, label, "plain greedy", threads),
                    "greedy_identical": timing.identical_share(runs, label, "plain greedy", threads)} for label in models}


def shared_lm_head(out, device, threads=None, dtype="auto", resume=False):
    """The run's Medusa heads (the paper's: a copy of lm_head each) against heads sharing the frozen lm_head,
    trained the same way in OUT/shared/ (reusing the run's base, tokenizer, token ids and text)."""
    paper, ckpt, paper_trees, dtype = finished(out, "medusa", device, dtype)
    if ckpt.stage is not None and ckpt.stage.settings.get("share_lm_head"):
        raise RunError(f"{out}/medusa.pt already shares the lm_head: point --out at a run with the paper's heads")
    shared_out = os.path.join(out, "shared")
    copy_data(out, shared_out, ("base.pt", "bpe", "train_ids", "val_ids", "distill.pt"))
    _, run = runs.reopen(os.path.join(out, "medusa.pt"), device, share_lm_head=True, threads=threads,
                         drafters=("medusa",), dtype=dtype, resume=resume)
    run.out = shared_out
    pipeline.run(run)
    shared, _, shared_trees, _ = finished(shared_out, "medusa", device, dtype)
    enc = runs.load_tokenizer(os.path.join(out, "medusa.pt"), ckpt)
    kind = drafters.get("medusa")
    rows = compare_two(run, {"paper": (kind, paper, paper_trees.tree), "shared": (kind, shared, shared_trees.tree)},
                       timing.thread_counts(device, threads), device, gpt_stages.held_out_ids(run, enc))
    print("\n| heads | parameters (all heads) | head top-1 on greedy text | tree | tokens/step | tokens/s (best) "
          "| speedup (best vs best) | = plain greedy |\n|---|---|---|---|---|---|---|---|")
    for label, model, chosen, name in (("own copy of lm_head (paper)", paper, paper_trees, "paper"),
                                       ("shared frozen lm_head", shared, shared_trees, "shared")):
        r = rows[name]
        r.update(head_parameters=report.parameters(model), tree_nodes=len(chosen.tree),
                 head_top1_greedy=[acc[0] for acc in chosen.accuracies])
        base = sum(p.numel() for p in model.base.parameters())
        print(f"| {label} | {r['head_parameters'] / 1e6:.2f}M ({r['head_parameters'] / base:.0%} of the base) | "
              f"{' '.join(f'{x:.2f}' for x in r['head_top1_greedy'])} | {r['tree_nodes']} nodes | "
              f"{r['tokens_per_step']:.2f} | {r['tokens_per_s']:.0f} ({r['threads']} thr) | {r['speedup']:.2f}x | "
              f"{r['greedy_identical']:.0%} |")
    report_files.write_json(os.path.join(out, "ablation.json"), rows)
    return rows


def mtp_base(out, depth, device, threads=None, resume=False):
    """The plain base of a finished run against one trained with `depth` MTP modules for the same time:
    the main head's held-out loss, the time per step, how repetitive greedy text is."""
    path = os.path.join(out, "base.pt")
    plain_ckpt = checkpoints.load(path, device)
    of_stages(path, plain_ckpt, gpt_stages, "this ablation trains a tiny GPT; point --out at its run")
    if not plain_ckpt.done:
        raise RunError(f"{path} is unfinished: run train_heads.py to the end first")
    _, run = runs.reopen(path, device, out=os.path.join(out, f"mtp{depth}-equal-time"), mtp_modules=depth,
                         threads=threads, drafters=("medusa",), resume=resume)
    copy_data(out, run.out, ("bpe", "train_ids", "val_ids"))
    enc, tokenizer, parents, train_ids, val_ids = gpt_stages.prepare_data(run)
    base_kind = bases.of_checkpoint(plain_ckpt, path)
    plain = base_kind.build(plain_ckpt.base, device)
    plain.load_state_dict(plain_ckpt.model)
    seconds = plain_ckpt.metrics["seconds"]
    ratio = gpt_stages.mtp_step_ratio(run, plain.config, device)  # a step with the modules / one without
    run.base_steps = max(1, round(run.base_steps / ratio))
    print(f"ablation: a step with {depth} MTP module{'s' * (depth > 1)} takes {ratio:.2f}x one without: "
          f"{run.base_steps} steps for the {seconds:.0f}s the plain base trained")
    common = {"tokenizer": tokenizer, "run": gpt_stages.run_record(run)}
    mtp, metrics, _ = gpt_stages.stage_base(run, plain.config, common, parents, train_ids, val_ids, base_kind.name)
    prompts = gpt_stages.random_prompts(val_ids, run.report_prompts, 32, run.seed + 5, device)
    rows = {"plain": {"steps": plain_ckpt.step, "seconds": seconds,
                      **gpt_stages.base_quality(plain, val_ids, run, device, prompts)},
            f"mtp {depth}": {"steps": run.base_steps, "seconds": metrics["seconds"],
                             **gpt_stages.base_quality(mtp, val_ids, run, device, prompts)}}
    print("\n| base | steps | training time | s per step | held-out loss (main head) | distinct 4-grams, greedy |"
          "\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['steps']} | {r['seconds']:.0f} s | {r['seconds'] / r['steps']:.3f} | {r['val_loss']:.3f} "
              f"| {r['distinct_4gram']:.2f} |")
    report_files.write_json(os.path.join(out, f"ablation_mtp{depth}.json"), rows)
    return rows


def eagle_loss(out, loss, device, threads=None, dtype="auto", resume=False):
    """The run's EAGLE layer (EAGLE-1's loss) against one trained the same way on another loss (eagle.LOSSES),
    in OUT/eagle-LOSS/: top-1 by depth on greedy held-out text, and greedy decoding on grown and dynamic trees."""
    ref, ckpt, ref_trees, dtype = finished(out, "eagle", device, dtype)
    other_out = os.path.join(out, f"eagle-{loss}")
    copy_data(out, other_out, ("base.pt", "bpe", "train_ids", "val_ids", "distill.pt"))
    _, run = runs.reopen(os.path.join(out, "eagle.pt"), device, eagle_loss=loss, threads=threads,
                         drafters=("eagle",), dtype=dtype, resume=resume)
    run.out = other_out
    pipeline.run(run)
    other, _, _, _ = finished(other_out, "eagle", device, dtype)
    kind = drafters.get("eagle")
    enc = runs.load_tokenizer(os.path.join(out, "eagle.pt"), ckpt)
    val_ids = gpt_stages.held_out_ids(run, enc)
    prompts = gpt_stages.random_prompts(val_ids, run.eval_prompts, gpt_stages.EVAL_PROMPT, run.seed + 4, device)
    seq = generate(ref.base, prompts, gpt_stages.EVAL_NEW)
    nodes, rows, models = len(ref_trees.tree), {}, {}
    for name, model in (("eagle1", ref), (loss, other)):
        acc = tree_choice.accuracies(kind, model, [(seq, gpt_stages.EVAL_PROMPT - 1, None)], run.eagle_depth,
                                     run.rank_depth)
        tree = grow_tree(acc, nodes)
        rows[name] = {"top1_by_depth": [x[0] for x in acc], "expected_tokens_per_step": expected_tokens_per_step(tree, acc)}
        models[f"{name}, grown tree"] = (kind, model, tree)
        models[f"{name}, dynamic tree"] = (kind, model, drafters.dynamic_tree(model, tree, tree, run)["dynamic tree"])
    table = compare_two(run, models, timing.thread_counts(device, threads), device, val_ids)
    print(f"\n| loss | top-1 by depth (teacher-forced) | tree ({nodes} nodes) | tokens/step | tokens/s "
          "(best) | speedup (best vs best) | = plain greedy |\n|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        for tree in ("grown tree", "dynamic tree"):
            row = r[tree] = table[f"{name}, {tree}"]
            print(f"| {name} | {' '.join(f'{x:.2f}' for x in r['top1_by_depth'])} | {tree} | "
                  f"{row['tokens_per_step']:.2f} | {row['tokens_per_s']:.0f} ({row['threads']} thr) | "
                  f"{row['speedup']:.2f}x | {row['greedy_identical']:.0%} |")
    report_files.write_json(os.path.join(out, "ablation_eagle_loss.json"), rows)
    return rows


def eagle_budget(out, device, threads=None, sizes=(8, 16)):
    """SmolLM2's EAGLE layer (OUT/eagle.pt) against two trained on half its budget: half the text, half the steps."""
    path = os.path.join(out, "eagle.pt")
    kind = drafters.get("eagle")
    model, ckpt = runs.load_model(path, device, drafter=kind.name)
    of_stages(path, ckpt, smollm_stages, "--eagle-budget weighs SmolLM2's EAGLE budget; point --out at out/smollm2")
    distilled = checkpoints.load(os.path.join(out, "distill.pt"))
    (h, y, _), held = distilled.train, distilled.held_out
    if threads:
        torch.set_num_threads(threads)
    vocab = y[y >= 0].unique()  # as the run's: the drafting vocabulary of all the answers
    _, run = runs.reopen(path, device)
    depth = run.eagle_depth
    rows = {f"{len(h)} answers, {run.eagle_steps} steps (the run's)":
            (ckpt.metrics["seconds"], tree_choice.accuracies(kind, model, smollm_stages.texts(*held), depth, 10,
                                                             vocab.to(device)))}
    for label, n, steps in ((f"{len(h) // 2} answers, {run.eagle_steps} steps", len(h) // 2, run.eagle_steps),
                            (f"{len(h)} answers, {run.eagle_steps // 2} steps", len(h), run.eagle_steps // 2)):
        other = kind.model(model.base, **kind.config(run, model.base)).eval()
        t0 = time.time()
        with torch.enable_grad():
            data = TrainingData(smollm_stages.stored_batches(h[:n], y[:n], device), vocab=vocab.to(device))
            for stage in kind.stages(run):
                stage.train(other, data, dataclasses.replace(run, eagle_steps=steps), lambda *a, **k: None, None)
        rows[label] = (time.time() - t0, tree_choice.accuracies(kind, other, smollm_stages.texts(*held), depth, 10,
                                                                vocab.to(device)))
    print("\n| EAGLE trained on | training | held-out top-1 by depth | " +
          " | ".join(f"expected tokens/step, {s} nodes" for s in sizes) + " |\n|---|---|---|" + "---|" * len(sizes))
    table = {}
    for label, (seconds, acc) in rows.items():
        expected = {s: expected_tokens_per_step(grow_tree(acc, s), acc) for s in sizes}
        table[label] = {"seconds": seconds, "top1_by_depth": [x[0] for x in acc], "expected_tokens_per_step": expected}
        print(f"| {label} | {seconds:.0f} s | {' '.join(f'{x[0]:.2f}' for x in acc)} | "
              + " | ".join(f"{expected[s]:.2f}" for s in sizes) + " |")
    report_files.write_json(os.path.join(out, "ablation_eagle_budget.json"), table)
    return table
