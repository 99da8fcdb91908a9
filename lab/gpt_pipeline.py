"""The tiny GPT's pipeline, stage by stage, for `python train_heads.py`.

Stages: data and tokenizer -> base model (base.pt; with --mtp D, trained with D MTP modules) ->
self-distilled text (distill.pt) -> each drafter (NAME.pt: Medusa-1 heads, optionally Medusa-2; an
EAGLE layer; MTP's modules, trained with the base) -> each drafter's trees, chosen for this device ->
the report (lab/report.py). Every stage prints what it measured. A finished stage is reused, an
interrupted one continued with --resume, and one made for other settings refused (lab/checkpoints.py).
The notebooks open the finished run through trained_model().
"""
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lab import checkpoints, data, drafters, folder, plan, report, timing, trees
from lab.checkpoints import record
from lab.cli import RunError, UsageError
from lab.config import gpt_run, settings_for
from lab.devices import DTYPES, decoding_copy, draft_cheaply
from lab.train import autocast, corpus_batch, rows_batch, step_generator, stream_seed, train_loop, windows
from medusa_mini import GPT, GPTConfig, generate, medusa_loss
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
            "tree costs": timing.STEP_COST_PROMPT + timing.STEP_COST_TOKENS,
            "report": report.REPORT_PROMPT + run.report_tokens}


# ---------------------------------------------------------------------------------------- the stages' records

def base_settings(run):
    """What shapes the base: its settings, a --data file by its digest (not its path)."""
    settings = settings_for(run, {"base"})
    if run.data:
        settings["data"] = "sha256:" + checkpoints.digest(run.data)
    return settings


def drafter_settings(kind, run):
    """What shapes a drafter's weights: the base's settings, the distillation's if it learns from it, its own."""
    own = {f: getattr(run, f) for f in kind.settings if hasattr(run, f)}
    return {**(distill_settings(run) if kind.distilled(run) else base_settings(run)), **own}


def distill_settings(run):
    return {**base_settings(run), **settings_for(run, {"distill"})}


def records(run) -> dict:
    """{file name: what its stage's checkpoint must say it was made for}, parents aside: for the preflight."""
    out = {"base.pt": record("base", base_settings(run), {})}
    if any(drafters.get(n).distilled(run) for n in run.drafters):
        out["distill.pt"] = record("distill", distill_settings(run), {})
    for name in run.drafters:
        kind = drafters.get(name)
        settings = drafter_settings(kind, run)
        if run.joint and "joint" in kind.settings:  # Medusa-1 first (medusa1.pt), then Medusa-2 (NAME.pt)
            out[f"{name}1.pt"] = record(name, {k: v for k, v in settings.items() if not k.startswith("joint")}, {})
        out[f"{name}.pt"] = record(name, settings, {})
    return out


def retrained(run) -> set:
    """The stages --retrain allows to train again: those named, and every stage trained on one of them."""
    named = set(run.retrain)
    if "base" in named:
        named |= {"distill", *run.drafters}
    if "distill" in named:
        named |= {n for n in run.drafters if drafters.get(n).distilled(run)}
    return named


class Stage:
    """One stage's checkpoint: what it was made for, whether it can be reused or continued, and its saving."""

    def __init__(self, run, file, name, settings, parents, common):
        self.path = os.path.join(run.out, file)
        self.asked = record(name, settings, parents)
        self.common = common  # what every checkpoint of the stage holds: base, drafter, tokenizer, run
        self.ckpt = checkpoints.check_stage(self.path, self.asked, run.resume, name in retrained(run), run.device)

    @property
    def finished(self):
        return self.ckpt if self.ckpt is not None and self.ckpt.get("done") else None

    @property
    def resume_from(self):
        return self.ckpt if self.ckpt is not None and not self.ckpt.get("done") else None

    def save(self, model, done, step=None, opt=None, history=None, **more):
        checkpoints.save(self.path, stage=self.asked, done=done, model=model.state_dict(), step=step,
                         optimizer=None if opt is None else opt.state_dict(), history=history, **self.common, **more)
        if not done:
            print(f"saved {self.path}; run again with --resume to continue")


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
        enc = data.load_bpe(path)
        entry = checkpoints.tokenizer_entry(path)
        parents = {os.path.basename(path): entry["sha256"]}
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


