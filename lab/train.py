"""The training loop every stage shares: AdamW with warm-up and cosine decay, mixed precision where the
device has it, and stopping that loses nothing.

- A step's randomness (its batch, EAGLE's noise) comes from a generator seeded by the run's seed and
  the step's number (step_generator), so a resumed stage draws what the uninterrupted one would have:
  an interrupted and resumed run ends with the same weights as one that was never stopped.
- Ctrl-C and SIGTERM (`timeout`, `docker stop`) are noted and acted on between steps: the stage saves a
  resumable checkpoint after its last whole step, and the command exits (status 130); --resume continues.
"""
import contextlib
import math
import signal
import sys
import time
import zlib

import torch
from tqdm import tqdm

from lab.devices import cpu_has_native_bf16

LOG_EVERY = 10  # read the loss on the host every 10 steps: .item() makes the CPU wait for the GPU


def training_dtype(device) -> torch.dtype:
    """The autocast dtype for training: bf16 on a CUDA GPU with bf16 tensor cores; fp16 (with a
    GradScaler) on one without (a T4 only emulates bf16, slowly); bf16 on a CPU with bf16
    instructions (native bf16 products there); fp32 elsewhere (MPS included)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def autocast(device):
    dtype = training_dtype(device)
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def to_device(t, device):
    """A CPU tensor onto the device; on CUDA from pinned memory, without waiting for the copy."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def step_generator(seed: int, step: int, device="cpu") -> torch.Generator:
    """The random generator of one training step: the same for the same seed and step, on `device`."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + step)


def stream_seed(seed: int, name: str) -> int:
    """A stage's own seed, from the run's: different stages draw different batches."""
    return seed + zlib.crc32(name.encode()) % 10_000


def windows(ids, count, length, generator):
    """count random windows of `length` tokens from ids (a 1-D numpy array): (count, length) on the CPU."""
    import numpy as np
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator).tolist()
    return torch.from_numpy(np.stack([ids[s:s + length].astype(np.int64) for s in starts]))


def corpus_batch(ids, batch_size, seq_len, generator, device):
    """Inputs x (B, T) and next tokens y (B, T) from random windows of T+1 tokens of a corpus."""
    xy = to_device(windows(ids, batch_size, seq_len + 1, generator), device)  # (B, T+1)
    return xy[:, :-1], xy[:, 1:]


def rows_batch(rows, batch_size, generator, device):
    """Inputs and next tokens from random rows of a text tensor (rows, T+1), e.g. self-distilled text."""
    pick = torch.randint(0, len(rows), (batch_size,), generator=generator)
    xy = to_device(rows[pick], device)
    return xy[:, :-1], xy[:, 1:]


def lr_at(step, total, peak, warmup_frac=0.05):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@contextlib.contextmanager
def stop_requests():
    """While the block runs, Ctrl-C and SIGTERM set stop["asked"] (the signal's name) instead of raising,
    so that the loop stops between two steps. Outside the main thread (no signals there) nothing changes."""
    stop = {"asked": None}

    def note(signum, frame):
        stop["asked"] = signal.Signals(signum).name

    try:
        previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def train_loop(name, params, loss_fn, steps, lr, save, resume_from=None, weight_decay=0.0):
    """AdamW with warm-up and cosine decay. params: [(tensors, lr multiplier)]; weight decay on
    matrices only (not on biases and norm gains, as in GPT-2). loss_fn(step) returns (loss, {name: tensor
    to show}), drawing its randomness from step_generator(seed, step); both are read on the host only
    every LOG_EVERY steps. resume_from: a checkpoint save() wrote when interrupted (lab/checkpoints.Checkpoint:
    its step, the steps done; optimizer; history).

    Returns (history of step, loss and seconds, optimizer). Ctrl-C or SIGTERM: after the step under way,
    save(steps_done, opt, history, done=False) writes a resumable checkpoint, and the process exits
    with status 130."""
    device = params[0][0][0].device
    groups = [{"params": [t for t in p if (t.dim() >= 2) == matrices], "mult": m,
               "weight_decay": weight_decay if matrices else 0.0} for p, m in params for matrices in (True, False)]
    opt = torch.optim.AdamW([group for group in groups if group["params"]], lr=lr)
    scaler = torch.amp.GradScaler(device.type, enabled=training_dtype(device) == torch.float16)
    start, history = 0, {"step": [], "loss": [], "seconds": []}
    if resume_from is not None:
        opt.load_state_dict(resume_from.optimizer)
        start, history = resume_from.step, resume_from.history
        print(f"{name}: resuming at step {start}")
    t0 = time.time() - (history["seconds"][-1] if history["seconds"] else 0.0)
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps, dynamic_ncols=True)
    with stop_requests() as stop:
        for step in bar:
            if stop["asked"]:
                bar.close()
                print(f"\n{name}: stopped by {stop['asked']} after step {step} of {steps}")
                save(step, opt, history, done=False)
                sys.exit(130)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr) * group["mult"]
            loss, shown = loss_fn(step)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if step % LOG_EVERY == 0 or step == steps - 1:
                history["step"].append(step)
                history["loss"].append(loss.item())
                history["seconds"].append(time.time() - t0)
                bar.set_postfix({k: f"{v.item():.3f}" for k, v in {"loss": loss, **shown}.items()})
        if stop["asked"]:  # asked during the last step: saved as not done, --resume finishes the stage
            print(f"\n{name}: stopped by {stop['asked']} after its last step")
            save(steps, opt, history, done=False)
            sys.exit(130)
    return history, opt
