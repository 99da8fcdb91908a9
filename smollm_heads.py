"""Drafters for SmolLM2-135M-Instruct, self-distilled on its own chat answers (`python train_heads.py --base smollm2`).

Stages, each printing what it measured:
  1. prompts   a few hundred offline instructions: Shakespeare passages (continue, explain, summarise, ...)
               and general questions; whole plays and topics held out for evaluation.
  2. distill   the model's own greedy answers, 128 prompts at a time; the hidden states decoding computed
               on the way are kept (the backbone is frozen, so they are computed once, by the same forward
               that decodes). Where bf16 is native, a bf16 copy of the model writes them, about twice as
               fast: they are only training data. The held-out answers come from the fp32 model itself.
  3. heads     Medusa-1: one residual block per head, projected through the frozen, shared lm_head.
               Decoding drafts with a bf16 copy of the projection, over the tokens the heads were
               trained on (model.draft_dtype, model.draft_vocab): measured and reported (draft_costs).
  4. tree      head accuracies on held-out prompts, a grown tree, its size chosen from measured step costs.
  5. report    plain greedy against Medusa greedy on held-out chat prompts (measure.compare), best
               thread count against best, and the cost of one forward against its number of new tokens.
"""
import copy
import json
import os
import random
import statistics
import time

import torch
from tqdm import tqdm

import data
import measure
import smollm
from common import SMOLLM2_BASE, draft_cheaply, drafter_state, native_bf16, read_checkpoint, save_checkpoint, sync
from medusa_mini import HeadStack, MedusaModel, generate, medusa_loss
from training import train_loop
from tree import expected_tokens_per_step, grow_tree
from verify import KVCache

NUM_HEADS = 4        # the grown tree goes only as deep as the measured accuracies pay for
ANSWER_TOKENS = 96   # tokens generated per distillation prompt (answers end sooner at <|im_end|>: 70 on average)
BLOCK_SIZE = SMOLLM2_BASE["block_size"]  # the KV cache's length

# ---------------------------------------------------------------------------------------- 1. prompts

TASKS = [  # {passage} is a few lines of a play
    "Continue this passage from Shakespeare in the same style:\n\n{passage}",
    "Explain what is happening in this passage, in plain English:\n\n{passage}",
    "Summarise this passage in one or two sentences:\n\n{passage}",
    "Rewrite this passage in modern English:\n\n{passage}",
    "What does the speaker feel in these lines, and why?\n\n{passage}",
]
QUESTIONS = [  # {topic} is one of TOPICS
    "What is {topic}?", "Explain {topic} to a ten-year-old.", "Write a short poem about {topic}.",
    "Give me three interesting facts about {topic}.", "Write a haiku about {topic}.",
    "Why does {topic} matter? Answer in a short paragraph.", "Describe {topic} in two sentences.",
    "Write a short story for children about {topic}.", "What are the pros and cons of {topic}?",
    "Write a limerick about {topic}.", "How would you explain {topic} to someone from the year 1500?",
    "List five words that remind you of {topic}, and say why.", "Write a short letter to a friend about {topic}.",
    "What is a common misconception about {topic}?", "Write a tweet about {topic}.",
    "Give me a fun quiz question about {topic}, with its answer.",
]
TOPICS = ["the ocean", "photosynthesis", "the moon", "friendship", "volcanoes", "the water cycle", "bees",
          "gravity", "the internet", "rainbows", "a healthy breakfast", "the human heart", "electricity",
          "the Roman Empire", "recycling", "dinosaurs", "the solar system", "music", "mountains", "sleep",
          "the printing press", "clouds", "democracy", "honey", "a library", "trees", "exercise", "snow",
          "the desert", "computers", "kindness", "the rainforest", "bicycles", "coffee", "the stars",
          "earthquakes", "the alphabet", "chess", "gardening", "the wind", "penguins", "the Great Wall of China",
          "vaccines", "money", "the brain", "tea", "autumn", "trains", "the Olympic Games", "cats", "dogs",
          "a thunderstorm", "the Eiffel Tower", "robots", "the Sahara", "coral reefs", "jazz", "painting",
          "mathematics", "the seasons", "bridges", "the Renaissance", "chocolate", "elephants", "spiders",
          "glaciers", "airplanes", "the weather", "a birthday party", "soap", "salt", "maps", "time zones",
          "the immune system", "whales", "fire", "the ancient Egyptians", "a good night's sleep", "poetry",
          "the guitar", "solar power", "wind turbines", "a city park", "learning a language", "the piano",
          "the Moon landing", "butterflies", "mushrooms", "the Amazon river", "the human skeleton",
          "planting a tree", "saving money", "the theatre", "castles", "pirates", "the post office",
          "microscopes", "telescopes", "the Internet of Things", "video games", "football", "a marathon",
          "the sun", "magnets", "the periodic table", "bread baking", "knitting", "board games", "farming",
          "wolves", "a school day", "the library of Alexandria", "paper", "ink", "the compass", "sailing ships"]
