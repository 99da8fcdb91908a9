"""The commands: every flag takes effect or is refused in one line, on every base, and a device this
machine or this torch build does not have is named, with what to install. CUDA and MPS are stood in
for on the CPU by patching what torch reports."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ablation
import benchmark
import sample
import train_heads
from lab import cli, devices, malloc, pipeline
from lab.cli import UsageError
from lab.config import SmolRun

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"train_heads": train_heads.main, "benchmark": benchmark.main, "sample": sample.main,
            "ablation": ablation.main}


def fake_cuda(monkeypatch, bf16=True):
    """A torch that says it was built with CUDA and sees a GPU (with bf16 tensor cores, or without, as a T4):
    parsing stands in for a CUDA machine."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


def test_smollm2_takes_the_flags_that_apply_to_it(monkeypatch, tmp_path):
    """--base smollm2 hands its device, threads, seed, output folder, resume, drafter training steps
    and learning rate, and report sizes to the SmolLM2 run: nothing is dropped, the device included."""
    fake_cuda(monkeypatch)
    got = {}
    monkeypatch.setattr(pipeline, "run", lambda run, **kw: got.update(run=run))
    train_heads.main(["--base", "smollm2", "--device", "cuda", "--threads", "1", "--seed", "3", "--resume",
                      "--out", str(tmp_path), "--head-steps", "7", "--head-lr", "0.01", "--report-prompts", "2",
                      "--report-tokens", "9"])
    assert got["run"] == SmolRun(out=str(tmp_path / "smollm2"), device=torch.device("cuda"), threads=1, seed=3,
                                 resume=True, drafters=("medusa",), head_steps=7, head_lr=0.01, report_prompts=2,
                                 report_tokens=9, dtype="bfloat16")  # --dtype auto, on a GPU with bf16


def test_the_command_times_its_trees_and_report_in_a_fresh_process(monkeypatch, tmp_path):
    """Where the pipeline stops after training (it returns None), train_heads.py runs itself again, the same
    flags, marked as the command's second process; that one, and a command that trained nothing, report where
    they are. docs/results.md ("The report in a fresh process") says why."""
    calls, execs = [], []
    monkeypatch.setattr(pipeline, "run", lambda run, report_here=True: calls.append(report_here) or None)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: execs.append((argv, env)))
    monkeypatch.delenv(pipeline.STARTED, raising=False)
    monkeypatch.setattr(sys, "argv", ["train_heads.py", "--preset", "tiny", "--out", str(tmp_path)])
    train_heads.main(sys.argv[1:], fresh_report=True)
    assert calls == [False] and len(execs) == 1
    argv, env = execs[0]
    assert argv[1:] == sys.argv and pipeline.STARTED in env
    monkeypatch.setenv(pipeline.STARTED, env[pipeline.STARTED])  # the second process: it reports here
    train_heads.main(sys.argv[1:], fresh_report=True)
    assert calls == [False, True] and len(execs) == 1
    monkeypatch.delenv(pipeline.STARTED)
    train_heads.main(sys.argv[1:])  # called as a function (a test, a notebook): always here
    assert calls[-1] is True and len(execs) == 1


@pytest.mark.parametrize("base", ["gpt", "smollm2"])
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_dtype_reaches_the_run_and_auto_says_what_it_picked(monkeypatch, capsys, tmp_path, base, dtype):
    """train_heads.py --dtype: the run decodes in the dtype asked, or auto's pick (a T4 stand-in: float32,
    no bf16 tensor cores), printed with its reason."""
    fake_cuda(monkeypatch, bf16=False)
    got = {}
    monkeypatch.setattr(pipeline, "run", lambda run, **kw: got.update(run=run))
    train_heads.main(["--base", base, "--device", "cuda", "--dtype", dtype, "--out", str(tmp_path)])
    expected = "float32" if dtype == "auto" else dtype
    assert got["run"].dtype == expected
    said = capsys.readouterr().out
    assert f"decoding in {expected} (" in said
    if dtype == "auto":
        assert ("no bf16 tensor cores" if base == "smollm2" else "tiny GPT decodes in float32") in said


@pytest.mark.parametrize("flag", [["--preset", "tiny"], ["--data", "x.txt"], ["--num-heads", "3"], ["--joint"],
                                  ["--base-steps", "10"], ["--vocab-size", "512"], ["--share-lm-head"]])
def test_smollm2_refuses_the_flags_of_the_tiny_gpt(flag):
    with pytest.raises(UsageError, match=f"{flag[0]}: shapes the tiny GPT, not SmolLM2"):
        train_heads.parse_args(["--base", "smollm2"] + flag)


