"""Drafters for SmolLM2-135M-Instruct, self-distilled on its own chat answers (`python train_heads.py --base smollm2`).

Stages, each printing what it measured:
  1. prompts   a few hundred offline instructions: Shakespeare passages (continue, explain, summarise, ...)
               and general questions; whole plays and topics held out for evaluation.
  2. distill   the model's own greedy answers, 128 prompts at a time, each ending at its stop token; the
               hidden states decoding computed on the way are kept (the backbone is frozen, so they are
               computed once, by the same forward that decodes). Where bf16 is native, a bf16 copy of the
               model writes them: they are only training data. The held-out answers come from the fp32
               model itself.
  3. drafters  Medusa-1 heads (one residual block each, projected through the frozen, shared lm_head)
               and an EAGLE layer, each trained on those states; both draft over the tokens they were
               trained on, in bf16 where it is native (model.draft_dtype, model.draft_vocab).
  4. trees     accuracies by depth on the held-out answers, a grown tree, its size chosen from measured
               step costs; EAGLE also drafts EAGLE-2's dynamic tree.
  5. report    plain decoding against every drafter on held-out chat prompts, each answer to its end
               (measure.run_report), best thread count against best; transformers' greedy and prompt-lookup
               decoding of the same GGUF file in the same rounds, where transformers is installed.
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
from eagle import DynamicTree, EagleModel, FeatureDrafter, chain_hits, eagle_generate, eagle_loss
from medusa_mini import MedusaDrafter, MedusaModel, generate, medusa_generate, medusa_loss
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


def instruction_prompts(enc, seed=0, shakespeare=768, general=1280, held_out=12, passage_length=72):
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

    # The held-out prompts first, so that they do not depend on how many training prompts are drawn.
    held = shakespeare_prompts(val_plays, held_out) + [rng.choice(QUESTIONS).format(topic=t)
                                                       for t in HELD_OUT_TOPICS * (held_out // len(HELD_OUT_TOPICS))]
    questions = [q.format(topic=t) for t in TOPICS for q in QUESTIONS]
    train = shakespeare_prompts(train_plays, shakespeare) + rng.sample(questions, general)
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


EAGLE_DEPTH = 6  # how deep EAGLE's trees may grow, and its accuracies are read
EAGLE_STEPS, EAGLE_LR = 3200, 1e-3  # at the heads' 3e-3 the Llama draft layer stalls; steps and text: docs/results.md


def train_eagle(model: EagleModel, h, y, vocab, steps=EAGLE_STEPS, lr=EAGLE_LR, batch=8, seed=0, save=None, resume_from=None):
    """EAGLE-1 on stored hidden states (eagle.eagle_loss): entry t is fed the feature at t and the token
    after it (y[:, t]), and predicts the feature at t + 1; both next-token distributions over the V'
    tokens the texts use (`vocab`). Entries count where the feature at t + 1 exists. h and y stay on
    the CPU; each batch moves to the layer's device, where products run in bf16 when it is native there."""
    device = model.base.lm_head.weight.device
    vocab_d = vocab.to(device)
    counts = (y[:, :-1] >= 0) & (y[:, 1:] >= 0)                              # (N, L-1): f_{t+1} exists
    positions = torch.arange(h.size(1), device=device)
    g = torch.Generator().manual_seed(seed)
    if resume_from is not None:
        g.set_state(resume_from["rng"])
    low = native_bf16(device)

    def loss_fn(step):
        rows = torch.randint(0, len(h), (batch,), generator=g)
        f = h[rows].to(device, torch.float32)                                  # (B, L, C)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
            loss, feature, token, agree = eagle_loss(model.eagle, model.base, f, y[rows].clamp(min=0).to(device),
                                                     positions, counts[rows].to(device), vocab_d)
        return loss, {"feature": feature, "top1": agree}

    def save_with_rng(step, opt, history, done):
        if save is not None:
            save(step, opt, history, done, g)
    history, _ = train_loop("eagle", [(list(model.eagle.parameters()), 1.0)], loss_fn, steps, lr, save_with_rng,
                            resume_from)
    return history


