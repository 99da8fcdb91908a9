"""Training the tiny GPT and its drafters, stage by stage, for `python train_heads.py`.

Stages: data and tokenizer -> base model (reused when out/base.pt exists) -> self-distilled
text -> Medusa-1 heads (optionally Medusa-2) -> head accuracies and a tree chosen for this
device -> report (measure.py). Every stage prints what it measured. The notebooks open the
finished run through trained_model().
"""
import contextlib
import copy
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import measure
from common import (cpu_has_native_bf16, draft_cheaply, file_digest, gpt_base, load_checkpoint, load_model,
                    load_tokenizer, prepare_data, random_prompts, read_checkpoint, run_args, save_checkpoint,
                    sync, windows)
from common import GENERATE
from eagle import LOSSES as EAGLE_LOSSES
from eagle import DynamicTree, EagleModel, FeatureDrafter, chain_accuracies, eagle_loss
from mtp import MTPModel, mtp_losses, mtp_weight
from medusa_mini import GPT, GPTConfig, MedusaDrafter, MedusaModel, generate, medusa_loss
from tree import dense_tree, expected_tokens_per_step, grow_tree


# ---------------------------------------------------------------------------------------- device and precision

def training_dtype(device) -> torch.dtype:
    """The autocast dtype for training: bf16 on a CUDA GPU with bf16 tensor cores; fp16 (with a
    GradScaler) on one without (a T4 only emulates bf16, slowly); bf16 on a CPU with bf16
    instructions (native bf16 products there); fp32 elsewhere (MPS included)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def autocast(device):
    dtype = training_dtype(device)
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def to_device(t, device):
    """A CPU tensor onto the device; on CUDA from pinned memory, without waiting for the copy."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ---------------------------------------------------------------------------------------- data

def get_batch(ids, batch_size, seq_len, generator, device):
    """Inputs x (B, T) and next tokens y (B, T) from random windows of T+1 tokens."""
    xy = to_device(windows(ids, batch_size, seq_len + 1, generator, "cpu"), device)  # (B, T+1)
    return xy[:, :-1], xy[:, 1:]


def text_batch(text, batch_size, generator, device):
    """Inputs and next tokens from random rows of self-distilled text (rows, T+1)."""
    rows = torch.randint(0, len(text), (batch_size,), generator=generator)
    xy = to_device(text[rows], device)
    return xy[:, :-1], xy[:, 1:]


def lr_at(step, total, peak, warmup_frac=0.05):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------- training

LOG_EVERY = 10  # read the loss on the host every 10 steps: .item() makes the CPU wait for the GPU


def train_loop(name, params, loss_fn, steps, lr, save, resume_from=None, weight_decay=0.0):
    """AdamW with warm-up and cosine decay. params: [(tensors, lr multiplier)]; weight decay on
    matrices only (not on biases and layer-norm gains, as in GPT-2). loss_fn(step) returns
    (loss, {name: tensor to show}); both are read on the host only every LOG_EVERY steps.

    Returns (history of step, loss and seconds, optimizer). Ctrl-C calls save(step, opt, history,
    done=False), which writes a resumable checkpoint, and exits; `--resume` continues from it."""
    device = params[0][0][0].device
    groups = [{"params": [t for t in p if (t.dim() >= 2) == matrices], "mult": m,
               "weight_decay": weight_decay if matrices else 0.0} for p, m in params for matrices in (True, False)]
    opt = torch.optim.AdamW([group for group in groups if group["params"]], lr=lr)
    scaler = torch.amp.GradScaler(device.type, enabled=training_dtype(device) == torch.float16)
    start, history = 0, {"step": [], "loss": [], "seconds": []}
    if resume_from is not None:
        opt.load_state_dict(resume_from["optimizer"])
        start, history = resume_from["step"], resume_from["history"]
        print(f"{name}: resuming at step {start}")
    t0 = time.time() - (history["seconds"][-1] if history.get("seconds") else 0.0)
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps, dynamic_ncols=True)
    try:
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr) * group["mult"]
            loss, shown = loss_fn(step)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if step % LOG_EVERY == 0 or step == steps - 1:
                history["step"].append(step)
                history["loss"].append(loss.item())
                history.setdefault("seconds", []).append(time.time() - t0)
                bar.set_postfix({k: f"{v.item():.3f}" for k, v in {"loss": loss, **shown}.items()})
    except KeyboardInterrupt:
        bar.close()
        print(f"\n{name}: interrupted at step {step}")
        save(step, opt, history, done=False)
        sys.exit(130)
    return history, opt


