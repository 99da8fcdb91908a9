"""One stage of a run, for both pipelines: the checkpoint it writes, what it was asked for, and whether it is
reused, continued or trained.

A finished stage is reused only when a rerun asks for the same settings and its parents are the files it
was made from; otherwise the run refuses in one line, saying what differs. An interrupted stage continues
with --resume. Nothing trained is overwritten unless --retrain names the stage (or one it was made from).
Before a run writes anything, preflight() checks every stage it will reuse, so that a refused run has
changed nothing.
"""
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

from lab import checkpoints, drafters
from lab.checkpoints import Checkpoint, StageRecord
from lab.cli import RunError
from lab.config import defaults, flag_of
from lab.train_drafters import TrainingData


RESCUE = os.path.join(tempfile.gettempdir(), "medusa-mini-rescue")  # where weights go when their folder is full


def retrained(run) -> set:
    """The stages --retrain allows to train again: those named, and every stage trained on one of them."""
    named = set(run.retrain)
    if "base" in named:
        named |= {"distill", *run.drafters}
    if "distill" in named:
        named |= {n for n in run.drafters if drafters.get(n).distilled(run)}
    return named


def differences(run, held: StageRecord, asked: StageRecord) -> list[str]:
    """What a rerun asks for that a stage's checkpoint does not hold, one phrase each. A setting the checkpoint
    does not record (added to the code since it was trained) counts as its default."""
    known = defaults(run)
    held = StageRecord(held.name, {**{k: known[k] for k in asked.settings if k in known}, **held.settings},
                       held.parents)
    return checkpoints.differences(held, asked, flag_of)


def check(run, path, asked: StageRecord, device="cpu"):
    """Whether a stage can reuse or continue the checkpoint at `path`: the finished checkpoint (reuse it),
    an unfinished one when --resume (continue it), or None (train from the start: there is none, or
    --retrain allows training it again). Otherwise one line (RunError): the checkpoint holds another
    stage, or was trained with other settings or from other files, or is unfinished and --resume was
    not given."""
    if not os.path.exists(path) or asked.name in retrained(run):
        return None
    ckpt = checkpoints.load(path, device)
    held = ckpt.stage or StageRecord("unknown")
    if held.name != asked.name:
        raise RunError(f"{path} holds the {held.name!r} stage, not {asked.name!r} (a file moved or renamed?): "
                       f"put it back, or use another --out")
    differ = differences(run, held, asked)
    if differ:
        raise RunError(f"{path} was trained for other settings: this run asks for {'; '.join(differ)}. "
                       f"Use another --out, or --retrain {asked.name} to train it again (and what was trained on it)")
    if ckpt.done:
        return ckpt
    if not run.resume:
        raise RunError(f"{path} is an unfinished {asked.name} stage (interrupted at step {ckpt.step}): pass "
                       f"--resume to continue it, or --retrain {asked.name} to start it again")
    return ckpt


def preflight(run, planned: dict):
    """Before a run writes anything: every stage checkpoint already in run.out holds the stage it is named for
    and was trained for the settings this run asks ({file name: StageRecord}, parents aside: those are checked
    as each stage runs). A stage the run may train again is not checked. One line (RunError) at the first that
    does not fit, so that a refused run has changed nothing."""
    again = retrained(run)
    for name, asked in planned.items():
        path = os.path.join(run.out, name)
        if asked.name in again or not os.path.exists(path):
            continue
        held = checkpoints.load(path).stage or StageRecord("unknown")
        if held.name != asked.name:
            raise RunError(f"{path} holds the {held.name!r} stage, not {asked.name!r} (a file moved or renamed?): "
                           f"put it back, or use another --out")
        differ = differences(run, StageRecord(held.name, held.settings), StageRecord(asked.name, asked.settings))
        if differ:
            raise RunError(f"{path} was trained for other settings: this run asks for {'; '.join(differ)}. Use "
                           f"another --out, or --retrain {asked.name} to train it again (and what was trained on it)")


class Stage:
    """One stage's checkpoint in a run folder: what it was asked for, whether it can be reused or continued,
    and its saving. `common`: what every checkpoint of the stage holds besides (base, drafter, tokenizer, run)."""

    def __init__(self, run, file, name, settings, parents, common=None):
        self.path = os.path.join(run.out, file)
        self.asked = StageRecord(name, dict(settings), dict(parents))
        self.common = dict(common or {})
        self.ckpt = check(run, self.path, self.asked, run.device)

    @property
    def finished(self) -> Checkpoint | None:
        return self.ckpt if self.ckpt is not None and self.ckpt.done else None

    @property
    def resume_from(self) -> Checkpoint | None:
        return self.ckpt if self.ckpt is not None and not self.ckpt.done else None

    def save(self, done, **fields):
        """Write the stage's checkpoint: done (finished, or resumable) and the fields of this save. Where it cannot
        be written (a full disk, no permission), the weights are kept where they can be (RESCUE), and the one
        line says where, and what to do with them."""
        ckpt = Checkpoint(stage=self.asked, done=done, **{**self.common, **fields})
        try:
            checkpoints.save(self.path, ckpt)
        except RunError as e:
            rescue = os.path.join(RESCUE, os.path.basename(self.path))
            try:
                os.makedirs(RESCUE, exist_ok=True)
                checkpoints.save(rescue, ckpt)
            except (RunError, OSError):
                raise RunError(f"{e}, and nowhere else had room either: free some space and run again (this stage "
                               f"trains again)") from None
            raise RunError(f"{e}; the stage's weights are kept in {rescue}: free some space, move that file to "
                           f"{self.path} and run again ({'it is reused' if done else 'with --resume to continue'})"
                           ) from None
        if not done:
            print(f"saved {self.path}; run again with --resume to continue")

    def saver(self, state):
        """save(step, opt, history, done) for lab/train.train_loop, the weights from state() at each save."""
        def save(step, opt, history, done):
            self.save(done, model=state(), step=step, optimizer=opt.state_dict(), history=history)
        return save


@dataclass
class Prepared:
    """What a base's own stages (lab/gpt_stages.py, lab/smollm_stages.py) leave for the drafters' stages, the
    trees and the report (lab/pipeline.py), and the few things they do differently."""
    base: object                  # the frozen base, on the run's device, float32
    enc: object                   # its tokenizer
    common: dict                  # what every drafter checkpoint holds besides (base, tokenizer, run)
    data: TrainingData            # what the drafters train on
    texts: Callable               # texts(model) -> (greedy texts, sampled texts): what a drafter's trees grow from
    step_prompt: object           # (S,) token ids the step costs are timed on
    report_prompts: list          # held-out prompts (1-D token ids) the report decodes
    tree_options: dict            # lab/tree_choice.choose's sizes: max_tree, ranks, sizes, repeats, n_new
    report_options: Callable      # report_options(drafted) -> lab/report.run_report's keyword arguments
    finish: Callable              # finish(result, trained) -> the report with the base's own figures added
    with_base: Callable | None = None    # with_base(kind) -> (model, metrics): a drafter the base trained with it
    base_loss: Callable | None = None    # base_loss(base) -> its held-out loss (a drafter stage that trains it)
