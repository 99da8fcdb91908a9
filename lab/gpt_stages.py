"""The tiny GPT's own stages, before its drafters (lab/pipeline.py runs them all for `python train_heads.py`):

  data      Shakespeare's plays (or a --data file), split into training and held-out text; a byte-level BPE
            trained on the training text (kept in --out) and the token ids (cached there).
  base      the GPT, pretrained on the training text (base.pt); with --mtp D, with D multi-token
            prediction modules (mtp.py), which then are the `mtp` drafter.
  distill   the base's own continuations of training prompts (distill.pt), which the drafters learn from.

Every stage prints what it measured. What the drafters train on, what their trees grow from and what the
report decodes go to the pipeline in a stage.Prepared.
"""
import os
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import dataclasses

from lab import checkpoints, data, drafters, folder, plan, report, timing, tree_choice
from lab.checkpoints import BaseInfo
from lab.cli import RunError, UsageError
from lab.config import as_dict, gpt_run, settings_for
from lab.timing import timed
from lab.stage import Prepared, Stage, StageRecord, retrained
from lab.train import autocast, corpus_batch, rows_batch, step_generator, stream_seed, train_loop, windows
from lab.train_drafters import TrainingData
from medusa_mini import GPT, GPTConfig, generate
from mtp import MTPModel, mtp_losses, mtp_weight

EVAL_PROMPT, EVAL_NEW = 32, 64  # held-out prompt and greedy continuation the accuracies are read on
DISTILL_PROMPT = plan.DISTILL_PROMPT


def random_prompts(ids, count, length, seed, device):
    """Prompts for generation: count windows of `length` tokens of ids, reproducible from seed."""
    return windows(ids, count, length, torch.Generator().manual_seed(seed)).to(device)


def generation_lengths(run):
    """The longest sequence (prompt + new tokens) each stage generates. The model's context is its
    training window (block_size = seq_len), so every position generation uses has been trained."""
    return {"distill": DISTILL_PROMPT + run.distill_len, "accuracies": EVAL_PROMPT + EVAL_NEW,
            "tree costs": timing.STEP_COST_PROMPT + timing.STEP_COST_TOKENS, "report": report.REPORT_PROMPT + run.report_tokens}


# ---------------------------------------------------------------------------------------- the run's settings

def make_run(given, out, kind):
    """The GPTRun train_heads.py's flags ask for ({field: value}, the flags given); a UsageError for what
    cannot be done."""
    kinds = [drafters.get(n) for n in given["drafters"]]
    with_base = [k.name for k in kinds if k.trained_with_base]
    if with_base and not given.get("mtp_modules"):
        raise UsageError(f"--drafters {','.join(given['drafters'])}: {', '.join(with_base)} drafts with modules "
                         f"trained with the base: add --mtp 1 (or more)")
    if given.get("mtp_lambda") is not None and not given.get("mtp_modules"):
        raise UsageError("--mtp-lambda weighs the MTP modules' loss: give --mtp D with it")
    if given.get("data") is not None and not os.path.isfile(given["data"]):
        raise UsageError(f"--data {given['data']}: " + ("a folder, not a text file" if os.path.isdir(given["data"])
                                                         else "no such file"))
    if given.get("mtp_modules"):  # another model than the plain base: a folder of its own
        out = os.path.join(out, f"mtp{given['mtp_modules']}")
    preset = given.pop("preset", "cpu" if given["device"].type == "cpu" else "gpu")
    run = gpt_run(preset, out=out, **given)
    too_long = {stage: n for stage, n in generation_lengths(run).items() if n > run.seq_len}
    if too_long:
        raise UsageError(f"{too_long} tokens would be generated, past the {run.seq_len} positions the model is "
                         f"trained on (--seq-len)")
    return run


# ---------------------------------------------------------------------------------------- what shapes each stage

def base_settings(run):
    """What shapes the base: its settings, a --data file by its digest (not its path)."""
    settings = settings_for(run, {"base"})
    if run.data:
        settings["data"] = "sha256:" + checkpoints.digest(run.data)
    return settings


def distill_settings(run):
    return {**base_settings(run), **settings_for(run, {"distill"})}


def upstream(run, distilled, taps=None):
    """What a drafter's stage rests on: (the settings of the stages it is made from, their files). Features at
    other layers (taps) come from the same forwards as the hidden states: no file of their own."""
    if distilled:
        return distill_settings(run), ["base.pt", "distill.pt"]
    return base_settings(run), ["base.pt"]


