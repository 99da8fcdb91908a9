"""Export a drafter trained for SmolLM2 in the format a serving engine loads (docs/export.md).

    python export.py --drafter medusa --format vllm --to export/medusa-vllm        # vLLM's Medusa
    python export.py --drafter eagle --format sglang --to export/eagle-sglang      # SGLang's EAGLE
    python export.py --drafter eagle --format reference --to DIR --dtype bfloat16  # SafeAILab/EAGLE

It writes config.json, the weights the target reads and a README.md saying what the drafter was trained
on, the tree it was chosen for and the command that serves it. A format that lacks a feature of the
drafter (an fc bias, a truncated vocabulary) is refused in one line that names it.
"""
import os
import sys

from lab import bases, checkpoints, cli, drafters, folder, runs
from lab import formats as exporting
from lab.cli import RunError, UsageError
from lab.tree_choice import trees_of


def formats() -> list[str]:
    """Every format some drafter of the registry is exported to (or refused for)."""
    return sorted({fmt for kind in drafters.REGISTRY.values() for fmt in kind.exports})


def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=cli.text, default="out/smollm2",
                   help="the folder `train_heads.py --base smollm2` wrote (default: out/smollm2)")
    p.add_argument("--drafter", choices=drafters.names(), default="medusa",
                   help="which trained drafter: OUT/DRAFTER.pt (default medusa)")
    p.add_argument("--format", choices=formats(), required=True,
                   help="vllm (vLLM), sglang (SGLang) or reference (FasterDecoding/Medusa, SafeAILab/EAGLE)")
    p.add_argument("--to", type=cli.text, required=True, help="the folder to write (new or empty, unless --force)")
    p.add_argument("--dtype", choices=sorted(exporting.DTYPES), default="float32",
                   help="the weights' dtype (default float32, as trained; engines cast to the dtype they serve in)")
    p.add_argument("--force", action="store_true", help="replace the files of an earlier export in --to")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    kind = drafters.get(args.drafter)
    if not kind.exports:
        raise UsageError(f"--drafter {kind.name}: no serving format takes this drafter (its registry entry lists none; "
                         f"docs/export.md says why); drafters that export: "
                         f"{', '.join(n for n, k in drafters.REGISTRY.items() if k.exports)}")
    if args.format not in kind.exports:
        raise UsageError(f"--format {args.format}: not a format of the {kind.name} drafter ({', '.join(kind.exports)})")
    target = kind.exports[args.format]
    if target.convert is None:
        raise UsageError(f"--drafter {kind.name} --format {args.format}: refused: {target.refusal}")
    exporting.check_target(args.to, args.force)
    folder.check_writable(args.to, keep=False)  # a read-only or full --to: one line now, before the model loads

    path = os.path.join(args.out, f"{kind.name}.pt")
    served = [b for b in bases.REGISTRY.values() if b.serving]
    rerun = " or ".join(runs.rerun_command(b, kind.name) for b in served)
    ckpt = checkpoints.load(path, rerun=rerun)
    base_kind = bases.of_checkpoint(ckpt, path)
    if not base_kind.serving:
        raise RunError(f"{path} holds a drafter for {base_kind.label}, which no serving engine serves: export takes "
                       f"the drafters of {', '.join(b.label for b in served)} (`{rerun}`)")
    try:
        trees = trees_of(ckpt, args.dtype, path)
    except KeyError:
        raise RunError(f"{path} has no tree yet: run `{rerun}` to the end first") from None
    del ckpt
    model, ckpt = runs.load_model(path, "cpu", kind.name, base_kind)
    written, serve = exporting.export(kind.name, args.format, target, model, ckpt, trees, args.to, args.dtype, path)
    print(f"{kind.name} -> {target.engine}: wrote {', '.join(written)} in {args.to}/ ({args.dtype})")
    print(f"serve it with (not run here; {args.to}/README.md says what it was written against):\n  {serve}")


if __name__ == "__main__":
    sys.exit(cli.finish(main))