HELD_OUT_TOPICS = ["lighthouses", "the Arctic", "bread", "owls", "rivers", "teamwork"]


def passage_prompt(enc, task, text, length):
    """task with a passage cut from text so that the chat prompt is exactly `length` tokens (equal
    lengths batch together in generate()); None if no cut gives that length."""
    ids = enc.encode_ordinary(text)
    k = length - len(smollm.chat_tokens(enc, task.format(passage="")))
    for _ in range(4):  # a cut can merge with its neighbours: adjust and retry
        prompt = task.format(passage=enc.decode(ids[:k]))
        k -= len(smollm.chat_tokens(enc, prompt)) - length
        if len(smollm.chat_tokens(enc, prompt)) == length:
            return prompt
    return None


def instruction_prompts(enc, seed=0, shakespeare=384, general=640, held_out=12, passage_length=72):
    """(training prompts, held-out prompts). Held out: the three plays data.split_plays holds out for
    the tiny GPT (seed 0), and topics no training prompt mentions. Passage prompts all have
    passage_length tokens; the questions take a few lengths."""
    rng = random.Random(seed)
    plays = data.load_plays()
    train_plays, val_plays = data.split_plays(plays, n_val=3, seed=0)

    def shakespeare_prompts(names, count):
        prompts = []
        while len(prompts) < count:
            lines = plays[rng.choice(names)].splitlines()
            start = rng.randrange(len(lines) - 20)
            prompt = passage_prompt(enc, rng.choice(TASKS), "\n".join(lines[start:start + 20]).strip(), passage_length)
            prompts += [prompt] if prompt else []
        return prompts

    questions = [q.format(topic=t) for t in TOPICS for q in QUESTIONS]
    train = shakespeare_prompts(train_plays, shakespeare) + rng.sample(questions, general)
    held = shakespeare_prompts(val_plays, held_out) + [rng.choice(QUESTIONS).format(topic=t)
                                                       for t in HELD_OUT_TOPICS * (held_out // len(HELD_OUT_TOPICS))]
    return train, held


def same_length_batches(prompt_ids, max_batch):
    """Indices of prompts grouped by token length (generate takes equal-length prompts), at most max_batch each."""
    by_length = {}
    for i, ids in enumerate(prompt_ids):
        by_length.setdefault(len(ids), []).append(i)
    return [group[j:j + max_batch] for group in by_length.values() for j in range(0, len(group), max_batch)]


# ---------------------------------------------------------------------------------------- 2. distill

@torch.no_grad()
def distill(base, enc, prompts, n_new=ANSWER_TOKENS, max_batch=128):
    """The model's greedy answers, and every hidden state decoding computed on the way.

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
            seq = generate(base, idx, n_new, stop_tokens=stops)                 # (B, P+n), n <= n_new
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


# ---------------------------------------------------------------------------------------- 3. heads

def train_heads(model: MedusaModel, h, y, steps=400, lr=3e-3, batch=8, seed=0, save=None, resume_from=None):
    """Medusa-1 on stored hidden states: loss sum_k 0.8^k CE(head k at t, token t+k+1).

    The softmax runs over the V' tokens the texts use, a sampled softmax that makes the projection
    V/V' times cheaper. Tokens outside V' get no gradient, so decoding drafts from V' alone
    (model.draft_vocab). h and y stay on the CPU; each batch moves to the heads' device, where the
    products run in bf16 when it is native there. save/resume_from: as training.train_loop's.
    Returns (history, V' as token ids, on the CPU)."""
    device = model.base.lm_head.weight.device
    vocab = y[y >= 0].unique()                                                # (V',)
    index = torch.full((model.base.config.vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    targets = torch.where(y >= 0, index[y.clamp(min=0)], -100)                # (N, L) ids in 0..V'-1
    proj = torch.nn.Linear(h.size(-1), len(vocab), bias=False)
    proj.weight = torch.nn.Parameter(model.base.lm_head.weight[vocab.to(device)].detach(), requires_grad=False)  # (V', C)
    g = torch.Generator().manual_seed(seed)
    if resume_from is not None:
        g.set_state(resume_from["rng"])
    low = native_bf16(device)

    def loss_fn(step):
        rows = torch.randint(0, len(h), (batch,), generator=g)
        x = h[rows].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):  # bf16 products where they are native
            head_logits = torch.stack([head(x, proj) for head in model.heads])  # (K, B, L, V')
        loss, per_head = medusa_loss(head_logits.float(), targets[rows].to(device))
        return loss, {"head1": per_head[0]}  # tensors: train_loop reads them only when it logs

    params = [p for head in model.heads for p in head.parameters()]
    def save_with_rng(step, opt, history, done):  # a resumed run goes on to new batches
        if save is not None:
            save(step, opt, history, done, g)
    history, _ = train_loop("heads", [(params, 1.0)], loss_fn, steps, lr, save_with_rng, resume_from)
    return history, vocab


# ---------------------------------------------------------------------------------------- 4. tree

@torch.no_grad()
def head_accuracies(model: MedusaModel, h, y, start, ranks=10):
    """docs/medusa.md section 4 on distilled held-out answers: a[k][i] = how often head k's rank-i
    guess at position t is the token greedy decoding produced k+1 tokens later (t from the last prompt token)."""
    device, acc = model.base.lm_head.weight.device, []
    for k, head in enumerate(model.heads, start=1):
        hits = []
        for row in range(len(h)):  # one answer at a time: (L, V) logits, not (N, L, V)
            s = start[row]
            guesses = head(h[row, s:-k].to(device, torch.float32), model.base.lm_head).topk(ranks, -1).indices  # (L-s-k, ranks)
            actual = y[row, s + k:].to(device)                                         # (L-s-k,)
            hits.append((guesses == actual[:, None])[actual >= 0])                     # (m, ranks)
        acc.append(torch.cat(hits).float().mean(0).tolist())
    return acc


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


@torch.no_grad()
def draft_costs(model, vocab, repeats=21):
    """Milliseconds of one step's drafts (HeadStack: every head at one position), medians at the
    current threads: the heads and shared projection in fp32, in bf16 (model.draft_dtype), and in
    bf16 over the vocabulary the heads were trained on (model.draft_vocab)."""
    h = torch.randn(model.base.config.n_embd, device=model.base.lm_head.weight.device)
    saved, costs = (model.draft_dtype, model.draft_vocab), {}
    for name, dtype, subset in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                (f"bf16 over {len(vocab)} tokens", torch.bfloat16, vocab)):
        model.draft_dtype, model.draft_vocab = dtype, subset
        stack, times = HeadStack(model), []
        for _ in range(repeats):
            t0 = time.perf_counter()
            stack(h, len(model.heads))
            sync(h.device)
            times.append((time.perf_counter() - t0) * 1e3)
        costs[name] = statistics.median(times)
    model.draft_dtype, model.draft_vocab = saved
    return costs


def best_against_best(model, prompts, n_new, choices, threads, repeats=3):
    """Plain greedy against Medusa greedy, every thread count, interleaved, medians (measure.compare);
    rows as measure.summarise makes them: speedup = best Medusa tokens/s over best plain tokens/s."""
    modes = {"plain greedy": ("plain", {}), f"medusa greedy ({len(choices)}-node tree)": ("medusa", dict(choices=choices))}
    runs = measure.compare(model, prompts, n_new, modes, repeats, threads=threads)
    table = {name: measure.summarise(runs, name, "plain greedy", threads, n_new) for name in modes}
    for name in list(modes)[1:]:
        same = [a == b for t in threads for a, b in zip(runs[name, t]["outputs"], runs["plain greedy", t]["outputs"])]
        table[name]["greedy_identical"] = sum(same) / len(same)
    return table


# ---------------------------------------------------------------------------------------- all stages

def run(out="out/smollm2", device="cpu", threads=None, seed=0, resume=False, steps=None, lr=None,
        report_prompts=None, report_tokens=None):
    """Every stage, on `device`; writes OUT/medusa.pt (the heads only: the base comes from the wheel),
    the distillation cache and report.json. None: the defaults below (400 steps at lr 3e-3, 6 report
    prompts of 64 tokens). resume: continue heads training interrupted by Ctrl-C."""
    steps, lr = steps or 400, lr or 3e-3
    report_prompts, report_tokens = report_prompts or 6, report_tokens or 64
    device = torch.device(device)
    os.makedirs(out, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    t_start = time.time()
    torch.manual_seed(seed)
    fast = native_bf16(device)  # bf16 products are native here: a bf16 copy writes the training text
    reader = smollm.read_gguf()
    base, enc = smollm.load_smollm2(BLOCK_SIZE, reader).to(device), smollm.load_tokenizer(reader)
    model = MedusaModel(base, num_heads=NUM_HEADS, share_lm_head=True).eval()
    for p in base.parameters():
        p.requires_grad_(False)  # Medusa-1: the backbone and lm_head are frozen
    train_prompts, held_out = instruction_prompts(enc, seed)
    print(f"SmolLM2-135M-Instruct on {device}; prompts: {len(train_prompts)} for training, {len(held_out)} "
          f"held out (plays and topics)")

    t0 = time.time()
    cache = os.path.join(out, "distill.pt")
    key = {"prompts": train_prompts, "held_out": held_out, "n_new": ANSWER_TOKENS}
    if os.path.exists(cache) and (saved := read_checkpoint(cache))["key"] == key:
        (h, y, _), (val_h, val_y, val_start) = saved["train"], saved["held_out"]
        print(f"distill: reusing {cache}")
    else:
        # Training data only, so a bf16 copy may write it (faster where bf16 is native); the held-out
        # answers, which the tree is grown from, come from the fp32 model that decodes.
        writer = copy.deepcopy(base).to(torch.bfloat16) if fast else base
        h, y, start = distill(writer, enc, train_prompts)
        del writer
        val_h, val_y, val_start = distill(base, enc, held_out)
        save_checkpoint(cache, key=key, train=(h, y, start), held_out=(val_h, val_y, val_start))
        print(f"distill: {len(train_prompts)} answers of the model's own ({h.dtype}), {int((y >= 0).sum()):,} "
              f"positions with hidden states, in {time.time() - t0:.0f}s")

    t0 = time.time()
    path = os.path.join(out, "medusa.pt")
    drafter = {"kind": "medusa", "config": {"num_heads": NUM_HEADS, "share_lm_head": True}}
    settings = {"steps": steps, "lr": lr, "seed": seed}
    resume_from = None
    if resume and os.path.exists(path):
        resume_from = read_checkpoint(path, device)
        if resume_from.get("done", True) or resume_from.get("settings") != settings:
            raise ValueError(f"{path} is not an interrupted run with these settings: run without --resume")
        model.load_state_dict(resume_from["model"], strict=False)

    def save(step, opt, history, done, rng):
        save_checkpoint(path, base=SMOLLM2_BASE, drafter=drafter, model=drafter_state(model), settings=settings,
                        optimizer=opt.state_dict(), step=step, history=history, done=done, rng=rng.get_state())
        if not done:
            print(f"saved {path}; run again with --resume to continue")

    with torch.enable_grad():
        history, vocab = train_heads(model, h, y, steps=steps, lr=lr, seed=seed, save=save, resume_from=resume_from)
    accuracies = head_accuracies(model, val_h, val_y, val_start)
    print(f"heads: trained in {time.time() - t0:.0f}s (softmax over the {len(vocab)} tokens the answers use); "
          f"held-out top-1 " + " ".join(f"{a[0]:.2f}" for a in accuracies))

    # Drafts are proposals only: a bf16 copy of the projection reads half the bytes, its rows for the
    # V' trained tokens a fraction of them, and verification by the fp32 base keeps the output exact
    # (measured below: draft_costs).
    draft_cheaply(model, device)
    model.draft_vocab = vocab.to(device)
    order = grow_tree(accuracies, 64)
    prompts = [torch.tensor(smollm.chat_tokens(enc, p), device=device)
               for p in held_out[::max(1, len(held_out) // report_prompts)]][:report_prompts]
    costs = measure.measure_step_costs(model, order, prompts[0].cpu().numpy(), device, threads,
                                       sizes=[2, 4, 6, 8, 12, 16, 24, 32], repeats=2, n_new=32)
    chosen, tree_threads = measure.choose_tree(order, accuracies, costs)
    print(f"tree: {len(chosen)} nodes at {tree_threads} threads (expected "
          f"{expected_tokens_per_step(chosen, accuracies):.2f} tokens/step at "
          f"{costs[tree_threads]['relative'][len(chosen)]:.2f}x a plain step)")
    save_checkpoint(path, base=SMOLLM2_BASE, drafter=drafter, model=drafter_state(model), draft_vocab=vocab,
                    tokenizer={"kind": "smollm2"}, tree=[list(p) for p in chosen], accuracies=accuracies,
                    history=history, settings=settings, done=True)

    threads = measure.thread_counts(device, threads)  # 1 .. the number of cores, or the one asked for
    print(f"report: plain and Medusa greedy x {len(threads)} thread counts x {len(prompts)} held-out chat "
          f"prompts x {report_tokens} tokens, interleaved")
    table = best_against_best(model, prompts, report_tokens, chosen, threads, repeats=2)
    curve = forward_costs(base)
    drafts = draft_costs(model, vocab.to(device))
    report = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)", "device": str(device),
              "threads": threads, "prompts": len(prompts), "new_tokens": report_tokens,
              "tree": [list(p) for p in chosen], "accuracies": accuracies, "step_costs": costs, "modes": table,
              "forward_ms": curve, "draft_dtype": str(model.draft_dtype), "draft_vocab": len(vocab),
              "draft_ms": drafts, "plain_step_ms": costs[tree_threads]["plain_step_ms"],
              "total_seconds": time.time() - t_start}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("\n" + measure.format_table(report))
    print("one forward on a 100-token cache: " + ", ".join(f"{n} tokens {ms:.0f} ms ({ms / curve[1]:.2f}x)"
                                                           for n, ms in curve.items()))
    print("one step's drafts (4 heads, shared projection): " + ", ".join(f"{d} {ms:.1f} ms" for d, ms in drafts.items())
          + f"; decoding drafts in {model.draft_dtype} over {len(vocab)} tokens")
    print(f"total {time.time() - t_start:.0f}s; heads and report in {out}/")
    return report
