"""Generate with a trained drafter and show which depth of the tree proposed each token.

    python sample.py --prompt "ROMEO:"            # greedy, the tree chosen by train_heads.py
    python sample.py --prompt "ROMEO:" --compare  # also plain decoding, and both speeds
    python sample.py --base smollm2 --chat "Write a haiku about owls." --compare  # SmolLM2-135M-Instruct
"""
import codecs
import os
import sys
import time

import torch

import grading
from common import GENERATE, ArgumentParser, load_model, load_tokenizer, pick_device, sync
from eagle import as_tree
from measure import tree_label
from medusa_mini import generate
from verify import SAMPLING

# Depth 0 (the base model's own token) plain; depth k in its own colour.
COLOURS = ["", "\033[32m", "\033[34m", "\033[35m", "\033[33m", "\033[36m", "\033[31m"]
RESET = "\033[0m"


class UsageError(Exception):
    """A mistake on the command line: printed as one line, `error: ...`."""


class Printer:
    """Prints committed tokens as they come, each in the colour of the depth that drafted it; bytes
    of a character split across tokens wait for the rest."""

    def __init__(self, enc, colour, stop_tokens=()):
        self.enc, self.colour, self.stop = enc, colour, set(stop_tokens)
        self.text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.depths = []

    def __call__(self, tokens):  # one step's tokens: depth 0 (the root), then 1, 2, ...
        for depth, token in enumerate(tokens):
            self.depths.append(depth)
            if token in self.stop:
                continue
            piece = self.text.decode(self.enc.decode_bytes([token]))
            print(f"{COLOURS[min(depth, len(COLOURS) - 1)]}{piece}{RESET}" if self.colour and depth else piece,
                  end="", flush=True)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", choices=["gpt", "smollm2"],
                   help="gpt (default): the Shakespeare GPT in OUT/; smollm2: SmolLM2-135M-Instruct, drafters in OUT/smollm2/")
    p.add_argument("--prompt", help="with the GPT: text to continue (default: ROMEO:)")
    p.add_argument("--chat", help="with --base smollm2: the user's message (default: Write a poem about the sea.)")
    p.add_argument("--drafter", choices=sorted(GENERATE), default="medusa", help="which trained drafter drafts")
    p.add_argument("--out", default="out", help="folder train_heads.py wrote")
    p.add_argument("--tokens", type=int, default=200,
                   help="new tokens at most (cut to what fits in the context; a chat answer ends at its end)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--sampling", choices=SAMPLING,
                   help="with --temperature > 0: typical (the paper's acceptance, sampled root; the default), "
                        "typical-fast (argmax root, deterministic) or exact (the model's own distribution)")
    p.add_argument("--compare", action="store_true", help="also time plain decoding, and print both speeds")
    p.add_argument("--device", help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling")
    args = p.parse_args(argv)
    args.base = args.base or "gpt"
    if args.base == "gpt" and args.chat is not None:
        raise UsageError("--chat talks to SmolLM2: add --base smollm2 (the GPT continues a --prompt)")
    if args.base == "smollm2" and args.prompt is not None:
        raise UsageError("--prompt continues the GPT's text: SmolLM2 takes a --chat message")
    if args.sampling is not None and args.temperature == 0:
        raise UsageError("--sampling chooses how to sample: give a --temperature above 0 with it")
    if args.tokens < 1:
        raise UsageError(f"--tokens {args.tokens}: must be at least 1")
    if args.temperature < 0:
        raise UsageError(f"--temperature {args.temperature}: must be at least 0")
    args.sampling = args.sampling or "typical"
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return args


def timed(fn, device):
    torch.manual_seed(0)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def main(argv=None):
    args = parse_args(argv)
    grading.require(["1", "2", "3", "4"] + (["6"] if args.drafter != "medusa" else []), "sample.py")
    folder = os.path.join(args.out, "smollm2") if args.base == "smollm2" else args.out
    model, ckpt = load_model(os.path.join(folder, f"{args.drafter}.pt"), args.device, args.drafter, args.base)
    if "tree" not in ckpt:
        raise ValueError(f"{folder}/{args.drafter}.pt has no tree yet: run train_heads.py to the end first")
    enc = load_tokenizer(ckpt["tokenizer"])
    if args.base == "smollm2":
        import smollm
        message = args.chat or "Write a poem about the sea."
        prompt, stops = smollm.chat_tokens(enc, message), smollm.stop_tokens(enc)
    else:
        message = args.prompt or "ROMEO:"
        prompt, stops = enc.encode_ordinary(message), None
    idx = torch.tensor([prompt], device=args.device)
    room = model.base.config.block_size - idx.size(1)
    if room < 1:
        raise ValueError(f"the prompt is {idx.size(1)} tokens; the model's context is {model.base.config.block_size}")
    n = min(args.tokens, room)
    exact = args.temperature > 0 and args.sampling == "exact"  # the tree grown for sampling, where there is one
    tree = as_tree(ckpt["sampling_tree" if exact and ckpt.get("sampling_tree") else "tree"])
    drafted = GENERATE[args.drafter]

    def run(stream=None):
        return drafted(model, idx, n, tree, args.temperature, args.sampling, stop_tokens=stops, stream=stream)

    colour = sys.stdout.isatty()
    print(f"user: {message}\nassistant: " if args.base == "smollm2" else message, end="", flush=True)
    printer = Printer(enc, colour, stops or ())
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    out, stats = run(printer)
    seconds = time.perf_counter() - t0
    new = out.size(1) - idx.size(1)
    print()
    if colour:
        print("\ncolours: plain = the base model's own token; " +
              ", ".join(f"{COLOURS[k]}depth {k}{RESET}" for k in range(1, 1 + max(printer.depths))))
    print(f"\n{args.drafter}: {new} tokens in {stats.steps} steps ({stats.tokens_per_step:.2f} tokens/step, "
          f"tree: {tree_label(tree)}), {new / seconds:.0f} tokens/s as printed")
    if args.compare:  # both timed without printing, after a warm-up, the same seed for each
        run(), generate(model, idx, min(n, 4), args.temperature)
        (drafted_out, _), drafted_s = timed(run, args.device)
        plain, plain_s = timed(lambda: generate(model, idx, n, args.temperature, stop_tokens=stops), args.device)
        d_new, p_new = drafted_out.size(1) - idx.size(1), plain.size(1) - idx.size(1)
        same = " (identical output)" if args.temperature == 0 and torch.equal(plain, drafted_out) else ""
        print(f"timed again without printing: {args.drafter} {d_new} tokens, {d_new / drafted_s:.0f} tokens/s; "
              f"plain {p_new} tokens, {p_new / plain_s:.0f} tokens/s; {args.drafter} is "
              f"{(d_new / drafted_s) / (p_new / plain_s):.2f}x{same}")


if __name__ == "__main__":
    try:
        main()
    except (UsageError, ValueError) as e:  # flags, a missing or foreign checkpoint, a prompt too long: one line
        sys.exit(f"error: {e}")
