"""The tiny GPT's run, said up front: the device, the training dtype, and each stage's estimated peak
memory and time, before any training (train_heads.py prints it). Estimates, from parameter and
activation counts and two measured steps; not measurements.
"""

import torch
import torch.nn.functional as F

from lab import drafters, report, timing
from lab.cli import UsageError
from lab.dtypes import dtype_name
from lab.train import autocast, training_dtype
from medusa_mini import GPT, GPTConfig, generate

DISTILL_PROMPT = 16         # tokens of training text each self-distilled continuation starts from
CPU_MEMORY_BUDGET = 2**30   # bytes batched generation may use where free memory cannot be read (CPU, MPS)
DECODING_SLOWDOWN = 3       # batched one-token forwards reach a fraction of a training step's FLOP rate


def estimate_generation_bytes(config: GPTConfig, rows, length, prompt=DISTILL_PROMPT):
    """Batched fp32 generation: each row's KV cache (length entries, every layer, K and V) plus the
    prefill's activations (about 18 numbers per width per layer, and the logits) for `prompt` tokens."""
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    return 4 * rows * (2 * L * length * C + prompt * (18 * L * C + V))


def generation_batch_size(config: GPTConfig, length, device):
    """Rows of batched generation that fit: half the free memory on CUDA (torch.cuda.mem_get_info),
    else CPU_MEMORY_BUDGET. A row holds its KV cache (length entries) and one position's activations."""
    bytes_per_row = estimate_generation_bytes(config, 1, length)
    budget = torch.cuda.mem_get_info(device)[0] // 2 if torch.device(device).type == "cuda" else CPU_MEMORY_BUDGET
    return max(1, min(1024, budget // bytes_per_row))


def drafter_parameters(config: GPTConfig, run) -> dict:
    """{name: the drafter's own parameters} for the run's drafters, from models built on the meta device."""
    with torch.device("meta"):
        base = GPT(config)
        return {name: report.parameters(drafters.get(name).model(base, **drafters.get(name).config(run, base)))
                for name in run.drafters}


def stage_label(kind, stage, run) -> str:
    """How the plan names a drafter's training stage: the drafter, or its stage's file when it has several."""
    return kind.name if len(kind.stages(run)) == 1 else stage.file


def estimate_memory(config: GPTConfig, run, dtype=torch.float32) -> dict:
    """Estimated peak bytes per stage.

    Training holds fp32 weights, gradients and AdamW's two moments (16 bytes a parameter), the
    activations kept for the backward pass (about 18 numbers per width per token per layer, in the
    autocast dtype; the fused attention kernel keeps no T x T matrix), and the logits with their fp32
    copy and gradient. A drafter trains on the frozen base's features (one layer's activations, a few
    projections of the logits' size). Generation holds the weights and the KV cache."""
    N = sum(p.numel() for p in GPT(config).to("meta").parameters())
    P = drafter_parameters(config, run)
    B, T, C, V, L = run.batch_size, run.seq_len, config.n_embd, config.vocab_size, config.n_layer
    a = torch.finfo(dtype).bits // 8
    activations = B * T * 18 * C * L * a
    logits = B * T * V * (a + 8)
    rows = generation_batch_size(config, DISTILL_PROMPT + run.distill_len, run.device)
    memory = {"base": 16 * N + activations + logits,
              "distill": 4 * N + estimate_generation_bytes(config, rows, DISTILL_PROMPT + run.distill_len)}
    for name, p in P.items():
        kind = drafters.get(name)
        for stage in kind.stages(run):  # one that trains the base too holds its gradients and moments
            memory[stage_label(kind, stage, run)] = (20 * N + 16 * p + activations + (kind.outputs(run) + 2) * logits
                                                     if stage.changes_base else
                                                     4 * N + 16 * p + 2 * activations // L + kind.outputs(run) * logits)
    memory["tree and report"] = 4 * (N + sum(P.values())) + estimate_generation_bytes(config, 1, run.seq_len,
                                                                                      prompt=run.seq_len)
    return memory


def report_modes_count(run) -> int:
    """How many modes the report times: the plain two, and per drafter its chosen tree, its extra trees,
    typical and exact sampling on the chosen tree and exact sampling on its sampling tree."""
    config = GPTConfig(vocab_size=run.vocab_size, block_size=run.seq_len, n_layer=1, n_head=run.n_head,
                       n_embd=run.n_embd)
    with torch.device("meta"):
        base = GPT(config)
        extra = sum(len(drafters.get(name).extra_trees(drafters.get(name).model(base, **drafters.get(name).config(run, base)),
                                                        [(0,)], [(0,)], run)) for name in run.drafters)
    return 2 + 4 * len(run.drafters) + extra


def estimate_seconds(config: GPTConfig, run, train_step, decode_step) -> dict:
    """Estimated seconds per stage, from two measured steps: training stages scale the base step by
    their FLOPs (6 per parameter per token to train, 2 to run forward, plus attention); the report
    is about one batch-1 decoding step per generated token (a drafted step costs more but commits more)."""
    N = sum(p.numel() for p in GPT(config).to("meta").parameters())
    P = drafter_parameters(config, run)
    B, T, C, L, V = run.batch_size, run.seq_len, config.n_embd, config.n_layer, config.vocab_size
    attention = 2 * L * T * C  # FLOPs per token, forward: scores and weighted values over ~T/2 keys
    rate = (6 * N + 3 * attention) * B * T / train_step  # FLOP/s
    rounds = run.timing_rounds
    n_threads = len(timing.thread_counts(run.device, run.threads))
    step_costs = (rounds or timing.STEP_COST_REPEATS) * (len(timing.STEP_COST_SIZES) + 1) * timing.STEP_COST_TOKENS
    every, modes = 2 + len(run.drafters), report_modes_count(run)  # at every thread count, the rest at one
    report_tokens = run.report_tokens * (
        run.report_prompts * (every * n_threads + modes - every) * (rounds or report.REPORT_REPEATS)
        + report.SWEEP_PROMPTS * (len(report.SWEEP_SIZES) + 2) * (rounds or report.SWEEP_REPEATS))
    seconds = {"base": run.base_steps * train_step,
               "distill": run.distill_prompts * (DISTILL_PROMPT + run.distill_len) * (2 * N + attention) / rate
               * DECODING_SLOWDOWN}
    for name, p in P.items():
        kind = drafters.get(name)
        for stage in kind.stages(run):  # a stage that trains the base runs its backward pass too
            per_token = (8 * N + 5 * attention + 6 * p) if stage.changes_base else (2 * N + attention + 6 * p + 6 * C * V)
            seconds[stage_label(kind, stage, run)] = stage.steps(run) * B * T * per_token / rate
    seconds["tree and report"] = (n_threads * step_costs * len(run.drafters) + report_tokens) * decode_step
    return seconds


def measure_steps(config: GPTConfig, run, device):
    """Seconds of one base-model training step with this run's batch and of one batch-1 decoding
    step, on a throwaway model (each the last of a few: the first ones pay for warm-up)."""
    model = GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    x = torch.zeros(run.batch_size, run.seq_len, dtype=torch.long, device=device)

    def step():
        with autocast(device):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        train_step, _ = timing.timed(step, device)
    n = 8
    generate(model, x[:1, :8], 2)
    decode, _ = timing.timed(lambda: generate(model, x[:1, :8], n + 1), device)
    return train_step, decode / n


def available_bytes(device) -> int | None:
    """Memory a run can use: a GPU's free memory, or the CPU's available memory (Linux: /proc/meminfo); None
    where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


LONGEST = 7 * 24 * 3600  # a run estimated to take longer than a week is refused: it would not finish


def print_plan(run, config, device):
    """Device, dtype, and the estimated peak memory and time of each stage, before any training. A run whose
    estimated peak does not fit in the memory at hand, or that would take more than a week, is refused in one
    line (UsageError) before anything is measured or trained."""
    dtype = training_dtype(device)
    memory = estimate_memory(config, run, dtype)
    have = available_bytes(device)
    stage, peak = max(memory.items(), key=lambda kv: kv[1])
    if have is not None and peak > have:
        raise UsageError(f"--batch-size {run.batch_size} --seq-len {run.seq_len}: the {stage} stage would need about "
                         f"{peak / 2**30:.1f} GiB, and {device} has {have / 2**30:.1f} GiB free: ask for less")
    step, decode = measure_steps(config, run, device)
    seconds = estimate_seconds(config, run, step, decode)
    if sum(seconds.values()) > LONGEST:
        raise UsageError(f"this run would take about {sum(seconds.values()) / 86400:.0f} days by the plan's estimate "
                         f"(its base alone {seconds['base'] / 86400:.1f} days): ask for fewer steps")
    print(f"plan: {device}, training in {dtype_name(dtype)}; one base step measured at {step:.2f}s; "
          f"memory and other times estimated from parameter and activation counts (lab/plan.py)")
    for stage in seconds:
        print(f"  {stage:15s} peak ~{memory[stage] / 2**30:5.2f} GiB   ~{seconds[stage] / 60:5.1f} min")