def stage_base(run, config, common, parents, train_ids, val_ids):
    """Stage 1: pretrain the GPT, or reuse base.pt. With run.mtp_modules = D, the GPT trains with D multi-token
    prediction modules (mtp.py): loss = main + lambda / D x the modules' losses. Returns (the GPT, its
    metrics, the model trained: the GPT, or the MTPModel holding it and its modules)."""
    device, D = run.device, run.mtp_modules
    gpt = GPT(config).to(device)
    model = MTPModel(gpt, D).to(device) if D else gpt
    stage = Stage(run, "base.pt", "base", base_settings(run), parents,
                  dict(common, base=checkpoints.gpt_base_entry(config, D), drafter=None))
    if stage.ckpt is not None:
        model.load_state_dict(stage.ckpt["model"])
    if stage.finished:
        print(f"base: reusing {stage.path} (val loss {stage.finished['metrics']['val_loss']:.3f})")
        return gpt.eval(), stage.finished["metrics"], model.eval()
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
                              lambda step, opt, history, done: stage.save(model, done, step, opt, history),
                              stage.resume_from, run.weight_decay)
    metrics = {"val_loss": estimate_loss(gpt, val_ids, run, device), "seconds": time.time() - t0,
               "history": history, "val_loss_halves": loss_by_half(gpt, val_ids, device), "mtp_modules": D}
    if not torch.isfinite(torch.tensor(metrics["val_loss"])):
        raise RunError(f"base: the held-out loss is {metrics['val_loss']} after {run.base_steps} steps at --base-lr "
                       f"{run.base_lr:g}: training diverged; nothing was saved as finished (try a smaller --base-lr)")
    metrics["step_seconds"] = metrics["seconds"] / max(1, run.base_steps - (stage.resume_from or {}).get("step", 0))
    stage.save(model, True, run.base_steps, opt, history, metrics=metrics)
    first, second = metrics["val_loss_halves"]
    print(f"base: val loss {metrics['val_loss']:.3f} after {metrics['seconds']:.0f}s -> {stage.path}\n"
          f"base: held-out loss {first:.3f} over positions 8-{run.seq_len // 2 - 1}, "
          f"{second:.3f} over {run.seq_len // 2}-{run.seq_len - 1}")
    return gpt.eval(), metrics, model.eval()


def distill_text(run, base, train_ids, common):
    """Self-distillation data: the base model's own continuations of training prompts, a fraction
    run.distill_sampled of them sampled at T = 0.7 and the rest greedy. Kept in distill.pt."""
    stage = Stage(run, "distill.pt", "distill", distill_settings(run),
                  checkpoints.parents_of(run.out, ["base.pt"]), dict(common, base=None, drafter=None))
    if stage.finished:
        return stage.finished["tokens"]
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
    checkpoints.save(stage.path, stage=stage.asked, done=True, tokens=tokens, **stage.common)
    print(f"distill: {tokens.numel():,} tokens of the model's own text ({n_sampled} of {len(prompts)} "
          f"continuations sampled at T=0.7, the rest greedy; {bs} rows at a time) in {time.time() - t0:.0f}s")
    return tokens


# ---------------------------------------------------------------------------------------- the drafters

def feature_batches(base, run, seed, text=None, train_ids=None):
    """batches(step) -> (h, y) for lab/stages.py: the frozen base's hidden states on random rows of the
    self-distilled text (or, without it, windows of the corpus), and the next tokens."""
    def batches(step):
        g = step_generator(seed, step)
        if text is not None:
            x, y = rows_batch(text, run.batch_size, g, run.device)
        else:
            x, y = corpus_batch(train_ids, run.batch_size, run.seq_len, g, run.device)
        with torch.no_grad(), autocast(run.device):
            h = base.hidden(x)                                                # (B, T, C): frozen, no graph
        return h, y
    return batches