@torch.no_grad()
def estimate_loss(model: GPT, ids, args, device, batches=8):
    g = torch.Generator().manual_seed(1234)
    model.eval()
    losses = []
    for _ in range(batches):
        x, y = get_batch(ids, args.batch_size, args.seq_len, g, device)
        with autocast(device):
            losses.append(float(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())))
    model.train()
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
        x, y = get_batch(ids, 16, T, g, device)
        with autocast(device):
            loss = F.cross_entropy(model(x).float().transpose(1, 2), y, reduction="none")  # (B, T)
        sums += torch.stack([loss[:, skip:T // 2].mean(), loss[:, T // 2:].mean()]).cpu()
    return (sums / batches).tolist()


def stage_base(args, config, tokenizer, train_ids, val_ids, device):
    """Stage 1: pretrain the GPT, or reuse out/base.pt. With args.mtp = D, the GPT trains with D
    multi-token prediction modules (mtp.py): loss = main + lambda / D x the modules' losses. Returns
    (the GPT, its metrics, the MTPModel holding it and its modules, or None)."""
    path = os.path.join(args.out, "base.pt")
    D = args.mtp
    gpt = GPT(config).to(device)
    model = MTPModel(gpt, D).to(device) if D else gpt
    resume = None
    if os.path.exists(path):
        ckpt = load_checkpoint(path, config, device)
        if ckpt["base"].get("mtp", 0) != D:
            raise ValueError(f"{path} holds a base trained with {ckpt['base'].get('mtp', 0)} MTP modules and this run "
                             f"asks for {D}: an MTP base is another model; use another --out")
        model.load_state_dict(ckpt["model"])
        if ckpt["done"]:
            print(f"base: reusing {path} (val loss {ckpt['metrics']['val_loss']:.3f})")
            return gpt.eval(), ckpt["metrics"], model.eval() if D else None
        if not args.resume:
            raise ValueError(f"{path} is an unfinished run: pass --resume to continue it, or delete it")
        resume = ckpt
    print(f"base: {sum(p.numel() for p in gpt.parameters()) / 1e6:.2f}M parameters, {args.base_steps} steps"
          + (f", {D} MTP module{'s' * (D > 1)} ({sum(p.numel() for p in model.mtp.parameters()) / 1e6:.2f}M)"
             if D else ""))
    g = torch.Generator().manual_seed(args.seed)
    if resume is not None:
        g.set_state(resume["rng"])  # a resumed run goes on to new batches, not the first ones again
    model.train()

    def loss_fn(step):
        x, y = get_batch(train_ids, args.batch_size, args.seq_len, g, device)
        with autocast(device):
            if not D:
                return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()), {}
            h = gpt.hidden(x)                                                     # (B, T, C)
            main = F.cross_entropy(gpt.lm_head(h).flatten(0, 1).float(), y.flatten())
            modules = mtp_losses(model, h, torch.cat([x, y[:, -1:]], 1))          # (D,)
        weight = mtp_weight(step, args.base_steps, args.mtp_lambda)
        return main + weight / D * modules.sum(), {"main": main, "mtp": modules.mean()}

    def save(step, opt, history, done, metrics=None):
        save_checkpoint(path, base=gpt_base(config, D), drafter=None, model=model.state_dict(), tokenizer=tokenizer,
                        optimizer=opt.state_dict(), step=step, history=history, done=done, metrics=metrics or {},
                        rng=g.get_state())
        if not done:
            print(f"saved {path}; run again with --resume to continue")

    t0 = time.time()
    history, opt = train_loop("base", [(list(model.parameters()), 1.0)], loss_fn,
                              args.base_steps, args.base_lr, save, resume, args.weight_decay)
    metrics = {"val_loss": estimate_loss(gpt, val_ids, args, device), "seconds": time.time() - t0,
               "history": history, "val_loss_halves": loss_by_half(gpt, val_ids, device), "mtp": D}
    metrics["step_seconds"] = metrics["seconds"] / max(1, args.base_steps - (resume or {}).get("step", 0))
    save(args.base_steps, opt, history, done=True, metrics=metrics)
    first, second = metrics["val_loss_halves"]
    print(f"base: val loss {metrics['val_loss']:.3f} after {metrics['seconds']:.0f}s -> {path}\n"
          f"base: held-out loss {first:.3f} over positions 8-{args.seq_len // 2 - 1}, "
          f"{second:.3f} over {args.seq_len // 2}-{args.seq_len - 1}")
    return gpt.eval(), metrics, model.eval() if D else None


DISTILL_PROMPT = 16  # tokens of training text each self-distilled continuation starts from
CPU_MEMORY_BUDGET = 2**30  # bytes batched generation may use where free memory cannot be read (CPU, MPS)


def generation_batch_size(config: GPTConfig, length, device):
    """Rows of batched generation that fit: half the free memory on CUDA (torch.cuda.mem_get_info),
    else CPU_MEMORY_BUDGET. A row holds its KV cache (length entries) and one position's activations."""
    bytes_per_row = estimate_generation_bytes(config, 1, length)
    if torch.device(device).type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] // 2
    else:
        budget = CPU_MEMORY_BUDGET
    return max(1, min(1024, budget // bytes_per_row))


def distill_text(args, base, train_ids, device):
    """Self-distillation data: the base model's own continuations of training prompts, a fraction
    args.distill_sampled of them sampled at T = 0.7 and the rest greedy. Cached in out/distill.pt."""
    path = os.path.join(args.out, "distill.pt")
    key = {"base": file_digest(os.path.join(args.out, "base.pt")), "prompts": args.distill_prompts,
           "len": args.distill_len, "sampled": args.distill_sampled, "seed": args.seed}
    if os.path.exists(path):
        cached = read_checkpoint(path)
        if cached.get("key") == key:
            return cached["tokens"]
    t0 = time.time()
    prompts = random_prompts(train_ids, args.distill_prompts, DISTILL_PROMPT, args.seed + 1, device)
    n_sampled = round(args.distill_sampled * len(prompts))
    bs = generation_batch_size(base.config, DISTILL_PROMPT + args.distill_len, device)
    chunks = []
    for temperature, part in ((0.0, prompts[n_sampled:]), (0.7, prompts[:n_sampled])):
        for i in tqdm(range(0, len(part), bs), desc=f"distill T={temperature}", dynamic_ncols=True):
            chunks.append(generate(base, part[i:i + bs], args.distill_len, temperature).cpu())
    tokens = torch.cat(chunks)
    save_checkpoint(path, key=key, tokens=tokens)
    print(f"distill: {tokens.numel():,} tokens of the model's own text ({n_sampled} of {len(prompts)} "
          f"continuations sampled at T=0.7, the rest greedy; {bs} rows at a time) in {time.time() - t0:.0f}s")
    return tokens


def head_metrics(model: MedusaModel, x, y, device):
    """Per-head loss, top-1 and top-5 accuracy on one batch (head k at t vs token t+k+1)."""
    with torch.no_grad(), autocast(device):
        _, head_logits = model(x)
    head_logits = head_logits.float()
    _, losses = medusa_loss(head_logits, y)
    top1, top5 = [], []
    for k in range(1, head_logits.size(0) + 1):
        target = y[:, k:]                                                    # (B, T-k)
        guesses = head_logits[k - 1, :, :y.size(1) - k].topk(5, -1).indices  # (B, T-k, 5)
        top1.append(float((guesses[..., 0] == target).float().mean()))
        top5.append(float((guesses == target[..., None]).any(-1).float().mean()))
    return {"loss": losses.tolist(), "top1": top1, "top5": top5}


def stage_heads(args, base, base_metrics, config, tokenizer, train_ids, val_ids, device):
    """Stage 2: Medusa-1 heads on a frozen backbone (self-distilled by default); optional Medusa-2."""
    path = os.path.join(args.out, "medusa.pt")
    model = MedusaModel(base, num_heads=args.num_heads, share_lm_head=args.share_lm_head).to(device)
    settings = {k: getattr(args, k) for k in ("preset", "num_heads", "head_steps", "head_lr", "distill", "joint",
                                              "joint_steps", "distill_prompts", "distill_len", "distill_sampled",
                                              "seed", "data", "tokenizer", "vocab_size", "val_plays", "share_lm_head")}
    resume = None
    if os.path.exists(path):
        ckpt = load_checkpoint(path, config, device)
        if ckpt["settings"] == settings and (ckpt["done"] or args.resume):
            model.load_state_dict(ckpt["model"])
            if ckpt["done"]:
                print(f"heads: reusing {path}")
                return model.eval(), ckpt["metrics"]
            resume = ckpt
    for p in model.base.parameters():
        p.requires_grad_(False)  # Medusa-1: backbone and lm_head frozen
    text = distill_text(args, model.base, train_ids, device) if args.distill else None
    g = torch.Generator().manual_seed(args.seed + 2)
    if resume is not None:
        g.set_state(resume["rng"])

    def loss_fn(step):
        if text is None:
            x, y = get_batch(train_ids, args.batch_size, args.seq_len, g, device)
        else:
            x, y = text_batch(text, args.batch_size, g, device)
        with torch.no_grad(), autocast(device):
            h = model.base.hidden(x)                                        # frozen: no graph
        with autocast(device):
            head_logits = model.head_logits(h).float()                     # (K, B, T, V)
            loss, _ = medusa_loss(head_logits, y)
        head1_acc = (head_logits[0, :, :-1].argmax(-1) == y[:, 1:]).float().mean()  # head 1 at t: token t+2
        return loss, {"head1 acc": head1_acc}

    def save(step, opt, history, done, metrics=None):
        save_checkpoint(path, base=gpt_base(config), model=model.state_dict(),
                        drafter={"kind": "medusa", "config": {"num_heads": args.num_heads,
                                                             "share_lm_head": args.share_lm_head}},
                        tokenizer=tokenizer, settings=settings, optimizer=opt.state_dict(), step=step,
                        history=history, done=done, metrics=metrics or {}, rng=g.get_state())
        if not done:
            print(f"saved {path}; run again with --resume to continue")

    t0 = time.time()
    head_params = [p for head in model.heads for p in head.parameters()]
    history, opt = train_loop("heads", [(head_params, 1.0)], loss_fn, args.head_steps, args.head_lr, save, resume)
    val_x, val_y = get_batch(val_ids, args.batch_size, args.seq_len, torch.Generator().manual_seed(99), device)
    metrics = {"history": history, "seconds": time.time() - t0, "distill": args.distill,
               "val": head_metrics(model, val_x, val_y, device)}
    if args.joint:
        text = text if text is not None else distill_text(args, model.base, train_ids, device)
        metrics["joint"] = train_joint(args, model, text, val_ids, device, base_metrics["val_loss"])
        metrics["val"] = head_metrics(model, val_x, val_y, device)
    print("heads: held-out top-1 " + " ".join(f"{a:.2f}" for a in metrics["val"]["top1"]) +
          f" ({metrics['seconds']:.0f}s)")
    save(args.head_steps, opt, history, done=True, metrics=metrics)
    return model.eval(), metrics


def stage_eagle(args, base, config, tokenizer, train_ids, val_ids, device):
    """Stage 2 for EAGLE: one draft layer on the frozen base (eagle.py), trained on the same self-distilled
    text as the heads with EAGLE-1's loss: SmoothL1 on the predicted feature plus 0.1 x the
    cross-entropy from the base's next-token distribution, noise on the input features (args.eagle_loss
    "tokens": the cross-entropy alone, the comparison ablation.py --eagle-loss runs). The base's
    features are computed batch by batch (it is frozen: no graph)."""
    path = os.path.join(args.out, "eagle.pt")
    model = EagleModel(base).to(device)
    settings = {k: getattr(args, k) for k in ("preset", "eagle_steps", "eagle_lr", "eagle_loss", "distill_prompts",
                                              "distill_len", "distill_sampled", "seed", "data", "tokenizer", "vocab_size",
                                              "val_plays")}
    resume = None
    if os.path.exists(path):
        ckpt = load_checkpoint(path, config, device)
        if ckpt.get("settings") == settings and (ckpt["done"] or args.resume):
            model.load_state_dict(ckpt["model"])
            if ckpt["done"]:
                print(f"eagle: reusing {path}")
                return model.eval(), ckpt["metrics"]
            resume = ckpt
    base.requires_grad_(False)
    text = distill_text(args, base, train_ids, device)
    g = torch.Generator().manual_seed(args.seed + 8)
    if resume is not None:
        g.set_state(resume["rng"])

    def loss_fn(step):
        x, y = text_batch(text, args.batch_size, g, device)                  # (B, T): tokens, and the next ones
        with torch.no_grad(), autocast(device):
            f = base.hidden(x).float()                                        # (B, T, C): the frozen base's features
        with autocast(device):
            loss, feature, token, agree = eagle_loss(model.eagle, base, f, y, torch.arange(x.size(1), device=device),
                                                     weights=EAGLE_LOSSES[args.eagle_loss])
        return loss, {"feature": feature, "token": token, "top1": agree}

    def save(step, opt, history, done, metrics=None):
        save_checkpoint(path, base=gpt_base(config), model=model.state_dict(), drafter={"kind": "eagle", "config": {}},
                        tokenizer=tokenizer, settings=settings, optimizer=opt.state_dict(), step=step,
                        history=history, done=done, metrics=metrics or {}, rng=g.get_state())
        if not done:
            print(f"saved {path}; run again with --resume to continue")

    t0 = time.time()
    history, opt = train_loop("eagle", [(list(model.eagle.parameters()), 1.0)], loss_fn, args.eagle_steps,
                              args.eagle_lr, save, resume)
    metrics = {"history": history, "seconds": time.time() - t0,
               "parameters": sum(p.numel() for p in model.eagle.parameters())}
    print(f"eagle: {metrics['parameters'] / 1e6:.2f}M parameters trained in {metrics['seconds']:.0f}s")
    save(args.eagle_steps, opt, history, done=True, metrics=metrics)
    return model.eval(), metrics


def stage_mtp(args, model, base_metrics, config, tokenizer):
    """The MTP drafter: the modules trained with the base (stage_base), saved as mtp.pt, and what they
    cost: their parameters, and the training time they added (from how much longer a step takes
    with them, mtp_step_ratio)."""
    ratio = mtp_step_ratio(args, config, next(model.parameters()).device)
    added = base_metrics["seconds"] * (1 - 1 / ratio)
    metrics = {"seconds": added, "parameters": sum(p.numel() for p in model.mtp.parameters()), "step_ratio": ratio}
    print(f"mtp: {args.mtp} module{'s' * (args.mtp > 1)}, {metrics['parameters'] / 1e6:.2f}M parameters; a training "
          f"step takes {ratio:.2f}x the time with them: about {added:.0f}s of the base's training")
    save_checkpoint(os.path.join(args.out, "mtp.pt"), base=gpt_base(config, args.mtp), model=model.state_dict(),
                    drafter={"kind": "mtp", "config": {"depth": args.mtp}}, tokenizer=tokenizer, done=True,
                    settings={k: getattr(args, k) for k in ("preset", "mtp", "mtp_lambda", "base_steps", "seed",
                                                            "data", "tokenizer", "vocab_size", "val_plays")},
                    metrics=metrics)
    return model.eval(), metrics


def mtp_step_ratio(args, config, device, repeats=5):
    """How much longer a training step of the base takes with args.mtp MTP modules than without them:
    whole steps (forward, backward and AdamW's update, as train_loop takes them) on throwaway models and
    a random batch, the two alternated, each side's fastest (the least disturbed by other work on the
    machine). At least 1: the step with modules does all of the plain step's work."""
    plain = GPT(config).to(device)
    model = MTPModel(GPT(config), args.mtp).to(device)
    opts = {False: torch.optim.AdamW(plain.parameters(), lr=args.base_lr),
            True: torch.optim.AdamW(model.parameters(), lr=args.base_lr)}
    x = torch.randint(config.vocab_size, (args.batch_size, args.seq_len + 1), device=device)  # (B, T + 1)
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
            sync(device)
            times[with_modules].append(time.time() - t0)
    return max(1.0, min(times[True][1:]) / min(times[False][1:]))  # the first: warm-up


@torch.no_grad()
def base_quality(base, val_ids, args, device, prompts, n_new=None):
    """What a base model is worth on held-out text: the main head's loss (estimate_loss's batches) and how
    repetitive its greedy text is (distinct 4-grams of n_new tokens from each prompt; 1.0: no repeats)."""
    out = generate(base, prompts, n_new or args.report_tokens)[:, prompts.size(1):]
    return {"val_loss": estimate_loss(base, val_ids, args, device),
            "distinct_4gram": statistics.fmean(measure.distinct_4gram_ratio(row) for row in out.tolist())}


JOINT_HEADS_WEIGHT = 0.2    # lambda_0, as in the Medusa authors' stage-2 config (axolotl
#                             examples/medusa/vicuna_7b_qlora_stage2.yml: medusa_heads_coefficient 0.2)
JOINT_HEADS_LR_MULT = 300.0  # heads' lr over the backbone's. The authors use 4 on a 7B model; this small
#                             backbone is kept nearly still (docs/results.md has the Medusa-2 run)


def train_joint(args, model, text, val_ids, device, val_before):
    """Medusa-2, self-distilled: backbone and heads together on the model's own text, after the
    heads-only stage (the warm-up). The base loss is KL(original || model) to a frozen copy of the
    original base, so the model keeps its distribution; plus 0.2 x the Medusa-1 loss, heads at half
    the Medusa-1 lr, the backbone at 1/300 of that. Returns base val loss and head top-1 on greedy
    text, before and after."""
    original = copy.deepcopy(model.base).eval().requires_grad_(False)
    prompts = random_prompts(val_ids, args.eval_prompts, EVAL_PROMPT, args.seed + 4, device)
    top1_before = [a[0] for a in measure_head_accuracies(model, prompts, EVAL_NEW, ranks=1)]
    model.base.requires_grad_(True)
    model.train()
    g = torch.Generator().manual_seed(args.seed + 3)

    def loss_fn(step):
        x, y = text_batch(text, args.batch_size, g, device)
        with torch.no_grad(), autocast(device):
            target = F.log_softmax(original(x).float(), -1)                             # (B, T, V)
        with autocast(device):
            base_logits, head_logits = model(x)
            kl = F.kl_div(F.log_softmax(base_logits.float(), -1), target, log_target=True,
                          reduction="none").sum(-1).mean()                               # KL(original || model)
            medusa, _ = medusa_loss(head_logits.float(), y)
        return kl + JOINT_HEADS_WEIGHT * medusa, {"kl": kl}

    head_params = [p for head in model.heads for p in head.parameters()]
    def save(*_, **__):  # Medusa-2 is short: it is not resumable
        print("Medusa-2 is not resumable: run again to train the heads and Medusa-2 anew")

    t0 = time.time()
    # Heads at half the Medusa-1 rate, the backbone at 1/JOINT_HEADS_LR_MULT of that.
    history, _ = train_loop("joint", [(list(model.base.parameters()), 1.0), (head_params, JOINT_HEADS_LR_MULT)],
                            loss_fn, args.joint_steps, args.head_lr / 2 / JOINT_HEADS_LR_MULT, save)
    seconds = time.time() - t0
    model.eval()
    after = estimate_loss(model.base, val_ids, args, device)
    top1_after = [a[0] for a in measure_head_accuracies(model, prompts, EVAL_NEW, ranks=1)]
    print(f"joint: base val loss {val_before:.3f} -> {after:.3f}; head top-1 on greedy text "
          + " ".join(f"{a:.2f}" for a in top1_before) + " -> " + " ".join(f"{a:.2f}" for a in top1_after)
          + f" ({seconds:.0f}s)")
    return {"val_loss_before": val_before, "val_loss_after": after, "history": history, "seconds": seconds,
            "greedy_top1_before": top1_before, "greedy_top1_after": top1_after}


# ---------------------------------------------------------------------------------------- tree

EVAL_PROMPT, EVAL_NEW = 32, 64  # held-out prompt and greedy continuation the head accuracies are read on
SAMPLE_T = 0.7                   # the temperature the sampling tree is grown for, as in the report


@torch.no_grad()
def measure_head_accuracies(model: MedusaModel, prompts, n_new, ranks, temperature=0.0):
    """docs/medusa.md section 4: during greedy decoding, how often is head k's rank-i guess the token
    actually produced k+1 steps later? Greedy text is generated, then one forward reads every h_t
    that decoding would have seen. Returns a[k][i] (K x ranks).
    With temperature > 0 the text is sampled at that temperature (from torch's global generator):
    then a[k][i] is how often exact sampling would accept a node of head k at rank i, since the walk
    accepts a node exactly when the drawn token is the node's."""
    seq = generate(model.base, prompts, n_new, temperature)              # (B, S+n)
    _, head_logits = model(seq)                                          # (K, B, S+n, V)
    S, K = prompts.size(1), head_logits.size(0)
    acc = []
    for k in range(1, K + 1):
        positions = torch.arange(S - 1, seq.size(1) - k - 1)             # committed positions t
        guesses = head_logits[k - 1][:, positions].topk(ranks, -1).indices  # (B, n', ranks)
        actual = seq[:, positions + k + 1]                               # token t+k+1: (B, n')
        acc.append((guesses == actual[..., None]).float().mean((0, 1)).tolist())
    return acc


# ---------------------------------------------------------------------------------------- the plan, said up front

def count_parameters(config: GPTConfig, num_heads: int):
    """(base, heads, EAGLE layer) parameter counts, from models built on the meta device (no memory used)."""
    with torch.device("meta"):
        base = GPT(config)
        heads, eagle = MedusaModel(base, num_heads=num_heads).heads, EagleModel(base).eagle
    return tuple(sum(p.numel() for p in m.parameters()) for m in (base, heads, eagle))


def estimate_generation_bytes(config: GPTConfig, rows, length, prompt=DISTILL_PROMPT):
    """Batched fp32 generation: each row's KV cache (length entries, every layer, K and V) plus the
    prefill's activations (about 18 numbers per width per layer, and the logits) for `prompt` tokens."""
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    return 4 * rows * (2 * L * length * C + prompt * (18 * L * C + V))


def estimate_memory(config: GPTConfig, args, dtype=torch.float32):
    """Estimated peak bytes per stage, from parameter and activation counts (not measured).

    Training holds fp32 weights, gradients and AdamW's two moments (16 bytes a parameter), the
    activations kept for the backward pass (about 18 numbers per width per token per layer, in the
    autocast dtype; the fused attention kernel keeps no T x T matrix), and the logits with their fp32
    copy and gradient. Generation holds the weights and the KV cache."""
    N, H, E = count_parameters(config, args.num_heads)
    B, T, C, V, L, K = args.batch_size, args.seq_len, config.n_embd, config.vocab_size, config.n_layer, args.num_heads
    a = torch.finfo(dtype).bits // 8
    activations = B * T * 18 * C * L * a
    logits = B * T * V * (a + 8)
    rows = generation_batch_size(config, DISTILL_PROMPT + args.distill_len, args.device)
    return {
        "base": 16 * N + activations + logits,
        "distill": 4 * N + estimate_generation_bytes(config, rows, DISTILL_PROMPT + args.distill_len),
        "heads": 4 * N + 16 * H + activations // L + K * (logits + B * T * 3 * C * a),
        "joint": 20 * N + 16 * H + activations + (K + 2) * logits,
        "eagle": 4 * N + 16 * E + activations // L * 2 + 2 * logits,
        "tree and report": 4 * (N + H + E) + estimate_generation_bytes(config, 1, args.seq_len, prompt=args.seq_len),
    }


# Batched one-token forwards reach a fraction of a training step's FLOP rate: a factor read off cpu-preset
# runs, for a plan that is only an estimate.
DECODING_SLOWDOWN = 3


def estimate_seconds(config: GPTConfig, args, train_step, decode_step):
    """Estimated seconds per stage, from two measured steps: training stages scale the base step by
    their FLOPs (6 per parameter per token to train, 2 to run forward, plus attention); the report
    is about one batch-1 decoding step per generated token (a Medusa step costs more but commits more)."""
    N, H, E = count_parameters(config, args.num_heads)
    B, T, C, L, V = args.batch_size, args.seq_len, config.n_embd, config.n_layer, config.vocab_size
    attention = 2 * L * T * C  # FLOPs per token, forward: scores and weighted values over ~T/2 keys
    rate = (6 * N + 3 * attention) * B * T / train_step  # FLOP/s
    distill_tokens = args.distill_prompts * (DISTILL_PROMPT + args.distill_len)
    # Tree costs and the report: batch-1 decoding, every drafter, every thread count.
    rounds = args.timing_rounds
    step_costs = (rounds or measure.STEP_COST_REPEATS) * (len(measure.STEP_COST_SIZES) + 1) * measure.STEP_COST_TOKENS
    extra_trees = {"medusa": 2, "eagle": 1, "mtp": 1}  # training.choose_trees: medusa grown and dense; dynamic
    n_threads = len(measure.thread_counts(args.device, args.threads))
    # measure.pick_threads: the plain modes and each drafter's chosen tree at every thread count, the rest at one
    every = measure.REPORT_PLAIN_MODES + len(args.drafters)
    once = sum(measure.modes_per_drafter(extra_trees[d]) for d in args.drafters) - len(args.drafters)
    report = args.report_tokens * (args.report_prompts * (every * n_threads + once) * (rounds or measure.REPORT_REPEATS)
                                   + measure.SWEEP_PROMPTS * (len(measure.SWEEP_SIZES) + 2) * (rounds or measure.SWEEP_REPEATS))
    report_tokens = n_threads * step_costs * len(args.drafters) + report
    return {
        "base": args.base_steps * train_step,
        "distill": distill_tokens * (2 * N + attention) / rate * DECODING_SLOWDOWN,
        "heads": args.head_steps * B * T * (2 * N + attention + 6 * H) / rate,
        "joint": args.joint_steps * B * T * (8 * N + 5 * attention + 6 * H) / rate,
        "eagle": args.eagle_steps * B * T * (2 * N + attention + 6 * E + 8 * C * V) / rate,
        "tree and report": report_tokens * decode_step,
    }


def measure_steps(config: GPTConfig, args, device):
    """Seconds of one base-model training step with this run's batch and of one batch-1 decoding
    step, on a throwaway model (each the last of a few: the first ones pay for warm-up)."""
    model = GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    x = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device=device)
    for _ in range(3):
        t0 = time.time()
        with autocast(device):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        train_step = time.time() - t0
    n = 8
    generate(model, x[:1, :8], 2)
    sync(device)
    t0 = time.time()
    generate(model, x[:1, :8], n + 1)
    sync(device)
    return train_step, (time.time() - t0) / n


def print_plan(args, config, device):
    """Device, dtype, and the estimated peak memory and time of each stage, before any training."""
    dtype = training_dtype(device)
    step, decode = measure_steps(config, args, device)
    memory, seconds = estimate_memory(config, args, dtype), estimate_seconds(config, args, step, decode)
    stages = ["base", "distill" if args.distill or "eagle" in args.drafters else None,
              "heads" if "medusa" in args.drafters else None, "joint" if args.joint else None,
              "eagle" if "eagle" in args.drafters else None, "tree and report"]
    print(f"plan: {device}, training in {str(dtype).removeprefix('torch.')}; one base step measured at {step:.2f}s; "
          f"memory and other times estimated from parameter and activation counts (training.estimate_*)")
    for stage in filter(None, stages):
        print(f"  {stage:15s} peak ~{memory[stage] / 2**30:5.2f} GiB   ~{seconds[stage] / 60:5.1f} min")


# ---------------------------------------------------------------------------------------- main

def generation_lengths(args):
    """The longest sequence (prompt + new tokens) each stage generates. The model's context is its
    training window (block_size = seq_len), so every position generation uses has been trained."""
    return {"distill": DISTILL_PROMPT + args.distill_len, "head accuracies": EVAL_PROMPT + EVAL_NEW,
            "tree costs": 64 + 48,               # measure.measure_step_costs: a 64-token prompt, 48 new
            "report": 32 + args.report_tokens}   # measure.run_report: 32-token prompts


def choose_trees(name, model, decode, args, eval_prompts, val_ids, device):
    """A drafter's trees for this device: accuracies read on greedy held-out text, a tree grown from them
    (tree.grow_tree), its size chosen from measured step costs; a tree for exact sampling grown from
    accuracies on sampled text. Returns a measure.Drafted (without its training figures)."""
    if name == "medusa":
        def accuracies(temperature):
            return measure_head_accuracies(model, eval_prompts, EVAL_NEW, args.rank_depth, temperature)
    else:
        def accuracies(temperature):
            seq = generate(model.base, eval_prompts, EVAL_NEW, temperature)
            return chain_accuracies(model, seq, EVAL_PROMPT - 1, args.eagle_depth, args.rank_depth)
    greedy = accuracies(0.0)
    order = grow_tree(greedy, args.max_tree)  # grow_tree adds nodes in order: every prefix is a tree
    costs = measure.measure_step_costs(model, order, val_ids, device, args.threads, decode=decode,
                                       repeats=args.timing_rounds or measure.STEP_COST_REPEATS)
    chosen, threads = measure.choose_tree(order, greedy, costs)
    print(f"{name} tree: {len(chosen)} nodes chosen for {device}, {threads} thread{'s' * (threads != 1)} (expected "
          f"{expected_tokens_per_step(chosen, greedy):.2f} tokens/step at "
          f"{costs[threads]['relative'][len(chosen)]:.2f}x the cost of a plain step); top-1 by depth "
          + " ".join(f"{a[0]:.2f}" for a in greedy))
    # Exact sampling accepts a node only when the drawn token is its token: a tree for it grows from
    # accuracies on sampled text (wider, shallower), sized with the same step costs (by node count).
    torch.manual_seed(args.seed + 6)
    sampled = accuracies(SAMPLE_T)
    sampling_order = grow_tree(sampled, args.max_tree)
    sampling_tree, _ = measure.choose_tree(sampling_order, sampled, costs)
    print(f"{name} sampling tree: {len(sampling_tree)} nodes for exact sampling at T={SAMPLE_T} (expected "
          f"{expected_tokens_per_step(sampling_tree, sampled):.2f} tokens/step)")
    if name == "medusa":
        extra = {"grown tree": order[:64], "dense " + "x".join(map(str, measure.DENSE_WIDTHS)):
                 dense_tree(measure.DENSE_WIDTHS[:len(model.heads)])}
    else:  # EAGLE-2's tree (EAGLE, MTP), as many nodes as the chosen one, drafted anew every step
        extra = {"dynamic tree": DynamicTree(topk=min(4, len(chosen)), nodes=len(chosen),
                                             depth=min(args.eagle_depth, len(chosen)))}
    drafter = MedusaDrafter if name == "medusa" else FeatureDrafter  # MTP's modules draft through EAGLE's path
    return measure.Drafted(name, model, decode, drafter, chosen, order, greedy, costs, sampling_tree, extra), \
        dict(grown_order=[list(p) for p in order], accuracies=greedy, step_costs=costs,
             sampling_order=[list(p) for p in sampling_order], sampled_accuracies=sampled,
             extra_trees={label: measure.tree_json(tree) for label, tree in extra.items()})


def run(args):
    """The whole pipeline for the tiny GPT, as train_heads.py's flags (args) ask; returns the report."""
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"medusa-mini: preset {args.preset} on {args.device} ({torch.get_num_threads()} CPU threads), "
          f"drafters {', '.join(args.drafters)}, out {args.out}/")
    t0 = time.time()
    enc, tokenizer, train_ids, val_ids = prepare_data(args)
    config = GPTConfig(vocab_size=enc.n_vocab, block_size=args.seq_len, n_layer=args.n_layer,  # every position trained
                       n_head=args.n_head, n_embd=args.n_embd)
    print_plan(args, config, args.device)
    torch.manual_seed(args.seed)
    base, base_metrics, mtp_model = stage_base(args, config, tokenizer, train_ids, val_ids, args.device)
    trained, training = {}, {"base": base_metrics}
    for name in args.drafters:
        if name == "medusa":
            model, training["heads"] = stage_heads(args, base, base_metrics, config, tokenizer, train_ids, val_ids,
                                                   args.device)
        elif name == "eagle":
            model, training[name] = stage_eagle(args, base, config, tokenizer, train_ids, val_ids, args.device)
        else:  # the MTP modules trained with the base: nothing more to train
            model, training[name] = stage_mtp(args, mtp_model, base_metrics, config, tokenizer)
        trained[name] = draft_cheaply(model, args.device)  # decoding drafts in bf16 where it is native

    eval_prompts = random_prompts(val_ids, args.eval_prompts, EVAL_PROMPT, args.seed + 4, args.device)
    drafted = []
    for name, model in trained.items():
        d, found = choose_trees(name, model, GENERATE[name], args, eval_prompts, val_ids, args.device)
        metrics = training["heads" if name == "medusa" else name]
        d.training = {"seconds": metrics["seconds"],  # MTP: what the modules added to the base's training
                      "parameters": sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in base.parameters())}
        path = os.path.join(args.out, f"{name}.pt")
        ckpt = load_checkpoint(path, device=args.device)
        ckpt.pop("format")
        ckpt.update(tree=measure.tree_json(d.tree), sampling_tree=[list(p) for p in d.sampling_tree], **found)
        save_checkpoint(path, **ckpt)
        drafted.append(d)

    prompts = random_prompts(val_ids, args.report_prompts, measure.REPORT_PROMPT, args.seed + 5, args.device)
    report = measure.run_report(drafted, prompts, args.report_tokens, measure.thread_counts(args.device, args.threads),
                                repeats=args.timing_rounds or measure.REPORT_REPEATS,
                                sweep_repeats=args.timing_rounds or measure.SWEEP_REPEATS)
    report.update(preset=args.preset, device=str(args.device), training=training, total_seconds=time.time() - t0,
                  sample=enc.decode(prompts[0].tolist()) + "[...]" + enc.decode(report["sample"]))
    measure.write_report(report, args.out)
    return report


