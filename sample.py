"""Generate with a trained drafter and show which depth of the tree proposed each token.

    python sample.py --prompt "ROMEO:"            # greedy, the tree chosen by train_heads.py
    python sample.py --prompt "ROMEO:" --compare  # also plain decoding, and both speeds
    python sample.py --base smollm2 --chat "Write a haiku about owls." --compare  # SmolLM2-135M-Instruct
"""
import codecs
import os
import sys

import torch

from lab import bases, cli, drafters, runs, timing
from lab.cli import RunError, UsageError
from lab.devices import pick_device
from lab.dtypes import add_dtype_flag, decoding_copy, decoding_dtype, draft_cheaply, dtype_name
from lab.tree_choice import tree_label, trees_of
from medusa_mini import generate
from verify import SAMPLING

# Depth 0 (the base model's own token) plain; depth k in its own colour.
COLOURS = ["", "\033[32m", "\033[34m", "\033[35m", "\033[33m", "\033[36m", "\033[31m"]
RESET = "\033[0m"


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
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", choices=bases.names(), default=bases.names()[0],
                   help="gpt (default): the Shakespeare GPT in OUT/; smollm2: SmolLM2-135M-Instruct, drafters in OUT/smollm2/")
    p.add_argument("--prompt", type=cli.text, help="with the GPT: text to continue (default: ROMEO:)")
    p.add_argument("--chat", type=cli.text, help="with --base smollm2: the user's message (default: Write a poem about the sea.)")
    p.add_argument("--drafter", choices=drafters.names(), default="medusa", help="which trained drafter drafts")
    p.add_argument("--out", type=cli.text, default="out", help="folder train_heads.py wrote")
    p.add_argument("--tokens", type=cli.integer(1, 100_000), default=200,
                   help="new tokens at most (cut to what fits in the context; a chat answer ends at its end)")
    p.add_argument("--temperature", type=cli.number(0, 100), default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--sampling", choices=SAMPLING,
                   help="with --temperature > 0: typical (the paper's acceptance, sampled root; the default), "
                        "typical-fast (argmax root, deterministic) or exact (the model's own distribution)")
    p.add_argument("--compare", action="store_true", help="also time plain decoding, and print both speeds")
    p.add_argument("--device", type=cli.text, help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--seed", type=cli.integer(0, 2**31 - 1), default=0, help="seed for sampling")
    add_dtype_flag(p)
    args = p.parse_args(argv)
    args.base = bases.get(args.base)
    for flag, value in (("--prompt", args.prompt), ("--chat", args.chat)):
        if value is not None and flag != args.base.prompt_flag:
            takes = " and ".join(b.label for b in bases.REGISTRY.values() if b.prompt_flag == flag)
            raise UsageError(f"{flag} is how {takes} takes its prompt: {args.base.label} takes {args.base.prompt_flag} "
                             f"(--base chooses the base)")
    if args.sampling is not None and args.temperature == 0:
        raise UsageError("--sampling chooses how to sample: give a --temperature above 0 with it")
    args.sampling = args.sampling or "typical"
    args.device = pick_device(args.device)
    return args


def main(argv=None):
    args = parse_args(argv)
    kind, base_kind = drafters.get(args.drafter), args.base
    out, hint = runs.drafters_folder(args.out, base_kind)
    path = os.path.join(out, f"{args.drafter}.pt")
    if hint and not os.path.exists(path):
        raise RunError(f"{path} not found{hint}")
    model, ckpt = runs.load_model(path, args.device, args.drafter, base_kind)
    dtype, why = decoding_dtype(args.dtype, args.device, base_kind)  # said after the text
    model = draft_cheaply(decoding_copy(model, dtype), args.device, base_kind)
    try:
        trees = trees_of(ckpt, dtype, path)
    except KeyError:
        raise RunError(f"{path} has no tree yet: run train_heads.py to the end first") from None
    enc = runs.load_tokenizer(path, ckpt)
    message = getattr(args, base_kind.prompt_flag.removeprefix("--")) or base_kind.default_prompt
    prompt, stops = base_kind.prompt(enc, message), base_kind.stop_tokens(enc)
    if not prompt:
        raise UsageError(f"{base_kind.prompt_flag} {message!r}: no tokens")
    idx = torch.tensor([prompt], device=args.device)
    room = model.base.config.block_size - idx.size(1)
    if room < 1:
        raise UsageError(f"the prompt is {idx.size(1)} tokens; the model's context is {model.base.config.block_size}")
    n = min(args.tokens, room)
    exact = args.temperature > 0 and args.sampling == "exact"  # the tree grown for sampling, where there is one
    tree = trees.sampling_tree if exact and trees.sampling_tree is not None else trees.tree

    def run(stream=None):
        return kind.generate(model, idx, n, tree, args.temperature, args.sampling, stop_tokens=stops, stream=stream)

    colour = sys.stdout.isatty()
    print(base_kind.show_prompt(message), end="", flush=True)
    printer = Printer(enc, colour, stops or ())
    torch.manual_seed(args.seed)
    seconds, (out, stats) = timing.timed(lambda: run(printer), args.device)
    new = out.size(1) - idx.size(1)
    print()
    if colour:
        print("\ncolours: plain = the base model's own token; " +
              ", ".join(f"{COLOURS[k]}depth {k}{RESET}" for k in range(1, 1 + max(printer.depths))))
    print(f"\n{args.drafter}: {new} tokens in {stats.steps} steps ({stats.tokens_per_step:.2f} tokens/step, "
          f"tree: {tree_label(tree)}), {new / seconds:.0f} tokens/s as printed; decoding in "
          f"{dtype_name(dtype)} ({why})")
    if args.compare:  # both timed without printing, after a warm-up, the same seed for each
        run(), generate(model, idx, min(n, 4), args.temperature)
        torch.manual_seed(args.seed)
        drafted_s, (drafted_out, _) = timing.timed(run, args.device)
        torch.manual_seed(args.seed)
        plain_s, plain = timing.timed(lambda: generate(model, idx, n, args.temperature, stop_tokens=stops), args.device)
        d_new, p_new = drafted_out.size(1) - idx.size(1), plain.size(1) - idx.size(1)
        same = " (identical output)" if args.temperature == 0 and torch.equal(plain, drafted_out) else ""
        print(f"timed again without printing: {args.drafter} {d_new} tokens, {d_new / drafted_s:.0f} tokens/s; "
              f"plain {p_new} tokens, {p_new / plain_s:.0f} tokens/s; {args.drafter} is "
              f"{(d_new / drafted_s) / (p_new / plain_s):.2f}x{same}")


if __name__ == "__main__":
    sys.exit(cli.finish(main))