def test_a_missing_device_says_which_and_what_to_install(monkeypatch):
    """cuda on a torch built without CUDA, cuda with no GPU, mps off a Mac, a name that is no device, and
    an index this machine does not have (cpu:7, cuda:99): refused before anything runs."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(UsageError, match="--device cuda: this torch build .* has no CUDA; install a CUDA build"):
        devices.pick_device("cuda")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="sees no GPU"):
        devices.pick_device("cuda")
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    with pytest.raises(UsageError, match="--device mps: this torch build .* has no MPS"):
        devices.pick_device("mps")
    for garbage in ("gpu", "cuda:x", "", "cpu:-1"):
        with pytest.raises(UsageError, match="not a device"):
            devices.pick_device(garbage)
    with pytest.raises(UsageError, match="the CPU is one device"):
        devices.pick_device("cpu:7")
    fake_cuda(monkeypatch)
    assert devices.pick_device("cuda") == torch.device("cuda")
    with pytest.raises(UsageError, match="has 1 CUDA GPU"):
        devices.pick_device("cuda:99")
    assert devices.pick_device("cpu:0") == devices.pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_refuses_a_device_it_does_not_have(name, monkeypatch, tmp_path):
    """Checked before anything is loaded or trained."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(UsageError, match="--device cuda: this torch"):
        COMMANDS[name](["--device", "cuda", "--out", str(tmp_path)])


@pytest.mark.parametrize("name", COMMANDS)
def test_a_malformed_flag_is_one_line_not_a_usage_dump(name):
    """argparse's own complaints (a flag without its value, an unknown flag, an empty string) are a
    UsageError, which every command prints as one line, `error: ...`, exit status 2."""
    with pytest.raises(UsageError, match="argument --out: expected one argument"):
        COMMANDS[name](["--out"])
    with pytest.raises(UsageError, match="unrecognized arguments: --no-such-flag"):
        COMMANDS[name](["--no-such-flag"])
    with pytest.raises(UsageError, match="--out: must not be empty"):
        COMMANDS[name](["--out", ""])


def test_sample_refuses_flags_that_would_do_nothing():
    for argv, message in ((["--chat", "hi"], "--chat is how SmolLM2 takes its prompt"),
                          (["--base", "smollm2", "--prompt", "x"], "SmolLM2 takes --chat"),
                          (["--sampling", "exact"], "give a --temperature above 0"),
                          (["--tokens", "0"], "must be from 1")):
        with pytest.raises(UsageError, match=message):
            sample.parse_args(argv)


def test_finish_tells_a_users_mistake_from_a_bug(capsys):
    """cli.finish: a UsageError exits 2 and a RunError 1, each one line; Ctrl-C is 130; any other exception
    keeps its traceback (it is raised)."""
    def raising(error):
        def main(argv=None):
            raise error
        return main
    assert cli.finish(raising(UsageError("--x 3: bad"))) == 2
    assert cli.finish(raising(cli.RunError("out/medusa.pt: held"))) == 1
    assert cli.finish(raising(KeyboardInterrupt())) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["error: --x 3: bad", "error: out/medusa.pt: held"]
    with pytest.raises(ValueError, match="cannot convert"):
        cli.finish(raising(ValueError("cannot convert float NaN to integer")))
    with pytest.raises(NotImplementedError):  # a bug
        cli.finish(raising(NotImplementedError("subclass me")))


def test_a_users_mistake_is_one_line_and_exit_status_2():
    """Run as a user runs it: one line on stderr, status 2."""
    env = {**os.environ, **malloc.FAST_MALLOC}  # set: the command starts once, not twice
    result = subprocess.run([sys.executable, "train_heads.py", "--base", "smollm2", "--preset", "tiny"], cwd=ROOT,
                            env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --preset") and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", [["--mtp", "1"], ["--eagle-budget"]])
def test_ablations_that_do_not_decode_refuse_dtype(flag):
    """--dtype takes effect where an ablation decodes (the shared lm_head, EAGLE's loss) and is refused where it
    judges training alone."""
    with pytest.raises(UsageError, match="--dtype: .* judges what training gives"):
        ablation.parse_args(flag + ["--dtype", "bfloat16"])


@pytest.mark.parametrize("drafter", ["medusa", "eagle", "eagle3"])
def test_breakdown_times_each_drafter(drafter, capsys):
    """What benchmark.py --breakdown runs (lab.breakdown), on each drafter of a small random GPT, EAGLE-3's
    fused taps included (its timed wrapper once dropped them, and the tree pass read the wrong features)."""
    from conftest import tiny_config
    from lab import breakdown, drafters
    from medusa_mini import GPT
    torch.manual_seed(0)
    kind = drafters.get(drafter)
    base = GPT(tiny_config())
    model = (kind.model(base, draft_vocab_size=8) if drafter == "eagle3" else kind.model(base)).eval()
    if drafter == "eagle3":
        model.set_vocab(torch.arange(8))
    got = breakdown.breakdown(kind, model, torch.tensor([[1, 2, 3, 4]]), [(0,), (0, 0)], n_new=8, rounds=1)
    assert got["tokens_per_step"] >= 1 and "drafting" in capsys.readouterr().out