def plan_stages(run, kinds) -> dict:
    """{file name: StageRecord (parents aside)} of the base's own stages this run would write."""
    out = {"base.pt": StageRecord("base", base_settings(run))}
    if any(kind.distilled(run) for kind in kinds):
        out["distill.pt"] = StageRecord("distill", distill_settings(run))
    return out


def run_record(run) -> dict:
    """The run as checkpoints keep it: what a command reopening the folder (benchmark.py, the notebooks)
    rebuilds the run's settings from."""
    return {k: v for k, v in as_dict(run).items() if k not in ("out", "device", "resume", "retrain", "retree")}


# ---------------------------------------------------------------------------------------- data

def texts_of(run):
    """(training text, held-out text, where they came from): Shakespeare's plays split by run.seed, or a --data file."""
    if run.data:
        text = data.read_text_file(run.data)
        train_text, val_text = data.split_text(text)
        source = {"data": os.path.abspath(run.data), "sha256": checkpoints.digest(run.data)}
    else:
        plays = data.load_plays()
        train_names, val_names = data.split_plays(plays, n_val=run.val_plays, seed=run.seed)
        train_text = "".join(plays[n] for n in train_names)
        val_text = "".join(plays[n] for n in val_names)
        source = {"train_plays": train_names, "val_plays": val_names}
    return train_text, val_text, source


def held_out_ids(run, enc):
    """The held-out token ids of a finished run, read from its cache or encoded again (nothing written)."""
    _, val_text, _ = texts_of(run)
    return data.encode_cached(enc, val_text, os.path.join(run.out, "val_ids.npy"), write=False)


def prepare_data(run):
    """(tokenizer, its checkpoint entry, {its file: digest} or {}, training ids, held-out ids). The BPE
    is trained on the training text once and kept in --out; token ids are cached there."""
    train_text, val_text, source = texts_of(run)
    if run.tokenizer == "gpt2":
        try:
            enc = data.get_gpt2_encoding()
        except RuntimeError as e:
            raise RunError(str(e)) from None
        entry, parents = {"kind": "gpt2"}, {}
    else:
        path = os.path.join(run.out, f"bpe{run.vocab_size}.tiktoken")
        key = os.path.join(run.out, f"bpe{run.vocab_size}.source.json")
        if not (os.path.exists(path) and data.read_json(key) == source):
            t0 = time.time()
            try:
                ranks = data.train_bpe(train_text, run.vocab_size)
            except ValueError as e:  # a --data text too small for --vocab-size
                raise UsageError(f"--vocab-size {run.vocab_size}: {e}") from None
            data.save_bpe(ranks, path)
            folder.write_json(key, source)
            print(f"trained a {run.vocab_size}-token BPE in {time.time() - t0:.1f}s -> {path}")
        try:
            enc = data.load_bpe(path)
        except ValueError as e:
            raise RunError(f"{path} is damaged ({e}): delete it and {key} (the run trains it again), or use "
                           f"another --out") from None
        entry = checkpoints.tokenizer_entry(path)
        parents = {os.path.basename(path): entry["sha256"]}
        base = os.path.join(run.out, "base.pt")
        if os.path.exists(base) and "base" not in retrained(run):  # before the token caches are written anew
            held = (checkpoints.load(base).stage or StageRecord("base")).parents.get(os.path.basename(path))
            if held is not None and held != entry["sha256"]:
                raise RunError(f"{path} is not the tokenizer {base} was trained with (its digest differs): put the "
                               f"run's own file back, or --retrain base, or use another --out")
    train_ids = data.encode_cached(enc, train_text, os.path.join(run.out, "train_ids.npy"))
    val_ids = data.encode_cached(enc, val_text, os.path.join(run.out, "val_ids.npy"))
    if min(len(train_ids), len(val_ids)) <= run.seq_len + 1:
        raise UsageError(f"the text is too short: {len(train_ids)} training and {len(val_ids)} held-out tokens, "
                         f"but one training window is {run.seq_len + 1} tokens (--seq-len)")
    print(f"data: {len(train_ids):,} training tokens, {len(val_ids):,} held-out tokens" +
          (f" ({len(source['val_plays'])} plays held out: {', '.join(source['val_plays'])})" if "val_plays" in source else ""))
    return enc, entry, parents, train_ids, val_ids


# ---------------------------------------------------------------------------------------- the base

