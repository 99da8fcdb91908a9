"""SmolLM2-135M-Instruct's own stages, before its drafters (lab/pipeline.py runs them all for
`python train_heads.py --base smollm2`): the drafters are self-distilled on its own chat answers.

Stages, each printing what it measured (1 and 2 here; 3 to 5 are the pipeline's, for both bases):
  1. prompts   a few thousand offline instructions (lab/chat_prompts.py), with plays and topics held out.
  2. distill   the model's own greedy answers, 128 prompts at a time, each ending at its stop token; the
               hidden states decoding computed on the way are kept (the backbone is frozen, so they are
               computed once, by the same forward that decodes). Where bf16 is native, a bf16 copy of the
               model writes the training answers: they are only training data. The held-out answers
               (greedy, and sampled at T = 0.7 for the exact-sampling trees) come from the model that decodes.
  3. drafters  each drafter of the registry that --drafters names (lab/train_drafters.py), trained on those
               states over the tokens the answers use, and drafting over them (model.draft_vocab).
  4. trees     accuracies by depth on the held-out answers, a grown tree sized from measured step costs,
               and a tree for exact sampling (lab/tree_choice.py).
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
from feature_drafter import base_features, feature_width
from kv_cache import KVCache
from lab import checkpoints, llama_cpp, tree_choice
from lab.chat_prompts import instruction_prompts, same_length_batches
from lab.checkpoints import BaseInfo
from lab.config import SmolRun, as_dict, settings_for
from lab.devices import native_bf16, sync
from lab.stage import Prepared, Stage, StageRecord
from lab.timing import Mode
from lab.train import step_generator, to_device
from lab.train_drafters import TrainingData
from medusa_mini import generate

ANSWER_TOKENS = 96   # tokens generated per distillation prompt (answers end sooner at <|im_end|>: 70 on average)
BLOCK_SIZE = 384     # the KV cache's length: chat prompts of under 200 tokens and their answers
BATCH = 8            # answers per training step
COST_SIZES, COST_REPEATS, COST_TOKENS = (2, 4, 6, 8, 12, 16, 24, 32), 2, 32  # the step costs trees are sized from


# ---------------------------------------------------------------------------------------- 2. distill

@torch.no_grad()
def tap_hooks(base, taps, seen):
    """Hooks that append, at every forward, the residual stream entering each layer in `taps` (the last layer's
    output, before the final norm, for taps == n_layer) to seen[i]: (B, T, C) each."""
    modules = [base.blocks[layer] if layer < len(base.blocks) else base.norm for layer in taps]
    return [m.register_forward_pre_hook(lambda module, args, i=i: seen[i].append(args[0]))
            for i, m in enumerate(modules)]


def distill(base, enc, prompts, n_new=ANSWER_TOKENS, max_batch=128, temperature=0.0, taps=None):
    """The model's answers (greedy, or sampled at `temperature`), and every hidden state decoding computed.

    Returns h (N, L, C) in the base's dtype, on the CPU, y (N, L) and start (N,): h[i, t] is the final
    hidden state at position t of prompt + answer, y[i, t] the token at t+1 (-100, which the loss
    ignores, after the answer's stop token and in the padding), start[i] the position whose next
    token is the answer's first; with taps (layer indices), also f (N, L, len(taps) * C): the residual
    stream entering those layers, concatenated (EAGLE-3's features). Each row stops at its own stop token
    (<|im_end|>, <|endoftext|>), a batch when all of its rows have. Hooks keep what generate() computes
    anyway: the prompt's states at prefill, then one per token."""
    device = base.lm_head.weight.device
    prompt_ids = [smollm.chat_tokens(enc, p) for p in prompts]
    stops = smollm.stop_tokens(enc)
    L = max(map(len, prompt_ids)) + n_new - 1
    C, dtype = base.config.n_embd, base.lm_head.weight.dtype
    h = torch.zeros(len(prompts), L, C, dtype=dtype)  # bf16 halves the memory
    f = torch.zeros(len(prompts), L, C * len(taps), dtype=dtype) if taps else None
    y = torch.full((len(prompts), L), -100, dtype=torch.long)
    seen, tapped = [], [[] for _ in taps or ()]
    hooks = [base.norm.register_forward_hook(lambda module, args, out: seen.append(out))]  # (B, T, C)
    hooks += tap_hooks(base, taps or (), tapped)
    try:
        for rows in tqdm(same_length_batches(prompt_ids, max_batch), desc="distill", dynamic_ncols=True):
            seen.clear()
            for t in tapped:
                t.clear()
            idx = torch.tensor([prompt_ids[i] for i in rows], device=device)   # (B, P)
            seq = generate(base, idx, n_new, temperature, stop_tokens=stops)    # (B, P+n), n <= n_new
            states = torch.cat(seen, dim=1).cpu()                               # (B, P, C), (B, 1, C)... -> (B, P+n-1, C)
            fused = torch.cat([torch.cat(t, dim=1) for t in tapped], dim=-1).cpu() if taps else states  # (B, P+n-1, 3C)
            P, n = idx.size(1), seq.size(1) - idx.size(1)
            for r, row, states_r, fused_r in zip(rows, seq.tolist(), states, fused):
                answer = row[P:]
                ends = [i for i, t in enumerate(answer) if t in stops]
                keep = P + (ends[0] + 1 if ends else n)                          # prompt + answer up to its stop token
                h[r, :keep - 1] = states_r[:keep - 1]
                y[r, :keep - 1] = torch.tensor(row[1:keep])
                if taps:
                    f[r, :keep - 1] = fused_r[:keep - 1]
    finally:
        for hook in hooks:
            hook.remove()
    start = torch.tensor([len(ids) - 1 for ids in prompt_ids])
    return (h, y, start) if not taps else (h, y, start, f)


@torch.no_grad()
def tapped_features(base, enc, prompts, y, taps, rows=16):
    """The residual stream entering the layers `taps` on the distilled texts (prompt + answer), for a distillation
    kept from before EAGLE-3 (one forward over them; a new distillation keeps them as it decodes): (N, L, 3C)."""
    device, dtype = base.lm_head.weight.device, base.lm_head.weight.dtype
    first = torch.tensor([smollm.chat_tokens(enc, p)[0] for p in prompts])           # each text's token 0
    f = torch.zeros(*y.shape, base.config.n_embd * len(taps), dtype=dtype)
    lengths = (y >= 0).sum(1)
    for i in tqdm(range(0, len(y), rows), desc="features", dynamic_ncols=True):
        n = int(lengths[i:i + rows].max())
        seq = torch.cat([first[i:i + rows, None], y[i:i + rows, :n - 1].clamp(min=0)], 1).to(device)  # (b, n)
        f[i:i + rows, :n] = base.hidden(seq, taps=taps)[1].to(dtype).cpu()          # (b, n, 3C): causal, so the
    return f.mul_((y >= 0)[..., None])                                               # padding's rows are ignored


def texts(h, y, start, first=0, keep=True):
    """The distilled answers as lab/tree_choice.py scores them: one (seq (1, n + 1), start, features) per answer,
    seq[0, t + 1] = y[t] and seq[0, 0] = first, each text's first token (the chat template's). The features are
    the kept final hidden states h (then seq[0, 0] is never read), or None (keep=False: a drafter that reads
    other layers, whose features one forward over the text gives: every position's depends on the first token)."""
    out = []
    for row in range(len(y)):
        n = int((y[row] >= 0).sum())                                          # positions with a next token
        seq = torch.cat([y.new_full((1,), first), y[row, :n]])               # (n + 1,)
        out.append((seq[None], int(start[row]), h[row, None, :n] if keep else None))
    return out


def stored_batches(h, y, device, features=None):
    """batches(seed, taps=None) -> batches(step) -> (h, y) (lab/train_drafters.py): random distilled answers,
    moved to the drafter's device; with taps, also their features there (the taps the distillation kept)."""
    def seeded(seed, taps=None):
        def batches(step):
            rows = torch.randint(0, len(h), (BATCH,), generator=step_generator(seed, step))
            picked = (to_device(h[rows], device), to_device(y[rows], device))
            return picked if taps is None else (*picked, to_device(features[rows], device))
        return batches
    return seeded


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
def feature_precision(kind, model, base, first, held, vocab, depth):
    """Where bf16 is native, the drafters train on a bf16 copy's features but draft from the features
    decoding computes. Their held-out top-1 by depth both ways, on the same answers: (fed the features
    of the model that decodes, fed the bf16 copy's features of the same text). first: every text's first token."""
    _, y, start = held
    low = copy.deepcopy(base).to(torch.bfloat16)
    f, f_low = (torch.zeros(*y.shape, feature_width(model)) for _ in range(2))  # (N, L, C), or 3C for EAGLE-3
    for row in range(len(y)):
        n = int((y[row] >= 0).sum())
        seq = torch.cat([y.new_full((1,), first), y[row, :n - 1]]).to(base.lm_head.weight.device)[None]  # (1, n)
        for m, out in ((base, f), (low, f_low)):
            out[row, :n] = base_features(model, seq, base=m)[0].float().cpu()
    dtype = model.base.lm_head.weight.dtype
    return [[a[0] for a in tree_choice.accuracies(kind, model, texts(x.to(dtype), y, start, first), depth, 1, vocab)]
            for x in (f, f_low)]


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


# ---------------------------------------------------------------------------------------- for the pipeline

def chat_prompts(enc, held_out, count):
    """count of the held-out instructions, spread over the list, as chat prompts (1-D token ids)."""
    return [torch.tensor(smollm.chat_tokens(enc, p)) for p in held_out[::max(1, len(held_out) // count)]][:count]


def held_out_prompts(run, enc, count, seed=5):
    """(count held-out chat prompts of a finished run, as its report decodes them; decoding's keyword arguments:
    an answer stops at its end). The held-out instructions are a fixed list: seed does not change them."""
    _, held_out = instruction_prompts(enc, run.seed)
    return [p.to(run.device) for p in chat_prompts(enc, held_out, count)], {"stop_tokens": smollm.stop_tokens(enc)}


def preset_of(run) -> str:
    return "smollm2"


def sample_text(enc, prompt, result) -> str:
    return enc.decode(result["sample"])


def make_run(given, out, kind):
    """The SmolRun train_heads.py's flags ask for; its runs go to a folder of their own in --out (OUT/smollm2/)."""
    return SmolRun(out=os.path.join(out, kind.folder), **given)


def upstream(run, distilled, taps=None):
    """What a drafter's stage rests on: (the settings of the stages it is made from, their files: the answers,
    and for a drafter that taps layers, their features there)."""
    return settings_for(run, {"base"}), ["distill.pt"] + (["taps.pt"] if taps else [])


def plan_stages(run, kinds) -> dict:
    """{file name: StageRecord (parents aside)} of the base's own stages this run would write: the distillation."""
    return {"distill.pt": StageRecord("distill", settings_for(run, {"base"}))}


def prepare(run, kind, kinds) -> Prepared:
    """The base from its wheel, the prompts and the model's own answers to them (reused where they can be), and
    what the drafters' stages, their trees and the report need of this base."""
    device = torch.device(run.device)
    fast = native_bf16(device)  # bf16 products are native here: a bf16 copy writes the training text
    reader = smollm.read_gguf()
    base, enc = smollm.load_smollm2(BLOCK_SIZE, reader).to(device), smollm.load_tokenizer(reader)
    base.requires_grad_(False)  # the drafters train on a frozen base
    train_prompts, held_out = instruction_prompts(enc, run.seed)
    print(f"SmolLM2-135M-Instruct on {device}, drafters {', '.join(run.drafters)}; prompts: {len(train_prompts)} for "
          f"training, {len(held_out)} held out (plays and topics)")

    # 2. distill: the prompts' digest is a parent, so that other prompts (code changed since) are distilled anew
    prompts_digest = hashlib.sha256("\0".join(train_prompts + ["--"] + held_out).encode()).hexdigest()
    info = BaseInfo(kind.name, {"block_size": BLOCK_SIZE})
    stage = Stage(run, "distill.pt", "distill", settings_for(run, {"base"}),
                  {"gguf": checkpoints.digest(smollm.gguf_path()), "prompts": prompts_digest}, {"base": info})
    t0 = time.time()
    taps = next((k.taps(base) for k in kinds if k.taps(base) is not None), None)  # EAGLE-3's layers, if it is asked
    features = None
    # Training data only, so a bf16 copy may write it (faster where bf16 is native); the held-out
    # answers, which the trees are grown from, come from the model that decodes.
    writer = copy.deepcopy(base).to(torch.bfloat16) if fast and (stage.finished is None or taps) else base
    if stage.finished is not None:
        train, held, held_sampled = stage.finished.train, stage.finished.held_out, stage.finished.held_out_sampled
        print(f"distill: reusing {stage.path}")
    else:
        written = distill(writer, enc, train_prompts, taps=taps)           # (h, y, start[, features at taps])
        train, features = written[:3], (written[3] if taps else None)
        held = distill(base, enc, held_out)
        held_sampled = tree_choice.sampled(lambda: distill(base, enc, held_out, temperature=tree_choice.SAMPLE_T),
                                           run.seed + 6)
        stage.save(True, train=train, held_out=held, held_out_sampled=held_sampled)
        print(f"distill: {len(train_prompts)} answers of the model's own ({train[0].dtype}), "
              f"{int((train[1] >= 0).sum()):,} positions with hidden states, in {time.time() - t0:.0f}s")
    h, y, _ = train
    if taps:  # the features at the layers EAGLE-3 reads: kept as the answers were written, or read again
        tapped = Stage(run, "taps.pt", "distill", {**settings_for(run, {"base"}), "taps": list(taps)},
                       checkpoints.parents_of(run.out, ["distill.pt"]), {"base": info})
        if tapped.finished is not None:
            features = tapped.finished.features
        else:
            if features is None:
                print(f"taps: the distilled answers' features at layers {list(taps)}, read again (one forward)")
                features = tapped_features(writer, enc, train_prompts, y, taps)
            tapped.save(True, features=features)
    del writer
    first = smollm.chat_tokens(enc, held_out[0])[0]  # every chat text's first token (<|im_start|>)
    vocab = y[y >= 0].unique()  # (V',): the tokens the answers use; the drafters are trained and draft over them
    stops = smollm.stop_tokens(enc)
    prompts = [p.to(device) for p in chat_prompts(enc, held_out, run.report_prompts)]

    def report_options(drafted):
        threads = best_threads(drafted[0].trees.costs) if run.threads is None else [run.threads]
        n = run.report_tokens
        return dict(threads=threads, decode_kwargs={"stop_tokens": stops}, ops=False, sweep=False, repeats=1,
                    peers={**peer_modes(device), **llama_cpp.peer_modes(drafted, enc)},
                    engine=lambda runs, modes, table: llama_cpp.side_by_side(runs, modes, table, drafted, prompts, n,
                                                                             stops))

    def finish(result, drafted, training):
        precision = {}
        for d in drafted:  # trained on a bf16 copy's features, drafting from fp32 ones: does it cost?
            if fast and d.model.base.lm_head.weight.dtype == torch.float32:
                precision[d.name] = dict(zip(("fp32", "bf16"), feature_precision(
                    d.kind, d.model, base, first, held, vocab.to(device), d.kind.depth(d.model, run))))
                print(f"{d.name}: held-out top-1 by depth fed the fp32 features decoding reads " +
                      " ".join(f"{a:.3f}" for a in precision[d.name]["fp32"]) + "; fed a bf16 copy's (as in training) "
                      + " ".join(f"{a:.3f}" for a in precision[d.name]["bf16"]))
        dtype = drafted[0].model.base.lm_head.weight.dtype
        name = str(dtype).removeprefix("torch.")
        curves = {name: forward_costs(drafted[0].model.base)}  # the decoding dtype's, and float32's beside it
        if dtype != torch.float32:
            curves["float32"] = forward_costs(base)
        for label, curve in curves.items():
            print(f"one forward on a 100-token cache, {label}: " + ", ".join(f"{n} tokens {ms:.0f} ms "
                                                                            f"({ms / curve[1]:.2f}x)" for n, ms in curve.items()))
        threads = result["threads"]
        result.update(model="SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)", device=str(device), dtype=name,
                      forward_ms=curves[name], forward_ms_by_dtype=curves, draft_vocab=len(vocab), preset="smollm2",
                      feature_precision=precision, sample=enc.decode(result["sample"]), training=training,
                      plain_step_ms=drafted[0].trees.costs[threads[-1]]["plain_step_ms"])
        return result

    return Prepared(
        base=base, enc=enc, common={"base": info, "tokenizer": {"kind": "smollm2"}, "run": as_dict(run)},
        data=TrainingData(stored_batches(h, y, device, features), vocab=vocab.to(device)),
        texts=lambda model: tuple(texts(*answers, first, keep=getattr(model, "taps", None) is None)
                                  for answers in (held, held_sampled)),
        step_prompt=prompts[0], report_prompts=prompts,
        tree_options=dict(max_tree=64, ranks=10, sizes=list(COST_SIZES), repeats=COST_REPEATS, n_new=COST_TOKENS),
        report_options=report_options, finish=finish)