@torch.no_grad()
def eagle_accuracies(model: EagleModel, h, y, start, depth=6, ranks=10, vocab=None):
    """eagle.chain_accuracies on distilled held-out answers, one at a time (they differ in length): a[d][r]
    = how often the layer's rank-r draft at depth d + 1 is the answer's token, teacher-forced along
    the answer, counted from each answer's first token."""
    device = model.base.lm_head.weight.device
    totals = None
    for row in range(len(h)):
        n = int((y[row] >= 0).sum())                                          # positions with a next token
        seq = torch.cat([y.new_zeros(1), y[row, :n]]).to(device)              # seq[t + 1] = y[t]; seq[0] unused
        found = chain_hits(model, seq[None], int(start[row]), depth, ranks, h[row, None, :n].to(device),
                           None if vocab is None else vocab.to(device))
        totals = found if totals is None else [(a + b, m + n_) for (a, m), (b, n_) in zip(totals, found)]
    return [(hits / max(count, 1)).tolist() for hits, count in totals]


@torch.no_grad()
def feature_precision(model: EagleModel, h, y, start, first_tokens, vocab, depth=6):
    """Where bf16 is native, EAGLE's layer trains on a bf16 copy's features but drafts from the fp32
    features decoding computes. Its held-out top-1 by depth both ways, on the same answers: (fed the fp32
    features h, fed the bf16 copy's features of the same text). first_tokens (N,): each text's first
    token, which y (the tokens after each position) leaves out."""
    device = model.base.lm_head.weight.device
    low = copy.deepcopy(model.base).to(torch.bfloat16)
    h_low = torch.zeros_like(h)
    for row in range(len(h)):
        n = int((y[row] >= 0).sum())
        seq = torch.cat([first_tokens[row:row + 1], y[row, :n - 1]]).to(device)   # the text at positions 0..n-1
        h_low[row, :n] = low.hidden(seq[None])[0].to(h.dtype).cpu()
    return [[a[0] for a in eagle_accuracies(model, f, y, start, depth, vocab=vocab)] for f in (h, h_low)]


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


# ---------------------------------------------------------------------------------------- all stages

def best_threads(costs):
    """The thread counts at which plain decoding or some tree size steps fastest: where each side is at its best."""
    plain = min(costs, key=lambda t: costs[t]["plain_step_ms"])
    return sorted({plain} | {min(costs, key=lambda t: costs[t]["step_ms"][n]) for n in costs[plain]["step_ms"]})


