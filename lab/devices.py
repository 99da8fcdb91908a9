"""The device a run uses and what it is: the device from --device, checked before anything runs; whether
bfloat16 products are native there (lab/dtypes.py decides what that means for decoding); the machine a tree
was chosen for; waiting for a GPU's queued work before a timer reads.
"""
import os
import platform

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
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), from the Linux flags: bf16_units'."""
    return bf16_units("cpu", flags) is not None


def bf16_units(device, flags=None) -> str | None:
    """What makes bfloat16 products native on this device, named (None: nothing does): a CUDA GPU's bf16
    tensor cores, or a CPU's AMX or AVX512-BF16 instructions (from the Linux flags)."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16 tensor cores" if torch.cuda.is_bf16_supported(including_emulation=False) else None
    if device.type == "cpu":
        flags = cpu_flags() if flags is None else flags
        return "AMX (amx_bf16)" if "amx_bf16" in flags else "AVX512-BF16 (avx512_bf16)" if "avx512_bf16" in flags else None
    return None


def native_bf16(device) -> bool:
    """Whether bfloat16 products are fast here: a CUDA GPU with bf16 tensor cores, or a CPU with bf16 instructions."""
    return bf16_units(device) is not None


def sync(device):
    """Wait for the GPU's queued work, so a timer reads the work and not only its launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def machine(device) -> str:
    """The machine a measurement belongs to, in words: a GPU's name, or the CPU's model and its cores. A tree
    chosen from step costs timed here is kept for this machine (lab/pipeline.py)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return f"mps: {platform.machine()} {platform.mac_ver()[0]}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu: {model}, {os.cpu_count()} cores"
