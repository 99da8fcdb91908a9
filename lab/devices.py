"""The device a run uses and what it is good at: the device from --device, checked before anything
runs; whether bfloat16 products are native there, and so the dtype a base decodes in (--dtype); the copy
that decodes in it (its bf16 weights packed once on a CPU); waiting for a GPU's queued work before a timer
reads.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --dtype's choices, and auto


def auto_dtype(device_type: str, units: str | None, base_kind: str) -> tuple[torch.dtype, str]:
    """--dtype auto: the dtype a base decodes in on this kind of device, from its bf16 units alone (bf16_units),
    and why: bfloat16 where it is native and pays for that base, float32 everywhere else (the measurements:
    docs/results.md, "bf16 where it is native").
    - SmolLM2: bfloat16 on a CPU with bf16 instructions (AMX or AVX512-BF16; the definition draft_cheaply
      uses) and on a GPU with bf16 tensor cores. Its float32 weights are 540 MB: halving the bytes pays,
      and a bf16 pass grows far more slowly with the tokens it verifies.
    - The tiny GPT: float32 everywhere. On a CPU a plain bf16 step of the cpu preset's model is no faster
      than float32's (the tiny preset's is slower), and on a GPU its 14 MB of weights are not what a step
      waits on (kernel launches are). float32 also keeps greedy speculation identical to plain greedy.
    - A GPU without bf16 tensor cores (a T4): float32. fp16 would be its fast dtype, but a model trained in
      bf16 or fp32 can overflow fp16's range, so it is not a choice here (training_dtype uses it for training).
    - MPS: float32 (bf16 needs macOS 14 and is not measured here: --dtype bfloat16 to try it)."""
    if base_kind == "gpt":
        return torch.float32, "the tiny GPT decodes in float32: bf16 does not pay for a model this small"
    if units is None:
        return torch.float32, {"cuda": "this GPU has no bf16 tensor cores", "cpu": "this CPU has no bf16 "
                               "instructions (avx512_bf16, amx_bf16)"}.get(device_type, f"bf16 is not measured on "
                                                                                       f"{device_type}")
    return torch.bfloat16, f"{units}: bf16 products are native here"


def decoding_dtype(choice: str, device, base_kind: str) -> tuple[torch.dtype, str]:
    """The dtype --dtype asks the base to decode in, and why (auto: auto_dtype on this device's units)."""
    if choice != "auto":
        return DTYPES[choice], "--dtype " + choice
    device = torch.device(device)
    dtype, why = auto_dtype(device.type, bf16_units(device), base_kind)
    return dtype, "auto: " + why


def add_dtype_flag(parser, default="auto"):
    """--dtype, as every command that decodes takes it."""
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default=default,
                        help="the base model's dtype when decoding (weights and checkpoints stay float32); auto "
                             "(default): bfloat16 where it is native and pays for this base, else float32; it "
                             "prints what it picked, and why")


def chosen_dtype(choice: str, device, base_kind: str) -> str:
    """decoding_dtype's choice, printed with its reason: the dtype's name, as a run keeps it."""
    dtype, why = decoding_dtype(choice, device, base_kind)
    print(f"decoding in {dtype_name(dtype)} ({why})")
    return dtype_name(dtype)


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as a checkpoint's trees and the reports name a dtype."""
    return str(dtype).removeprefix("torch.")


def decoding_copy(model, dtype):
    """The model to decode with in `dtype`: itself when it is in that dtype already, else a copy cast to it
    (the trained weights, and the checkpoint, stay as they are: the dtype is a decoding setting), its
    linear layers packed where that pays (pack_linears). The KV cache, the tree buffers and the masks follow
    the base's dtype; softmax and acceptance cast the logits to float32 (verify.py)."""
    if model.base.lm_head.weight.dtype == dtype:
        return model
    return pack_linears(copy.deepcopy(model).to(dtype))


class PackedLinear(nn.Module):
    """A linear layer of a bf16 copy that decodes on a CPU, its weight packed once into the layout oneDNN's
    bf16 kernels (AMX, AVX512-BF16) read. torch's F.linear in bf16 reorders a plain weight into that layout
    on every call, which made a one-token bf16 pass of SmolLM2 slower than float32's (docs/results.md,
    "bf16 on the AMX VM"). The outputs are F.linear's (tests/test_precision.py). The ops are the ones
    torch.compile's weight freezing uses (torch.ops.mkldnn). The weight and bias are the layer's own
    parameters: a tied lm_head stays tied, and whatever reads .weight reads the same tensor. Only for a
    frozen copy: a new weight tensor (a cast, a load) is packed anew, a change in place is not seen."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.packed, self.packed_from = None, None  # packed at the first call (a deepcopy cannot copy it: packs anew)

    def __getstate__(self):
        return {**self.__dict__, "packed": None, "packed_from": None}

    def forward(self, x):
        if self.weight.dtype != torch.bfloat16 or self.weight.device.type != "cpu":  # cast or moved since
            return F.linear(x, self.weight, self.bias)                                   # (..., in) -> (..., out)
        if self.packed_from != self.weight.data_ptr():  # first call, or a new weight since
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self.packed_from = self.weight.data_ptr()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # (..., in) -> (..., out)

    def extra_repr(self):
        return f"in_features={self.weight.size(1)}, out_features={self.weight.size(0)}, packed for bf16"


def packs_bf16(weight) -> bool:
    """Whether pack_linears packs a layer of this weight: bf16 on a CPU with bf16 instructions, in a torch
    built with oneDNN."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and cpu_has_native_bf16()
            and torch.backends.mkldnn.is_available())


def pack_linears(model):
    """model with each nn.Linear replaced by a PackedLinear of the same parameters, where packs_bf16 says it
    pays; elsewhere (float32, a GPU, a CPU without bf16 instructions) the model as it is."""
    if not packs_bf16(next(model.parameters())):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
    return model


def draft_cheaply(model, device, base_kind: str):
    """Let decoding draft in bfloat16 (model.draft_dtype) on a CPU where --dtype auto would decode this base in
    bfloat16 (auto_dtype): drafts are only proposals (verify.Drafter), and a drafter's weights in bf16 are half
    the bytes to read each step, which is what SmolLM2's heads cost there. The drafting rule is the decoding
    rule: the tiny GPT drafts in float32, because its one-row products run slower in bf16 on a CPU with AMX
    (docs/results.md, "bf16 on the AMX VM"). A GPU at batch 1 waits on launches, not bytes: there the cast
    would be one launch more."""
    device = torch.device(device)
    bf16 = device.type == "cpu" and auto_dtype("cpu", bf16_units(device), base_kind)[0] == torch.bfloat16
    model.draft_dtype = torch.bfloat16 if bf16 else None
    return model


def sync(device):
    """Wait for the GPU's queued work, so a timer reads the work and not only its launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