def stage_drafter(kind, run, base, base_model, text, train_ids, common, base_metrics):
    """A drafter trained on the frozen base (kind.train), or, for one the base trained with itself
    (kind.train None: MTP's modules), the base stage's model; saved as NAME.pt (with --joint, Medusa-1's
    heads as NAME1.pt first, then Medusa-2). Returns (model, training metrics)."""
    settings = drafter_settings(kind, run)
    uses_text = kind.distilled(run)
    parents = checkpoints.parents_of(run.out, ["base.pt"] + (["distill.pt"] if uses_text else []))
    entry = dict(common, base=checkpoints.gpt_base_entry(base.config, run.mtp_modules if kind.train is None else 0),
                 drafter={"kind": kind.name, "config": kind.config(run)})
    joint = run.joint and "joint" in kind.settings
    first = Stage(run, f"{kind.name}1.pt" if joint else f"{kind.name}.pt", kind.name,
                  {k: v for k, v in settings.items() if not (joint and k.startswith("joint"))}, parents, entry)
    if kind.train is None:  # trained with the base: its checkpoint is that model's
        model = base_model
        seconds = base_metrics["seconds"] * (1 - 1 / mtp_step_ratio(run, base.config, run.device))
        metrics = {"seconds": seconds, "parameters": report.parameters(model)}
        print(f"{kind.name}: trained with the base, {metrics['parameters'] / 1e6:.2f}M parameters, about "
              f"{seconds:.0f}s of the base's training")
        first.save(model, True, metrics=metrics)
        return model.eval(), metrics
    model = kind.model(base, **kind.config(run)).to(run.device)
    if first.ckpt is not None:
        model.load_state_dict(first.ckpt["model"])
    if first.finished:
        print(f"{kind.name}: reusing {first.path}")
        metrics = first.finished["metrics"]
    else:
        batches = feature_batches(base, run, stream_seed(run.seed, kind.name), text if uses_text else None, train_ids)
        t0 = time.time()
        history = kind.train(model, batches, run,
                             lambda step, opt, history, done: first.save(model, done, step, opt, history),
                             first.resume_from)
        metrics = {"history": history, "seconds": time.time() - t0, "parameters": report.parameters(model)}
        first.save(model, True, metrics=metrics)
        print(f"{kind.name}: {metrics['parameters'] / 1e6:.2f}M parameters trained in {metrics['seconds']:.0f}s")
    if joint:
        second = Stage(run, f"{kind.name}.pt", kind.name, settings,
                       checkpoints.parents_of(run.out, [os.path.basename(first.path)]), entry)
        if second.ckpt is not None:
            model.load_state_dict(second.ckpt["model"])
        if second.finished:
            print(f"{kind.name}: reusing {second.path} (Medusa-2)")
            metrics = second.finished["metrics"]
        else:
            metrics = dict(metrics, joint=train_joint(run, model, text, second, base_metrics["val_loss"]))
            second.save(model, True, metrics=metrics)
    return model.eval(), metrics


JOINT_HEADS_WEIGHT = 0.2    # lambda_0, as in the Medusa authors' stage-2 config (axolotl
#                             examples/medusa/vicuna_7b_qlora_stage2.yml: medusa_heads_coefficient 0.2)
JOINT_HEADS_LR_MULT = 300.0  # heads' lr over the backbone's. The authors use 4 on a 7B model; this small
#                             backbone is kept nearly still (docs/results.md has the Medusa-2 run)


def train_joint(run, model, text, stage, val_before):
    """Medusa-2, self-distilled: backbone and heads together on the model's own text, after the heads-only
    stage (Medusa-1, the warm-up, kept in its own checkpoint). The base loss is KL(original || model) to
    a frozen copy of the original base, so the model keeps its distribution; plus 0.2 x the Medusa-1
    loss, heads at half the Medusa-1 lr, the backbone at 1/300 of that. Resumable like every stage.
    Returns its history and the base's held-out loss before and after."""
    device = run.device
    original = copy.deepcopy(model.base).eval().requires_grad_(False)
    model.base.requires_grad_(True)
    model.train()
    seed = stream_seed(run.seed, "joint")

    def loss_fn(step):
        x, y = rows_batch(text, run.batch_size, step_generator(seed, step), device)
        with torch.no_grad(), autocast(device):
            target = F.log_softmax(original(x).float(), -1)                             # (B, T, V)
        with autocast(device):
            base_logits, head_logits = model(x)
            kl = F.kl_div(F.log_softmax(base_logits.float(), -1), target, log_target=True,
                          reduction="none").sum(-1).mean()                               # KL(original || model)
            medusa, _ = medusa_loss(head_logits.float(), y)
        return kl + JOINT_HEADS_WEIGHT * medusa, {"kl": kl}

    head_params = [p for head in model.heads for p in head.parameters()]
    t0 = time.time()
    history, _ = train_loop("joint", [(list(model.base.parameters()), 1.0), (head_params, JOINT_HEADS_LR_MULT)],
                            loss_fn, run.joint_steps, run.head_lr / 2 / JOINT_HEADS_LR_MULT,
                            lambda step, opt, history, done: stage.save(model, done, step, opt, history),
                            stage.resume_from)
    model.eval().base.requires_grad_(False)
    return {"history": history, "seconds": time.time() - t0, "val_loss_before": val_before}


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
    for _ in range(repeats + 1):
        for with_modules in (False, True):
            gpt = model.base if with_modules else plain
            t0 = time.time()
            with autocast(device):
                h = gpt.hidden(x[:, :-1])
                loss = F.cross_entropy(gpt.lm_head(h).flatten(0, 1).float(), x[:, 1:].flatten())
                if with_modules:
                    loss = loss + mtp_losses(model, h, x).sum()
            loss.backward()
            opts[with_modules].step()
            opts[with_modules].zero_grad(set_to_none=True)
            times[with_modules].append(time.time() - t0)
    return max(1.0, min(times[True][1:]) / min(times[False][1:]))  # the first: warm-up


