"""The dtype a base decodes in (--dtype), and the copy that decodes in it.

--dtype auto decodes a base in bfloat16 where bf16 products are native (lab/devices.bf16_units) and bf16 pays
for that base (its registry entry says, lab/bases.py); float32 everywhere else. The trained weights, and the
checkpoints, stay float32: decoding runs on a copy (decoding_copy), its linear layers packed once on a CPU
(lab/packing.py). Drafting may run in another dtype than decoding (draft_cheaply): drafts are only proposals.
"""
import copy

import torch

from lab.devices import bf16_units
from lab.packing import pack_linears

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --dtype's choices, and auto


def auto_dtype(device_type: str, units: str | None, base_kind) -> tuple[torch.dtype, str]:
    """--dtype auto: the dtype a base (its lab/bases.py entry) decodes in on this kind of device, from its bf16
    units alone (bf16_units), and why: bfloat16 where it is native and pays for that base (base_kind.bf16_pays),
    float32 everywhere else (the measurements: docs/results.md, "bf16 where it is native").
    - SmolLM2: bfloat16 on a CPU with bf16 instructions (AMX or AVX512-BF16; the definition draft_cheaply
      uses) and on a GPU with bf16 tensor cores. Its float32 weights are 540 MB: halving the bytes pays,
      and a bf16 pass grows far more slowly with the tokens it verifies.
    - The tiny GPT: float32 everywhere. On a CPU a plain bf16 step of the cpu preset's model is no faster
      than float32's (the tiny preset's is slower), and on a GPU its 14 MB of weights are not what a step
      waits on (kernel launches are). float32 also keeps greedy speculation identical to plain greedy.
    - A GPU without bf16 tensor cores (a T4): float32. fp16 would be its fast dtype, but a model trained in
      bf16 or fp32 can overflow fp16's range, so it is not a choice here (training_dtype uses it for training).
    - MPS: float32 (bf16 needs macOS 14 and is not measured here: --dtype bfloat16 to try it)."""
    if not base_kind.bf16_pays:
        return torch.float32, base_kind.bf16_reason
    if units is None:
        return torch.float32, {"cuda": "this GPU has no bf16 tensor cores", "cpu": "this CPU has no bf16 "
                               "instructions (avx512_bf16, amx_bf16)"}.get(device_type, f"bf16 is not measured on "
                                                                                       f"{device_type}")
    return torch.bfloat16, f"{units}: bf16 products are native here"


def decoding_dtype(choice: str, device, base_kind) -> tuple[torch.dtype, str]:
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


def chosen_dtype(choice: str, device, base_kind) -> str:
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


def draft_cheaply(model, device, base_kind):
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