def run(out="out/smollm2", device="cpu", threads=None, seed=0, resume=False, drafters=("medusa",), steps=None,
        lr=None, eagle_steps=None, eagle_lr=None, report_prompts=None, report_tokens=None):
    """Every stage, on `device`; writes OUT/medusa.pt and OUT/eagle.pt (the drafters only: the base comes
    from the wheel), the distillation cache and report.json. None: the defaults (heads 400 steps at lr
    3e-3; EAGLE: EAGLE_STEPS steps at EAGLE_LR; 6 report prompts of up to 64 tokens). resume: continue drafter
    training interrupted by Ctrl-C."""
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
    base.requires_grad_(False)  # the drafters train on a frozen base
    train_prompts, held_out = instruction_prompts(enc, seed)
    print(f"SmolLM2-135M-Instruct on {device}, drafters {', '.join(drafters)}; prompts: {len(train_prompts)} for "
          f"training, {len(held_out)} held out (plays and topics)")

    t0 = time.time()
    cache = os.path.join(out, "distill.pt")
    key = {"prompts": train_prompts, "held_out": held_out, "n_new": ANSWER_TOKENS}
    if os.path.exists(cache) and (saved := read_checkpoint(cache))["key"] == key:
        (h, y, _), (val_h, val_y, val_start) = saved["train"], saved["held_out"]
        print(f"distill: reusing {cache}")
    else:
        # Training data only, so a bf16 copy may write it (faster where bf16 is native); the held-out
        # answers, which the trees are grown from, come from the fp32 model that decodes.
        writer = copy.deepcopy(base).to(torch.bfloat16) if fast else base
        h, y, start = distill(writer, enc, train_prompts)
        del writer
        val_h, val_y, val_start = distill(base, enc, held_out)
        save_checkpoint(cache, key=key, train=(h, y, start), held_out=(val_h, val_y, val_start))
        print(f"distill: {len(train_prompts)} answers of the model's own ({h.dtype}), {int((y >= 0).sum()):,} "
              f"positions with hidden states, in {time.time() - t0:.0f}s")
    vocab = y[y >= 0].unique()  # (V',): the tokens the answers use; the drafters are trained and draft over them

    stops = smollm.stop_tokens(enc)
    prompts = [torch.tensor(smollm.chat_tokens(enc, p), device=device)
               for p in held_out[::max(1, len(held_out) // report_prompts)]][:report_prompts]
    drafted = []
    for name in drafters:
        model, seconds, history, accuracies = train_drafter(name, base, h, y, val_h, val_y, val_start, vocab, out,
                                                            seed, resume, steps if name == "medusa" else eagle_steps,
                                                            lr if name == "medusa" else eagle_lr)
        # Drafts are proposals only: a bf16 copy of the drafter's weights and of lm_head's rows for the V'
        # trained tokens read a fraction of the bytes, and verification by the fp32 base keeps the output exact.
        draft_cheaply(model, device)
        model.draft_vocab = vocab.to(device)
        decode = medusa_generate if name == "medusa" else eagle_generate
        order = grow_tree(accuracies, 64)
        costs = measure.measure_step_costs(model, order, None, device, threads, sizes=[2, 4, 6, 8, 12, 16],
                                           repeats=2, n_new=32, decode=decode, prompt=prompts[0])
        chosen, tree_threads = measure.choose_tree(order, accuracies, costs)
        print(f"{name} tree: {len(chosen)} nodes at {tree_threads} threads (expected "
              f"{expected_tokens_per_step(chosen, accuracies):.2f} tokens/step at "
              f"{costs[tree_threads]['relative'][len(chosen)]:.2f}x a plain step)")
        extra = {} if name == "medusa" else {
            "dynamic tree": DynamicTree(topk=min(4, len(chosen)), nodes=len(chosen), depth=min(EAGLE_DEPTH, len(chosen)))}
        path = os.path.join(out, f"{name}.pt")
        ckpt = read_checkpoint(path, device)
        ckpt.pop("format")
        ckpt.update(tree=[list(p) for p in chosen], accuracies=accuracies, step_costs=costs,
                    grown_order=[list(p) for p in order],
                    extra_trees={label: measure.tree_json(t) for label, t in extra.items()})
        save_checkpoint(path, **ckpt)
        parameters = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in base.parameters())
        drafted.append(measure.Drafted(name, model, decode, MedusaDrafter if name == "medusa" else FeatureDrafter,
                                       chosen, order, accuracies, costs, None, extra,
                                       {"seconds": seconds, "parameters": parameters}))

    precision = None
    if fast and "eagle" in drafters:  # trained on a bf16 copy's features, drafting from fp32 ones: does it cost?
        firsts = torch.tensor([smollm.chat_tokens(enc, p)[0] for p in held_out])
        eagle = next(d.model for d in drafted if d.name == "eagle")
        precision = dict(zip(("fp32", "bf16"), feature_precision(eagle, val_h, val_y, val_start, firsts, vocab,
                                                                 EAGLE_DEPTH)))
        print("eagle: held-out top-1 by depth fed the fp32 features decoding reads " +
              " ".join(f"{a:.3f}" for a in precision["fp32"]) + "; fed a bf16 copy's (as in training) " +
              " ".join(f"{a:.3f}" for a in precision["bf16"]))
    threads = best_threads(drafted[0].costs) if threads is None else [threads]
    peers = peer_modes(device)
    report = measure.run_report(drafted, prompts, report_tokens, threads, {"stop_tokens": stops}, peers,
                                ops=False, sweep=False, repeats=1)
    curve = forward_costs(base)
    report.update(model="SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)", device=str(device),
                  forward_ms=curve, draft_vocab=len(vocab), total_seconds=time.time() - t_start, preset="smollm2",
                  eagle_feature_precision=precision,
                  sample=enc.decode(report["sample"]), plain_step_ms=drafted[0].costs[threads[-1]]["plain_step_ms"])
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(measure.stamped(report), f, indent=1, default=str)
    print("\n" + measure.format_table(report))
    print("\n" + measure.format_drafters(report))
    print("one forward on a 100-token cache: " + ", ".join(f"{n} tokens {ms:.0f} ms ({ms / curve[1]:.2f}x)"
                                                           for n, ms in curve.items()))
    print(f"total {time.time() - t_start:.0f}s; drafters and report in {out}/")
    return report




def train_drafter(name, base, h, y, val_h, val_y, val_start, vocab, out, seed, resume, steps, lr):
    """One drafter trained on the distillation (or reused from OUT/name.pt when it was trained with the
    same settings), and its accuracies on the held-out answers. Returns (model, training seconds,
    history, accuracies)."""
    path = os.path.join(out, f"{name}.pt")
    steps = steps or (400 if name == "medusa" else EAGLE_STEPS)
    lr = lr or (3e-3 if name == "medusa" else EAGLE_LR)
    if name == "medusa":
        model = MedusaModel(base, num_heads=NUM_HEADS, share_lm_head=True).eval()
        drafter = {"kind": "medusa", "config": {"num_heads": NUM_HEADS, "share_lm_head": True}}
    else:
        model = EagleModel(base).eval()
        drafter = {"kind": "eagle", "config": {}}
    device = base.lm_head.weight.device
    settings = {"steps": steps, "lr": lr, "seed": seed, "distill": len(h)}
    resume_from = None
    if os.path.exists(path):
        ckpt = read_checkpoint(path, device)
        if ckpt.get("settings") == settings and (ckpt.get("done") or resume):
            model.load_state_dict(ckpt["model"], strict=False)
            if ckpt.get("done"):
                print(f"{name}: reusing {path}")
                return model, ckpt["seconds"], ckpt["history"], ckpt["accuracies"]
            resume_from = ckpt
    if resume and resume_from is None:
        raise ValueError(f"{path} is not an interrupted run with these settings: run without --resume")

    def save(step, opt, history, done, rng, **more):
        save_checkpoint(path, base=SMOLLM2_BASE, drafter=drafter, model=drafter_state(model), settings=settings,
                        tokenizer={"kind": "smollm2"}, draft_vocab=vocab, optimizer=opt.state_dict(), step=step,
                        history=history, done=done, rng=rng.get_state(), **more)
        if not done:
            print(f"saved {path}; run again with --resume to continue")

    t0 = time.time()
    with torch.enable_grad():
        if name == "medusa":
            history, _ = train_heads(model, h, y, steps=steps, lr=lr, seed=seed, save=save, resume_from=resume_from)
        else:
            history = train_eagle(model, h, y, vocab, steps=steps, lr=lr, seed=seed, save=save, resume_from=resume_from)
    seconds = time.time() - t0
    if name == "medusa":
        accuracies = head_accuracies(model, val_h, val_y, val_start)
    else:
        accuracies = eagle_accuracies(model, val_h, val_y, val_start, EAGLE_DEPTH, vocab=vocab)
    print(f"{name}: trained in {seconds:.0f}s; held-out top-1 by depth " + " ".join(f"{a[0]:.2f}" for a in accuracies))
    save_checkpoint(path, base=SMOLLM2_BASE, drafter=drafter, model=drafter_state(model), settings=settings,
                    tokenizer={"kind": "smollm2"}, draft_vocab=vocab, history=history, done=True, seconds=seconds,
                    accuracies=accuracies)
    return model, seconds, history, accuracies


def peer_modes(device):
    """transformers' greedy generate and its prompt-lookup decoding on the same GGUF file, as report
    modes, where transformers is installed (it is not a requirement of this project)."""
    import peers
    if not peers.available():
        print("report: transformers is not installed: no peer rows (pip install transformers accelerate)")
        return {}
    hf = peers.load_transformers_smollm2(device)
    return {"transformers greedy": (peers.transformers_greedy, dict(model=hf)),
            "transformers prompt lookup": (peers.transformers_prompt_lookup, dict(model=hf))}