@torch.no_grad()
def base_quality(base, val_ids, run, device, prompts, n_new=None):
    """What a base model is worth on held-out text: the main head's loss (estimate_loss's batches) and how
    repetitive its greedy text is (distinct 4-grams of n_new tokens from each prompt; 1.0: no repeats)."""
    out = generate(base, prompts, n_new or run.report_tokens)[:, prompts.size(1):]
    return {"val_loss": estimate_loss(base, val_ids, run, device),
            "distinct_4gram": statistics.fmean(timing.distinct_4gram_ratio(row) for row in out.tolist())}


# ---------------------------------------------------------------------------------------- the trees

def choose_trees(kind, model, run, val_ids, eval_prompts):
    """A drafter's trees for this device (lab/trees.py), from held-out greedy and sampled text."""
    greedy = generate(model.base, eval_prompts, EVAL_NEW)
    sampled = trees.sampled(lambda: generate(model.base, eval_prompts, EVAL_NEW, trees.SAMPLE_T), run.seed + 6)
    prompt = torch.as_tensor(val_ids[:timing.STEP_COST_PROMPT].astype("int64"), device=run.device)
    return trees.choose(kind, model, run, [(greedy, EVAL_PROMPT - 1, None)], [(sampled, EVAL_PROMPT - 1, None)],
                        prompt, run.device, run.max_tree, run.rank_depth,
                        repeats=run.timing_rounds or timing.STEP_COST_REPEATS, threads=run.threads)


# ---------------------------------------------------------------------------------------- the run

def run(run):
    """The whole pipeline for the tiny GPT, as train_heads.py's flags (a GPTRun) ask; returns the report."""
    with folder.locked(run.out):
        return _run(run)


