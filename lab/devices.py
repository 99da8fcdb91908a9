"""The device a run uses and what it is good at: the device from --device, checked before anything
runs; whether bfloat16 products are native there; waiting for a GPU's queued work before a timer reads.
"""
import torch

from lab.cli import UsageError


def pick_device(name=None) -> torch.device:
    """The device named, else the first available of cuda, mps, cpu. A device this machine or this torch
    build does not have, or a string that names none, is a UsageError that says which, and what to install."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {name!r}: not a device; use cuda, mps or cpu (or cuda:N)") from None
    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise UsageError(f"--device {name}: this torch build ({torch.__version__}) has no CUDA; install a CUDA "
                             f"build (https://pytorch.org/get-started/locally/), e.g. pip install torch "
                             f"--index-url https://download.pytorch.org/whl/cu126")
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: torch {torch.__version__} has CUDA, but sees no GPU "
                             f"(check the driver with nvidia-smi, and CUDA_VISIBLE_DEVICES)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps":
        if not torch.backends.mps.is_built():
            raise UsageError(f"--device {name}: this torch build ({torch.__version__}) has no MPS: it runs on "
                             f"Apple silicon Macs, with torch from pip on macOS")
        if not torch.backends.mps.is_available():
            raise UsageError(f"--device {name}: MPS is not available here (it needs macOS 12.3+ on Apple silicon)")
        if device.index not in (None, 0):
            raise UsageError(f"--device {name}: a Mac has one MPS device, mps")
    elif device.type == "cpu":
        if device.index not in (None, 0):
            raise UsageError(f"--device {name}: the CPU is one device, cpu (torch.set_num_threads picks the cores)")
        device = torch.device("cpu")
    else:
        raise UsageError(f"--device {name}: medusa-mini runs on cuda, mps or cpu")
    return device


def cpu_flags() -> set[str]:
    """This CPU's feature flags, from /proc/cpuinfo (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(flags=None) -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), from the Linux flags."""
    flags = cpu_flags() if flags is None else flags
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def native_bf16(device) -> bool:
    """Whether bfloat16 products are fast here: a CUDA GPU with bf16 tensor cores, or a CPU with bf16 instructions."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_native_bf16()


def draft_cheaply(model, device):
    """Let decoding draft in bfloat16 on a CPU with bf16 instructions (model.draft_dtype): the drafter's
    weights are then half the bytes to read each step, which is what they cost there (verify.Drafter:
    drafts are only proposals). A GPU at batch 1 waits on launches, not bytes: there the cast would be
    one launch more."""
    model.draft_dtype = torch.bfloat16 if torch.device(device).type == "cpu" and cpu_has_native_bf16() else None
    return model


def sync(device):
    """Wait for the GPU's queued work, so a timer reads the work and not only its launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