def fast_mode():
    """Tiny sizes everywhere (notebooks in CI): CI=true or MEDUSA_FAST=1."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("MEDUSA_FAST") == "1"


def tiny_run(out=None, device="cpu"):
    """The folder of the tiny preset's run with Medusa and EAGLE (out/tiny/, beside this file, by
    default): trained once (seconds on a CPU), kept, and reused by the notebooks in fast mode and by
    student copies (make_assignment.py). Files of an earlier checkpoint layout there are trained again."""
    out = os.path.join(out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"), "tiny")
    os.makedirs(out, exist_ok=True)
    with exclusive(os.path.join(out, ".lock")):  # two notebooks opened at once train it once
        if not run_finished(os.path.join(out, "eagle.pt")):
            for name in ("base.pt", "distill.pt", "heads.pt"):
                stale = os.path.join(out, name)
                if os.path.exists(stale) and "format" not in read_checkpoint(stale):
                    os.remove(stale)
            run(run_args("tiny", out, device, drafters=["medusa", "eagle"]))
    return out


@contextlib.contextmanager
def exclusive(path):
    """One process at a time runs the block: an exclusive lock on the file `path` (created if missing),
    which the system releases when the process ends, however it ends."""
    with open(path, "a+") as f:
        if os.name == "nt":
            import msvcrt
            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)  # retries for 10 s, then raises
                    break
                except OSError:
                    continue
        else:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def run_finished(path):
    """Whether a drafter's checkpoint is there and its run got as far as choosing a tree."""
    return os.path.exists(path) and "tree" in read_checkpoint(path)


def trained_model(out=None, device="cpu", drafter="medusa"):
    """(model, tokenizer, checkpoint) for the notebooks: the drafter `python train_heads.py --drafters
    medusa,eagle` wrote to out/ (beside this file), or, in fast mode or when there is none, the tiny
    preset's (tiny_run)."""
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    path = os.path.join(out, f"{drafter}.pt")
    if fast_mode() or not run_finished(path):
        path = os.path.join(tiny_run(out, device), f"{drafter}.pt")
    model, ckpt = load_model(path, device, drafter=drafter)
    return model, load_tokenizer(ckpt["tokenizer"]), ckpt
