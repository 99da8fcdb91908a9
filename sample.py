"""Generate with the trained Medusa model and show which head proposed each token.

    python sample.py --prompt "ROMEO:"            # greedy, the tree chosen by train_heads.py
    python sample.py --prompt "ROMEO:" --compare  # also plain decoding, and both speeds
    python sample.py --base smollm2 --chat "Write a poem about the sea." --compare  # SmolLM2-135M-Instruct
"""
import argparse
import os
import sys
import time

import torch

from common import load_medusa, load_tokenizer, pick_device, sync
from medusa_mini import generate, medusa_generate

# Depth 0 (the base model's own token) plain; head k in its own colour.
COLOURS = ["", "\033[32m", "\033[34m", "\033[35m", "\033[33m", "\033[36m", "\033[31m"]
RESET = "\033[0m"


def coloured(enc, tokens, depths, colour):
    """The text with each token wrapped in its depth's colour (plain text when colour is False)."""
    pieces = []
    for token, depth in zip(tokens, depths):
        text = enc.decode([token])
        pieces.append(f"{COLOURS[min(depth, len(COLOURS) - 1)]}{text}{RESET}" if colour and depth else text)
    return "".join(pieces)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default="ROMEO:", help="text to continue")
    p.add_argument("--base", choices=["gpt", "smollm2"], default="gpt",
                   help="gpt: the Shakespeare GPT in OUT/; smollm2: SmolLM2-135M-Instruct and the heads in OUT/smollm2/")
    p.add_argument("--chat", default="Write a poem about the sea.", help="with --base smollm2: the user's message")
    p.add_argument("--out", default="out", help="folder holding heads.pt from train_heads.py")
    p.add_argument("--tokens", type=int, default=200, help="new tokens (cut to what fits in the context)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--sampling", choices=["typical", "exact"], default="typical",
                   help="with temperature > 0: typical acceptance (fast) or exact (the model's distribution)")
    p.add_argument("--compare", action="store_true", help="also run plain decoding and print both speeds")
    p.add_argument("--device", help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling")
    args = p.parse_args()

    path = os.path.join(args.out, "heads.pt")
    device = pick_device(args.device)
    if args.base == "smollm2":
        import smollm_heads
        model, ckpt, enc, prompt = smollm_heads.load_chat(os.path.join(args.out, "smollm2"), args.chat, device)
    else:
        model, ckpt = load_medusa(path, device)
        if "tree" not in ckpt:
            raise ValueError(f"{path} has no tree yet: run train_heads.py to the end first")
        enc = load_tokenizer(ckpt["tokenizer"])
        prompt = enc.encode_ordinary(args.prompt)
    idx = torch.tensor([prompt], device=next(model.parameters()).device)
    room = model.base.config.block_size - idx.size(1)
    if room < 1:
        raise ValueError(f"the prompt is {idx.size(1)} tokens; the model's context is {model.base.config.block_size}")
    n = min(args.tokens, room)
    exact = args.temperature > 0 and args.sampling == "exact"  # the tree grown for sampling, where there is one
    tree = [tuple(path) for path in ckpt["sampling_tree" if exact and "sampling_tree" in ckpt else "tree"]]

    if args.compare:  # warm up both paths once, so neither timing pays first-call costs
        generate(model, idx, min(n, 4))
        medusa_generate(model, idx, min(n, 4), tree)
    torch.manual_seed(args.seed)
    sync(device)
    t0 = time.perf_counter()
    out, stats = medusa_generate(model, idx, n, tree, args.temperature, args.sampling)
    sync(device)
    medusa_s = time.perf_counter() - t0
    colour = sys.stdout.isatty()
    new = out[0, idx.size(1):].tolist()
    if args.base == "smollm2":  # the answer ends at <|im_end|>; decoding ran on for the same n tokens as plain
        end = enc.encode_single_token("<|im_end|>")
        new = new[:new.index(end)] if end in new else new
    print(enc.decode(idx[0].tolist()) + coloured(enc, new, stats.token_depths, colour))
    if colour:
        print("\ncolours: plain = base model, " + ", ".join(f"{COLOURS[k]}head {k}{RESET}" for k in range(1, len(model.heads) + 1)))
    print(f"\nmedusa: {n} tokens in {stats.steps} steps ({stats.tokens_per_step:.2f} tokens/step, "
          f"{len(tree)}-node tree), {n / medusa_s:.0f} tokens/s")
    if args.compare:
        torch.manual_seed(args.seed)
        sync(device)
        t0 = time.perf_counter()
        plain = generate(model, idx, n, args.temperature)
        sync(device)
        plain_s = time.perf_counter() - t0
        same = " (identical output)" if args.temperature == 0 and torch.equal(plain, out) else ""
        print(f"plain:  {n} tokens in {n} steps, {n / plain_s:.0f} tokens/s; medusa is {plain_s / medusa_s:.2f}x{same}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a missing, corrupt or foreign checkpoint, a prompt too long: one line
        sys.exit(f"error: {e}")
