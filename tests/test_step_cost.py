"""What a Medusa step costs a GPU, counted on the CPU: kernel-launching ops and host reads.

On a GPU a model this small is launch-bound: a step costs about one kernel launch per aten op that
computes something, whatever the number of tokens, and every read of a tensor's value on the host
makes the CPU wait for the GPU. Both are counted exactly with a TorchDispatchMode, so they can be
tested where timings cannot.

The two bounding tests record what they measure (record_property) beside the reference's figures and
their bounds; `python -m pytest` holds the reference code to the bounds. The bounds guard
against a step that regresses (rebuilt per call, a loop over the heads, a second read from the
device), not against the few ops a readable step spends (docs/results.md: what they cost)."""
import pytest
import torch

from conftest import random_medusa
from lab import drafters
from lab.ops import OpCounter, count_ops
from tree import dense_tree

TREE = dense_tree([2, 2, 1, 1])  # 2 + 4 + 4 + 4 = 14 nodes, depth 4
HOST_READS_BOUND = 1           # host reads per step, any mode
REFERENCE_OPS_PER_STEP = 73.8  # what the reference code counts per step
PLAIN_OPS_PER_TOKEN = 55       # and per plain token
OPS_RATIO_BOUND = round(1.05 * REFERENCE_OPS_PER_STEP / PLAIN_OPS_PER_TOKEN, 2)  # 5% over the reference step: 1.41
MEDUSA = drafters.get("medusa")


@pytest.mark.parametrize("kwargs", [dict(), dict(temperature=0.7, sampling="typical"),
                                    dict(temperature=0.7, sampling="typical-fast"), dict(stop_tokens=[31]),
                                    dict(temperature=0.7, sampling="typical", stop_tokens=[31])])
def test_greedy_and_typical_steps_read_the_device_once(kwargs, record_property):
    """At most one host read per step (the accept length and best row, read together; with stop
    tokens, whether the run ended too), none per plain token."""
    model = random_medusa(n_layer=4, block_size=128)
    ops = count_ops(MEDUSA, model, torch.tensor([[1, 2, 3, 4]]), TREE, n_new=40, **kwargs)
    record_property("mode", ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "greedy")
    record_property("host_reads_per_step", ops["host_reads_per_step"])
    record_property("host_reads_bound", HOST_READS_BOUND)
    assert ops["host_reads_per_step"] <= HOST_READS_BOUND, \
        f"{ops['host_reads_per_step']:.2f} host reads per step with {kwargs or 'greedy'}: at most {HOST_READS_BOUND}"
    assert ops["plain_host_reads_per_token"] == 0, ops


def test_a_step_launches_few_ops_more_than_a_plain_token(record_property):
    """Kernel-launching ops per Medusa step over ops per plain token, for a 4-layer model (the cpu
    preset's depth; op counts do not depend on width) and a 4-deep tree. These heads agree with the
    base, so every step accepts a whole path and moves its cache entries (2 ops): the reference
    counts REFERENCE_OPS_PER_STEP ops per step against 55 per plain token, 1.34; the bound leaves 5% over
    that (1.41), room for a few readable ops. A step rebuilt per call (the tree's buffers made again) or a
    loop over the heads would put it near 1.6.
    Counted as a GPU decodes: a model set to draft in bf16 (on CPUs) is counted drafting in fp32."""
    torch.manual_seed(0)
    model = random_medusa(n_layer=4, block_size=128)
    with torch.no_grad():  # heads that agree with the base, so every step accepts and moves its cache
        for head in model.heads:
            head.residual.weight.zero_()
    ops = count_ops(MEDUSA, model, torch.tensor([[1, 2, 3, 4]]), TREE, n_new=40)
    assert ops["plain_ops_per_token"] == PLAIN_OPS_PER_TOKEN, ops["plain_ops_per_token"]
    for name, value in [("ops_per_step", ops["ops_per_step"]), ("ops_ratio", ops["ops_ratio"]),
                        ("ops_ratio_bound", OPS_RATIO_BOUND), ("reference_ops_per_step", REFERENCE_OPS_PER_STEP)]:
        record_property(name, value)
    assert ops["tokens_per_step"] > 2, \
        f"{ops['tokens_per_step']:.2f} tokens per step: heads that agree with the base commit whole paths"
    assert ops["ops_ratio"] <= OPS_RATIO_BOUND, (
        f"{ops['ops_per_step']:.1f} ops per step, {ops['ops_ratio']:.2f}x a plain token's "
        f"{ops['plain_ops_per_token']:.0f}: over {OPS_RATIO_BOUND:.2f}; per step by op: "
        f"{ {op: round(n, 1) for op, n in ops['ops_by_name'].items() if round(n, 1)} }")
    model.draft_dtype = torch.bfloat16
    assert count_ops(MEDUSA, model, torch.tensor([[1, 2, 3, 4]]), TREE, n_new=40)["ops_ratio"] == ops["ops_ratio"]
    assert model.draft_dtype == torch.bfloat16  # restored after counting


def test_the_counter_sees_host_reads_and_skips_views():
    """int(), .tolist() and torch.equal are host reads; views launch nothing."""
    x = torch.arange(6)
    with OpCounter() as counter:
        y = x.view(2, 3).t()
        z = y + 1
        int(z[0, 0]), z.tolist(), torch.equal(z, z)
    assert counter.host_reads == 3
    assert dict(counter.ops) == {"aten.add": 1}
