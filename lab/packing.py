"""bf16 weights packed once for a CPU's bf16 kernels: what makes a bf16 decoding copy fast on a CPU with AMX or
AVX512-BF16 (lab/dtypes.decoding_copy applies it)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.devices import cpu_has_native_bf16


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