def _run(run):
    checkpoints.preflight(run.out, records(run), retrained(run))  # a refused run writes nothing
    torch.manual_seed(run.seed)
    if run.threads:
        torch.set_num_threads(run.threads)
    print(f"medusa-mini: preset {run.preset} on {run.device} ({torch.get_num_threads()} CPU threads), "
          f"drafters {', '.join(run.drafters)}, out {run.out}/")
    t0, device = time.time(), run.device
    enc, tokenizer, parents, train_ids, val_ids = prepare_data(run)
    config = GPTConfig(vocab_size=enc.n_vocab, block_size=run.seq_len, n_layer=run.n_layer,  # every position trained
                       n_head=run.n_head, n_embd=run.n_embd)
    plan.print_plan(run, config, device)
    common = {"tokenizer": tokenizer, "run": run_record(run)}
    torch.manual_seed(run.seed)
    base, base_metrics, base_model = stage_base(run, config, common, parents, train_ids, val_ids)
    kinds = [drafters.get(name) for name in run.drafters]
    text = distill_text(run, base, train_ids, common) if any(k.distilled(run) for k in kinds) else None
    training, drafted = {"base": base_metrics}, []
    trained, dtype = {}, DTYPES[run.dtype]
    for kind in kinds:
        trained[kind.name], training[kind.name] = stage_drafter(kind, run, base, base_model, text, train_ids, common,
                                                                base_metrics)
    eval_prompts = random_prompts(val_ids, run.eval_prompts, EVAL_PROMPT, run.seed + 4, device)
    for kind in kinds:  # decoding in run.dtype; drafting in the dtype draft_cheaply picks (the tiny GPT: float32)
        model = draft_cheaply(decoding_copy(trained[kind.name], dtype), device, "gpt")
        chosen = choose_trees(kind, model, run, val_ids, eval_prompts)
        trees.keep(os.path.join(run.out, f"{kind.name}.pt"), chosen, run.dtype)
        drafted.append(report.Drafted(kind, model, chosen, {"seconds": training[kind.name]["seconds"],
                                                            "parameters": report.parameters(model)}))
    joint = next((m.get("joint") for m in training.values() if isinstance(m, dict) and m.get("joint")), None)
    if joint:
        joint["val_loss_after"] = estimate_loss(trained[kinds[0].name].base, val_ids, run, device)
        training["joint"] = joint
    prompts = random_prompts(val_ids, run.report_prompts, report.REPORT_PROMPT, run.seed + 5, device)
    reference = None if dtype == torch.float32 else trained[kinds[0].name].base  # the float32 model
    result = report.run_report(drafted, prompts, run.report_tokens, timing.thread_counts(device, run.threads),
                               repeats=run.timing_rounds or report.REPORT_REPEATS,
                               sweep_repeats=run.timing_rounds or report.SWEEP_REPEATS, reference=reference)
    result.update(preset=run.preset, device=str(device), training=training, total_seconds=time.time() - t0,
                  sample=enc.decode(prompts[0].tolist()) + "[...]" + enc.decode(result["sample"]))
    report.write_report(result, run.out)
    return result


def run_record(run) -> dict:
    """The run as checkpoints keep it: what a command reopening the folder (benchmark.py, the notebooks)
    rebuilds the run's settings from."""
    from lab.config import as_dict
    return {k: v for k, v in as_dict(run).items() if k not in ("out", "device", "resume", "retrain")}


def reopen(path, device="cpu", **changes):
    """The GPTRun of a finished run, from one of its drafter checkpoints (its folder, `device`, `changes`)."""
    ckpt = checkpoints.load(path)
    settings = dict(ckpt["run"])
    return ckpt, gpt_run(settings.pop("preset"), **{**settings, "out": os.path.dirname(os.path.abspath(path)),
                                                    "device": device, **changes})


# ---------------------------------------------------------------------------------------- for the notebooks

def fast_mode():
    """Tiny sizes everywhere (notebooks in CI): CI=true or MEDUSA_FAST=1."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("MEDUSA_FAST") == "1"


def run_finished(path):
    """Whether a drafter's checkpoint is there and its run got as far as choosing its trees."""
    if not os.path.exists(path):
        return False
    try:
        return bool(checkpoints.load(path).get("trees"))
    except RunError:
        return False


def tiny_run(out=None, device="cpu"):
    """The folder of the tiny preset's run with Medusa and EAGLE (out/tiny/, beside the project, by
    default): trained once (a minute or two on a CPU), kept, and reused by the notebooks in fast mode
    Files of an earlier layout there are trained again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(out or os.path.join(root, "out"), "tiny")
    with folder.waiting_lock(os.path.join(os.path.dirname(out), ".tiny.lock")):  # two notebooks at once: one trains
        if not run_finished(os.path.join(out, "eagle.pt")):
            retrain = tuple(n[:-3] for n in ("base.pt", "distill.pt", "medusa.pt", "eagle.pt")
                            if os.path.exists(os.path.join(out, n)))
            run(gpt_run("tiny", out=out, device=device, drafters=("medusa", "eagle"), retrain=retrain))
    return out


def trained_model(out=None, device="cpu", drafter="medusa"):
    """(model, tokenizer, checkpoint path, checkpoint) for the notebooks: the drafter `python train_heads.py
    --drafters medusa,eagle` wrote to out/, or, in fast mode or when there is none, the tiny preset's
    (tiny_run)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = out or os.path.join(root, "out")
    path = os.path.join(out, f"{drafter}.pt")
    if fast_mode() or not run_finished(path):
        path = os.path.join(tiny_run(out, device), f"{drafter}.pt")
    model, ckpt = checkpoints.load_model(path, device, drafter=drafter)
    return model, checkpoints.load_tokenizer(path, ckpt), path, ckpt
