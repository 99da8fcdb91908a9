"""What train_heads.py, benchmark.py, sample.py and the notebooks share: presets, the device,
checkpoints, the data and prompts. Nothing here trains or times anything, so every command can
import it without importing another command (the imports form no cycle)."""
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
from medusa_mini import GPT, GPTConfig, MedusaModel

# Sizes and defaults per preset. seq_len is both the training window and the model's context
# (block_size), so every position that generation uses has been trained; prompt + new tokens of
# every stage must fit in it (train_heads.generation_lengths, tested).
# cpu: the whole run in under 15 minutes on 2 cores (recipe measured: README).
# gpu: about 8 passes over the 1.6M training tokens, with weight decay (see README); minutes on a laptop GPU.
# tiny: under a minute, for tests and notebooks in CI.
PRESETS = {
    "tiny": dict(vocab_size=320, seq_len=128, n_layer=2, n_head=2, n_embd=64, num_heads=3,
                 batch_size=8, base_steps=150, base_lr=3e-3, weight_decay=0.0, distill_prompts=64,
                 distill_len=48, distill_sampled=0.5, head_steps=150, head_lr=3e-3, joint_steps=30,
                 eval_prompts=8, report_prompts=3, report_tokens=32, max_tree=16, rank_depth=6),
    "cpu": dict(vocab_size=2048, seq_len=128, n_layer=4, n_head=4, n_embd=256, num_heads=5,
                batch_size=32, base_steps=1000, base_lr=2e-3, weight_decay=0.0, distill_prompts=768,
                distill_len=112, distill_sampled=0.5, head_steps=250, head_lr=2e-3, joint_steps=120,
                eval_prompts=48, report_prompts=10, report_tokens=96, max_tree=64, rank_depth=10),
    "gpu": dict(vocab_size=2048, seq_len=256, n_layer=6, n_head=6, n_embd=384, num_heads=5,
                batch_size=64, base_steps=800, base_lr=1.5e-3, weight_decay=0.1, distill_prompts=4096,
                distill_len=192, distill_sampled=0.5, head_steps=600, head_lr=2e-3, joint_steps=400,
                eval_prompts=128, report_prompts=16, report_tokens=192, max_tree=64, rank_depth=10),
}


# ---------------------------------------------------------------------------------------- device

def pick_device(name=None) -> torch.device:
    """The device named, else the first available of cuda, mps, cpu."""
    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


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
    the fp32 base keeps the output exact whatever the drafts are. Measured on the cpu preset (README):
    a clear gain at 1 thread, none to tell apart from noise at 2. A GPU at batch 1 waits on launches,
    not bytes: there the cast would be one launch more."""
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

def save_checkpoint(path, **contents):
    """torch.save to a temp file beside `path`, then rename: a crash never leaves half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    os.close(fd)
    try:
        torch.save(contents, tmp)
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


def load_checkpoint(path, config: GPTConfig | None = None, device="cpu"):
    """read_checkpoint, then a clear ValueError for a checkpoint of another kind or model config."""
    if not os.path.exists(path):
        raise ValueError(f"{path} not found: run `python train_heads.py` first")
    ckpt = read_checkpoint(path, device)
    if not isinstance(ckpt, dict) or "config" not in ckpt or "model" not in ckpt:
        raise ValueError(f"{path} is not a medusa-mini checkpoint (no config or model in it)")
    if config is not None and ckpt["config"] != dataclasses.asdict(config):
        raise ValueError(f"{path} was made for config {ckpt['config']}, but this run uses "
                         f"{dataclasses.asdict(config)}; use another --out or --preset, or delete it")
    return ckpt


def load_tokenizer(ref):
    """The tiktoken Encoding a checkpoint names: {"kind": "bpe", "path": ...} or {"kind": "gpt2"}."""
    if ref["kind"] == "gpt2":
        return data.get_gpt2_encoding()
    if not os.path.exists(ref["path"]):
        raise ValueError(f"the checkpoint's tokenizer file {ref['path']} is missing: run train_heads.py again")
    return data.load_bpe(ref["path"])


def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_medusa(path, device="cpu"):
    """The trained MedusaModel and its checkpoint dict (tree, accuracies, metrics) from heads.pt."""
    ckpt = load_checkpoint(path, device=device)
    try:
        model = MedusaModel(GPT(GPTConfig(**ckpt["config"])), num_heads=ckpt["num_heads"],
                            share_lm_head=ckpt.get("share_lm_head", False))
        model.load_state_dict(ckpt["model"])
    except (KeyError, TypeError, RuntimeError) as e:  # a foreign or damaged state dict
        raise ValueError(f"{path} does not hold a medusa-mini model ({type(e).__name__}: {e})") from None
    return draft_cheaply(model.to(device).eval(), device), ckpt


def run_args(preset, out, **settings):
    """The settings a finished run used, for commands that re-open it (benchmark.py, the notebooks):
    the preset's values, overridden by `settings` (e.g. a checkpoint's own)."""
    import argparse
    args = argparse.Namespace(preset=preset, out=out, data=None, tokenizer="bpe", val_plays=3, seed=0)
    for key, value in {**PRESETS[preset], **settings}.items():
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
