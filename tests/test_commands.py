"""The commands: every flag takes effect or is refused in one line, on every base, and a device this
machine or this torch build does not have is named, with what to install. CUDA and MPS are stood in
for on the CPU by patching what torch reports."""
import os
from pathlib import Path

import pytest
import torch

import ablation
import benchmark
import common
import sample
import train_heads
import warm

ROOT = Path(__file__).resolve().parents[1]


def fake_cuda(monkeypatch):
    """A torch that says it was built with CUDA and sees a GPU: parsing stands in for a CUDA machine."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_smollm2_takes_the_flags_that_apply_to_it(monkeypatch, tmp_path):
    """--base smollm2 hands its device, threads, seed, output folder, resume, drafter training steps
    and learning rate, and report sizes to the SmolLM2 run: nothing is dropped, the device included."""
    import smollm_heads
    fake_cuda(monkeypatch)
    got = {}
    monkeypatch.setattr(smollm_heads, "run", lambda out, **kw: got.update(out=out, **kw))
    train_heads.main(["--base", "smollm2", "--device", "cuda", "--threads", "1", "--seed", "3", "--resume",
                      "--out", str(tmp_path), "--head-steps", "7", "--head-lr", "0.01", "--report-prompts", "2",
                      "--report-tokens", "9"])
    assert got == dict(out=str(tmp_path / "smollm2"), device=torch.device("cuda"), threads=1, seed=3, resume=True,
                       drafters=["medusa"], steps=7, lr=0.01, eagle_steps=None, eagle_lr=None, report_prompts=2,
                       report_tokens=9)


@pytest.mark.parametrize("flag", [["--preset", "tiny"], ["--data", "x.txt"], ["--num-heads", "3"], ["--joint"],
                                  ["--base-steps", "10"], ["--vocab-size", "512"], ["--share-lm-head"]])
def test_smollm2_refuses_the_flags_of_the_tiny_gpt(flag):
    with pytest.raises(train_heads.UsageError, match=f"{flag[0]}: shapes the tiny GPT, not SmolLM2"):
        train_heads.parse_args(["--base", "smollm2"] + flag)


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--head-steps", "-1"], ["--report-tokens", "0"]])
def test_impossible_numbers_are_refused(argv):
    with pytest.raises(train_heads.UsageError, match="must be at least"):
        train_heads.parse_args(argv)


def test_a_missing_device_says_which_and_what_to_install(monkeypatch):
    """cuda on a torch built without CUDA, cuda with no GPU, mps off a Mac, and a name that is no device."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: this torch build .* has no CUDA; install a CUDA build"):
        common.pick_device("cuda")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no GPU"):
        common.pick_device("cuda")
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    with pytest.raises(ValueError, match="--device mps: this torch build .* has no MPS"):
        common.pick_device("mps")
    with pytest.raises(ValueError, match="--device gpu: not a device"):
        common.pick_device("gpu")
    fake_cuda(monkeypatch)
    assert common.pick_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match="has 1 CUDA GPU"):
        common.pick_device("cuda:3")


@pytest.mark.parametrize("main", [train_heads.main, benchmark.main, sample.main, ablation.main],
                         ids=["train_heads", "benchmark", "sample", "ablation"])
def test_every_command_refuses_a_device_it_does_not_have(main, monkeypatch, tmp_path):
    """Checked before anything is loaded or trained."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises((ValueError, train_heads.UsageError, sample.UsageError), match="--device cuda: this torch"):
        main(["--device", "cuda", "--out", str(tmp_path)])


@pytest.mark.parametrize("main", [train_heads.main, benchmark.main, sample.main, ablation.main],
                         ids=["train_heads", "benchmark", "sample", "ablation"])
def test_a_malformed_flag_is_a_value_error_not_a_usage_dump(main):
    """argparse's own complaints (a flag without its value, an unknown flag) come as ValueError, which every command
    prints as one line, `error: ...` (argparse would print its usage first, then the error)."""
    with pytest.raises(ValueError, match="argument --out: expected one argument"):
        main(["--out"])
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        main(["--no-such-flag"])


def test_sample_refuses_flags_that_would_do_nothing():
    for argv, message in ((["--chat", "hi"], "--chat talks to SmolLM2"),
                          (["--base", "smollm2", "--prompt", "x"], "SmolLM2 takes a --chat"),
                          (["--sampling", "exact"], "give a --temperature above 0"),
                          (["--tokens", "0"], "at least 1")):
        with pytest.raises(sample.UsageError, match=message):
            sample.parse_args(argv)


def test_a_users_mistake_is_one_line_and_a_nonzero_exit():
    env = {**os.environ, **common.FAST_MALLOC}  # set: the command starts once, not twice
    result = warm.run(["train_heads.py", "--base", "smollm2", "--preset", "tiny"], ROOT, env)
    assert result.returncode != 0
    assert result.stderr.startswith("error: --preset") and len(result.stderr.strip().splitlines()) == 1