@torch.no_grad()
def estimate_loss(model: GPT, ids, run, device, batches=8):
    g = torch.Generator().manual_seed(1234)
    model.eval()
    losses = []
    for _ in range(batches):
        x, y = corpus_batch(ids, run.batch_size, run.seq_len, g, device)
        with autocast(device):
            losses.append(float(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())))
    return sum(losses) / len(losses)


@torch.no_grad()
def loss_by_half(model: GPT, ids, device, batches=4, skip=8):
    """Mean next-token loss on held-out windows as long as the context, over positions skip..T/2-1
    and T/2..T-1. With every position trained the second half is no worse: it has more context."""
    T = model.config.block_size
    g = torch.Generator().manual_seed(4321)
    model.eval()
    sums = torch.zeros(2)
    for _ in range(batches):
        x, y = corpus_batch(ids, 16, T, g, device)
        with autocast(device):
            loss = F.cross_entropy(model(x).float().transpose(1, 2), y, reduction="none")  # (B, T)
        sums += torch.stack([loss[:, skip:T // 2].mean(), loss[:, T // 2:].mean()]).cpu()
    return (sums / batches).tolist()


def stage_base(run, config, common, parents, train_ids, val_ids, name="gpt"):
    """Stage 1: pretrain the GPT, or reuse base.pt. With run.mtp_modules = D, the GPT trains with D multi-token
    prediction modules (mtp.py): loss = main + lambda / D x the modules' losses. Returns (the GPT, its
    metrics, the model trained: the GPT, or the MTPModel holding it and its modules)."""
    device, D = run.device, run.mtp_modules
    gpt = GPT(config).to(device)
    model = MTPModel(gpt, D).to(device) if D else gpt
    stage = Stage(run, "base.pt", "base", base_settings(run), parents,
                  dict(common, base=BaseInfo(name, dataclasses.asdict(config), D)))
    if stage.ckpt is not None:
        model.load_state_dict(stage.ckpt.model)
    if stage.finished:
        print(f"base: reusing {stage.path} (val loss {stage.finished.metrics['val_loss']:.3f})")
        return gpt.eval(), stage.finished.metrics, model.eval()
    print(f"base: {sum(p.numel() for p in gpt.parameters()) / 1e6:.2f}M parameters, {run.base_steps} steps"
          + (f", {D} MTP module{'s' * (D > 1)} ({sum(p.numel() for p in model.mtp.parameters()) / 1e6:.2f}M)"
             if D else ""))
    model.train()
    seed = stream_seed(run.seed, "base")

    def loss_fn(step):
        x, y = corpus_batch(train_ids, run.batch_size, run.seq_len, step_generator(seed, step), device)
        with autocast(device):
            if not D:
                return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()), {}
            h = gpt.hidden(x)                                                     # (B, T, C)
            main = F.cross_entropy(gpt.lm_head(h).flatten(0, 1).float(), y.flatten())
            modules = mtp_losses(model, h, torch.cat([x, y[:, -1:]], 1))          # (D,)
        weight = mtp_weight(step, run.base_steps, run.mtp_lambda)
        return main + weight / D * modules.sum(), {"main": main, "modules": modules.mean()}

    t0 = time.time()
    history, opt = train_loop("base", [(list(model.parameters()), 1.0)], loss_fn, run.base_steps, run.base_lr,
                              stage.saver(model.state_dict), stage.resume_from, run.weight_decay)
    metrics = {"val_loss": estimate_loss(gpt, val_ids, run, device), "seconds": time.time() - t0,
               "history": history, "val_loss_halves": loss_by_half(gpt, val_ids, device), "mtp_modules": D}
    if not torch.isfinite(torch.tensor(metrics["val_loss"])):
        raise RunError(f"base: the held-out loss is {metrics['val_loss']} after {run.base_steps} steps at --base-lr "
                       f"{run.base_lr:g}: training diverged; nothing was saved as finished (try a smaller --base-lr)")
    metrics["step_seconds"] = metrics["seconds"] / max(1, run.base_steps - (stage.resume_from.step if stage.resume_from
                                                                            else 0))
    stage.save(True, model=model.state_dict(), step=run.base_steps, optimizer=opt.state_dict(), history=history,
               metrics=metrics)
    first, second = metrics["val_loss_halves"]
    print(f"base: val loss {metrics['val_loss']:.3f} after {metrics['seconds']:.0f}s -> {stage.path}\n"
          f"base: held-out loss {first:.3f} over positions 8-{run.seq_len // 2 - 1}, "
          f"{second:.3f} over {run.seq_len // 2}-{run.seq_len - 1}")
    return gpt.eval(), metrics, model.eval()


def distill_text(run, base, train_ids, common):
    """Self-distillation data: the base model's own continuations of training prompts, a fraction
    run.distill_sampled of them sampled at T = 0.7 and the rest greedy. Kept in distill.pt."""
    stage = Stage(run, "distill.pt", "distill", distill_settings(run), checkpoints.parents_of(run.out, ["base.pt"]),
                  common)
    if stage.finished:
        return stage.finished.tokens
    t0, device = time.time(), run.device
    torch.manual_seed(stream_seed(run.seed, "distill"))
    prompts = random_prompts(train_ids, run.distill_prompts, DISTILL_PROMPT, run.seed + 1, device)
    n_sampled = round(run.distill_sampled * len(prompts))
    bs = plan.generation_batch_size(base.config, DISTILL_PROMPT + run.distill_len, device)
    chunks = []
    for temperature, part in ((0.0, prompts[n_sampled:]), (0.7, prompts[:n_sampled])):
        for i in tqdm(range(0, len(part), bs), desc=f"distill T={temperature}", dynamic_ncols=True):
            chunks.append(generate(base, part[i:i + bs], run.distill_len, temperature).cpu())
    tokens = torch.cat(chunks)
    stage.save(True, tokens=tokens)
    print(f"distill: {tokens.numel():,} tokens of the model's own text ({n_sampled} of {len(prompts)} "
          f"continuations sampled at T=0.7, the rest greedy; {bs} rows at a time) in {time.time() - t0:.0f}s")
    return tokens


def feature_batches(base, run, text=None, train_ids=None):
    """batches(seed, taps=None) -> batches(step) -> (h, y): the frozen base's hidden states on random rows of the
    self-distilled text (or, without it, windows of the corpus), and the next tokens; with taps, also the
    residual stream entering those layers (from the same forward): (h, y, features)."""
    def seeded(seed, taps=None):
        def batches(step):
            g = step_generator(seed, step)
            if text is not None:
                x, y = rows_batch(text, run.batch_size, g, run.device)
            else:
                x, y = corpus_batch(train_ids, run.batch_size, run.seq_len, g, run.device)
            with torch.no_grad(), autocast(run.device):
                out = base.hidden(x, taps=taps)                               # (B, T, C) [, (B, T, 3C)]: frozen
            return (out, y) if taps is None else (out[0], y, out[1])
        return batches
    return seeded


def mtp_step_ratio(run, config, device, repeats=5):
    """How much longer a training step of the base takes with run.mtp_modules MTP modules than without them:
    whole steps (forward, backward and AdamW's update) on throwaway models and a random batch, the two
    alternated, each side's fastest (the least disturbed by other work on the machine). At least 1."""
    plain = GPT(config).to(device)
    model = MTPModel(GPT(config), run.mtp_modules).to(device)
    opts = {False: torch.optim.AdamW(plain.parameters(), lr=run.base_lr),
            True: torch.optim.AdamW(model.parameters(), lr=run.base_lr)}
    x = torch.randint(config.vocab_size, (run.batch_size, run.seq_len + 1), device=device)  # (B, T + 1)
    times = {False: [], True: []}

    def step(with_modules):
        gpt = model.base if with_modules else plain
        with autocast(device):
            h = gpt.hidden(x[:, :-1])
            loss = F.cross_entropy(gpt.lm_head(h).flatten(0, 1).float(), x[:, 1:].flatten())
            if with_modules:
                loss = loss + mtp_losses(model, h, x).sum()
        loss.backward()
        opts[with_modules].step()
        opts[with_modules].zero_grad(set_to_none=True)

    for _ in range(repeats + 1):
        for with_modules in (False, True):
            times[with_modules].append(timed(lambda: step(with_modules), device)[0])
    return max(1.0, min(times[True][1:]) / min(times[False][1:]))  # the first: warm-up


@torch.no_grad()
def base_quality(base, val_ids, run, device, prompts, n_new=None):
    """What a base model is worth on held-out text: the main head's loss (estimate_loss's batches) and how
    repetitive its greedy text is (distinct 4-grams of n_new tokens from each prompt; 1.0: no repeats)."""
    out = generate(base, prompts, n_new or run.report_tokens)[:, prompts.size(1):]
    return {"val_loss": estimate_loss(base, val_ids, run, device),
            "distinct_4gram": statistics.fmean(timing.distinct_4gram_ratio(row) for row in out.tolist())}


# ---------------------------------------------------------------------------------------- for the pipeline

def held_out_prompts(run, enc, count, seed=5):
    """(count held-out prompts of a finished run, 1-D token ids, as its report decodes them; decoding's keyword
    arguments: none). seed: which draw of windows (the report's 5; benchmark.py --ceiling's 7)."""
    return list(random_prompts(held_out_ids(run, enc), count, report.REPORT_PROMPT, run.seed + seed, run.device)), {}


def preset_of(run) -> str:
    return run.preset


def sample_text(enc, prompt, result) -> str:
    """The report's sample: the prompt's text, then what the chosen tree wrote."""
    return enc.decode(prompt.tolist()) + "[...]" + enc.decode(result["sample"])


def prepare(run, kind, kinds) -> Prepared:
    """The data, the base and its distilled text (each stage reused where it can be), and what the drafters'
    stages, their trees and the report need of this base."""
    device = run.device
    print(f"medusa-mini: preset {run.preset} on {device} ({torch.get_num_threads()} CPU threads), "
          f"drafters {', '.join(run.drafters)}, out {run.out}/")
    planned = GPTConfig(vocab_size=run.vocab_size if run.tokenizer == "bpe" else data.GPT2_VOCAB,
                        block_size=run.seq_len, n_layer=run.n_layer, n_head=run.n_head, n_embd=run.n_embd)
    plan.print_plan(run, planned, device)  # before anything is written: a run that cannot fit or finish is refused
    enc, tokenizer, parents, train_ids, val_ids = prepare_data(run)
    config = dataclasses.replace(planned, vocab_size=enc.n_vocab)  # every position trained: block_size = seq_len
    common = {"tokenizer": tokenizer, "run": run_record(run)}
    torch.manual_seed(run.seed)
    base, base_metrics, base_model = stage_base(run, config, common, parents, train_ids, val_ids, kind.name)
    text = distill_text(run, base, train_ids, common) if any(k.distilled(run) for k in kinds) else None
    eval_prompts = random_prompts(val_ids, run.eval_prompts, EVAL_PROMPT, run.seed + 4, device)

    def texts(model):  # the drafter's base (Medusa-2 changes it) writes the text its trees grow from
        greedy = generate(model.base, eval_prompts, EVAL_NEW)
        sampled = tree_choice.sampled(lambda: generate(model.base, eval_prompts, EVAL_NEW, tree_choice.SAMPLE_T),
                                      run.seed + 6)
        return [(greedy, EVAL_PROMPT - 1, None)], [(sampled, EVAL_PROMPT - 1, None)]

    def with_base(drafter):  # MTP's modules: trained with the base, about this share of its training time
        seconds = base_metrics["seconds"] * (1 - 1 / mtp_step_ratio(run, base.config, device))
        print(f"{drafter.name}: trained with the base, {seconds:.0f}s of the base's training")
        return base_model, {"seconds": seconds}, BaseInfo(kind.name, dataclasses.asdict(config), run.mtp_modules)

    def report_options(drafted):
        return dict(threads=timing.thread_counts(device, run.threads), repeats=run.timing_rounds or report.REPORT_REPEATS,
                    sweep_repeats=run.timing_rounds or report.SWEEP_REPEATS)

    def finish(result, drafted, training):
        result.update(preset=run.preset, device=str(device), training={"base": base_metrics, **training},
                      sample=sample_text(enc, prompts[0], result))
        return result

    prompts = random_prompts(val_ids, run.report_prompts, report.REPORT_PROMPT, run.seed + 5, device)
    return Prepared(
        base=base, enc=enc, common={**common, "base": BaseInfo(kind.name, dataclasses.asdict(config), 0)},
        data=TrainingData(feature_batches(base, run, text, train_ids), text=text, base_loss=base_metrics["val_loss"]),
        texts=texts,
        step_prompt=torch.as_tensor(val_ids[:timing.STEP_COST_PROMPT].astype("int64"), device=device),
        report_prompts=list(prompts), tree_options=dict(max_tree=run.max_tree, ranks=run.rank_depth,
                                                        repeats=run.timing_rounds or timing.STEP_COST_REPEATS),
        report_options=report_options, finish=finish, with_base=with_base,
        base_loss=lambda model_base: estimate_loss(model_base, val_ids, run, device))
