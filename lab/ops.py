"""Ops per step: what decoding would cost a GPU where a model is this small (launch-bound), counted exactly on
the CPU: kernel-launching aten ops per plain token and per drafted step, and the host reads per step.
Any drafter: count_ops takes a registry entry (lab/drafters.py), never a drafter's name.
"""
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # torch's documented hook for op counting

from medusa_mini import generate
from verify import prefill


class OpCounter(TorchDispatchMode):
    """Counts what decoding would cost a GPU where a model is this small: one kernel launch per aten
    op that computes something (views only relabel memory, so they are left out), and every read of
    a tensor's value on the host, which makes the CPU wait for the GPU."""
    HOST_READS = {"aten._local_scalar_dense", "aten.equal", "aten.nonzero", "aten.is_nonzero", "aten.masked_select"}
    FREE = {"aten._unsafe_view", "aten.scalar_tensor"}  # metadata, or a CPU scalar: no kernel

    def __init__(self):
        super().__init__()
        self.ops, self.host_reads = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.HOST_READS:
            self.host_reads += 1
        elif not func.is_view and name not in self.FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        # .tolist() reads a whole tensor on the host without an aten op: count it by hand.
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(tensor):
            counter.host_reads += 1
            return tolist(tensor)
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def total(self):
        return sum(self.ops.values())


@torch.no_grad()
def count_ops(kind, model, prompt, tree, n_new=64, **decode_kwargs):
    """Kernel-launching ops per plain token and per drafted step (kind: the drafter's registry entry),
    and host reads per step.

    Plain: the difference between generating 2m and m tokens (m = n/2), per token. Drafted: a whole
    generation minus what comes before its first step (the prompt's forward, the drafter's start), per
    step. ops_ratio = ops per step / ops per plain token; on a GPU, where a small model's step costs
    about one launch per op, tokens/step / ops_ratio projects the speedup (a projection, not a
    measurement). Counted as a GPU decodes: drafting in the base's dtype (model.draft_dtype set aside)."""
    block = model.base.config.block_size
    n_new = min(n_new, block - prompt.size(1))          # everything within the context
    saved, model.draft_dtype = model.draft_dtype, None
    try:
        n_plain = n_new // 2                             # plain: generate 2 * n_plain and n_plain tokens
        kind.generate(model, prompt, n_new, tree, **decode_kwargs)  # build the tree buffers first

        def start():  # what a generation does before its first step
            drafter = kind.drafter(model, tree, prompt.device)
            state, h = prefill(model.base, prompt, extra=drafter.nodes, taps=drafter.taps)
            drafter.start(state, h)
        counts = []
        for fn in (lambda: generate(model.base, prompt, n_plain), lambda: generate(model.base, prompt, 2 * n_plain),
                   start, lambda: kind.generate(model, prompt, n_new, tree, **decode_kwargs)):
            with OpCounter() as counter:
                result = fn()
            counts.append((counter, result))
    finally:
        model.draft_dtype = saved
    (short, _), (long, _), (pre, _), (drafted, (_, stats)) = counts
    plain = (long.total - short.total) / n_plain
    per_step = (drafted.total - pre.total) / stats.steps
    return {"plain_ops_per_token": plain, "ops_per_step": per_step, "ops_ratio": per_step / plain,
            "host_reads_per_step": (drafted.host_reads - pre.host_reads) / stats.steps,
            "plain_host_reads_per_token": (long.host_reads - short.host_reads) / n_plain,
            "tokens_per_step": stats.tokens_per_step,
            "projected_speedup": stats.tokens_per_step / (per_step / plain),
            "ops_by_name": {k: (v - pre.ops[k]) / stats.steps for k, v in drafted.ops.most_common()}}


def format_ops(ops):
    return (f"ops per step (kernel-launching aten ops, views excluded): plain {ops['plain_ops_per_token']:.0f} per "
            f"token, a drafted step {ops['ops_per_step']:.0f} = {ops['ops_ratio']:.2f}x; host reads per step "
            f"{ops['host_reads_per_step']:.2f}; projected GPU speedup {ops['tokens_per_step']:.2f} tokens/step / "
            f"{ops['ops_ratio']:.2f} = {ops['projected_speedup']:.2f}x (a projection, not a measurement)")
