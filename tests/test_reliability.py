"""Nothing a user trained is lost, and every mistake is one line (docs/reliability.md lists the promises).

One tiny-preset run with Medusa and EAGLE is trained once (`finished`); each test works on a copy of its
folder, or trains a short run of its own. The bad-input cases of a command run in this process, one
after another, and leave the folder as they found it."""
import errno
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmark
import sample
import train_heads
from lab import checkpoints, cli, folder, gpt_stages, train, train_drafters
from lab.checkpoints import Checkpoint
from lab.cli import RunError, UsageError

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--preset", "tiny", "--threads", "1", "--base-steps", "30", "--head-steps", "20", "--report-prompts", "1",
         "--report-tokens", "8"]
BOTH = ["--drafters", "medusa,eagle", "--eagle-steps", "20"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    train_heads.main(FLAGS + ["--out", str(out), *BOTH])
    return out


@pytest.fixture
def run_copy(finished, tmp_path):
    """A copy of the finished run's folder, to change."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def fresh(finished, out):
    """A new run folder holding only the finished run's tokenizer and token caches (not trained work):
    the data stage is reused, the rest is trained."""
    out.mkdir()
    for p in finished.iterdir():
        if p.name.startswith(("bpe", "train_ids", "val_ids")):
            shutil.copy2(p, out / p.name)
    return out


def snapshot(out):
    """Every file of a folder and its bytes' digest: what a refused run must leave as it was."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(out).iterdir()) if p.is_file()}


def interrupt_at(monkeypatch, stage_name, step, signum=signal.SIGINT):
    """Send this process `signum` during step `step` of the stage train_loop calls `stage_name`."""
    real = train.train_loop

    def loop(name, params, loss_fn, *args, **kwargs):
        def with_signal(s):
            if name == stage_name and s == step:
                signal.raise_signal(signum)
            return loss_fn(s)
        return real(name, params, with_signal, *args, **kwargs)
    monkeypatch.setattr(train, "train_loop", loop)
    for module in (gpt_stages, train_drafters):
        monkeypatch.setattr(module, "train_loop", loop)


# ---------------------------------------------------------------- 1. a rerun never overwrites trained work

@pytest.mark.parametrize("flags, differs", [
    (["--base-steps", "31"], "--base-steps 31 (it holds 30)"), (["--base-lr", "0.01"], "--base-lr 0.01"),
    (["--weight-decay", "0.1"], "--weight-decay 0.1"), (["--seed", "3"], "--seed 3 (it holds 0)"),
    (["--head-steps", "21"], "--head-steps 21"), (["--eagle-lr", "0.001"], "--eagle-lr 0.001"),
    (["--vocab-size", "300"], "--vocab-size 300"), (["--no-distill"], "--distill False"),
    (["--preset", "cpu"], "--n-layer 4 (it holds 2)"),
])
def test_a_rerun_asking_for_other_settings_is_refused_and_changes_nothing(run_copy, flags, differs):
    """A finished stage is reused only for the settings it was trained with: asked for others, the run
    says what differs and what to do, and the folder (tokenizer and token caches included) is unchanged."""
    before = snapshot(run_copy)
    base = [a if a != "tiny" else flags[1] for a in FLAGS] if flags[0] == "--preset" else FLAGS + flags
    argv = base + ["--out", str(run_copy), *BOTH]
    with pytest.raises(RunError, match=r"was trained for other settings: this run asks for .*--retrain") as e:
        train_heads.main(argv)
    assert differs in str(e.value), str(e.value)
    assert snapshot(run_copy) == before


def test_another_data_file_is_refused(run_copy, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 4000)
    before = snapshot(run_copy)
    with pytest.raises(RunError, match=r"base.pt was trained for other settings: this run asks for --data 'sha256:"):
        train_heads.main(FLAGS + ["--out", str(run_copy), "--data", str(text)])
    assert snapshot(run_copy) == before


def test_swapped_checkpoints_are_refused(run_copy):
    (run_copy / "medusa.pt").rename(run_copy / "x.pt")
    (run_copy / "eagle.pt").rename(run_copy / "medusa.pt")
    (run_copy / "x.pt").rename(run_copy / "eagle.pt")
    with pytest.raises(RunError, match="medusa.pt holds the 'eagle' stage, not 'medusa'"):
        train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH])


def test_free_settings_reuse_and_retrain_trains_the_stage_again(run_copy, capsys):
    """Threads and report sizes do not shape a stage: a rerun with others reuses everything. --retrain
    medusa trains the heads again for new settings and leaves the base and EAGLE as they were."""
    before = snapshot(run_copy)
    train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH, "--report-tokens", "6"])
    assert "base: reusing" in capsys.readouterr().out
    train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH, "--head-steps", "21",
                              "--retrain", "medusa"])
    after = snapshot(run_copy)
    assert after["base.pt"] == before["base.pt"] and after["distill.pt"] == before["distill.pt"]
    assert checkpoints.load(run_copy / "medusa.pt").stage.settings["head_steps"] == 21


# ---------------------------------------------------------------- 2. interrupted work survives, exactly

def test_an_interrupted_stage_is_refused_without_resume_and_resumes_exactly(finished, tmp_path, monkeypatch):
    """SIGTERM during the heads' training saves them after the step under way (exit 130); a rerun without
    --resume refuses to start them again; --resume finishes them, with the weights an uninterrupted run has."""
    out = fresh(finished, tmp_path / "run")
    interrupt_at(monkeypatch, "heads", 7, signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        train_heads.main(FLAGS + ["--out", str(out)])
    assert e.value.code == 130
    partial = checkpoints.load(out / "medusa.pt")
    assert partial.done is False and partial.step == 8
    monkeypatch.undo()
    with pytest.raises(RunError, match=r"medusa.pt is an unfinished medusa stage \(interrupted at step 8\): pass --resume"):
        train_heads.main(FLAGS + ["--out", str(out)])
    train_heads.main(FLAGS + ["--out", str(out), "--resume"])
    resumed, straight = checkpoints.load(out / "medusa.pt"), checkpoints.load(finished / "medusa.pt")
    assert resumed.done and resumed.model.keys() == straight.model.keys()
    for name, tensor in straight.model.items():
        assert torch.equal(resumed.model[name], tensor), f"{name}: resuming changed the weights"


def test_medusa2_interrupted_keeps_the_medusa1_heads_and_resumes(run_copy, monkeypatch):
    interrupt_at(monkeypatch, "joint", 3)
    with pytest.raises(SystemExit):
        train_heads.main(FLAGS + ["--out", str(run_copy), "--joint", "--joint-steps", "6", "--retrain", "medusa"])
    medusa1 = checkpoints.load(run_copy / "medusa1.pt")
    assert medusa1.done and not checkpoints.load(run_copy / "medusa.pt").done
    before = checkpoints.digest(run_copy / "medusa1.pt")
    monkeypatch.undo()
    train_heads.main(FLAGS + ["--out", str(run_copy), "--joint", "--joint-steps", "6", "--resume"])
    assert checkpoints.load(run_copy / "medusa.pt").done
    assert checkpoints.digest(run_copy / "medusa1.pt") == before, "resuming Medusa-2 rewrote the Medusa-1 heads"


def test_ctrl_c_outside_a_training_loop_is_one_line(monkeypatch, tmp_path, capsys):
    def interrupted(run):
        raise KeyboardInterrupt
    monkeypatch.setattr(gpt_stages, "prepare_data", interrupted)
    assert cli.finish(train_heads.main, FLAGS + ["--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_a_diverged_base_is_not_saved_as_finished(finished, monkeypatch, tmp_path):
    out = fresh(finished, tmp_path / "run")
    monkeypatch.setattr(gpt_stages, "estimate_loss", lambda *a, **k: float("nan"))
    with pytest.raises(RunError, match="training diverged"):
        train_heads.main(FLAGS + ["--out", str(out), "--base-steps", "5"])
    assert not (out / "base.pt").exists()


# ---------------------------------------------------------------- 3, 4. devices, copied folders

def test_a_copied_folder_reads_its_own_tokenizer(finished, run_copy, capsys):
    """The tokenizer is the file beside the checkpoint, checked by its digest: changing the original
    folder's does not change the copy, and a damaged one in the copy is one line."""
    argv = ["--out", str(run_copy), "--tokens", "8", "--prompt", "ROMEO:"]
    sample.main(argv)
    first = capsys.readouterr().out
    original = finished / "bpe320.tiktoken"
    saved = original.read_bytes()
    try:
        original.write_text("garbage")
        sample.main(argv)
        assert capsys.readouterr().out.splitlines()[:2] == first.splitlines()[:2]
    finally:
        original.write_bytes(saved)
    (run_copy / "bpe320.tiktoken").write_text("garbage")
    with pytest.raises(RunError, match="bpe320.tiktoken is not the tokenizer medusa.pt was trained with"):
        sample.main(argv)


# ---------------------------------------------------------------- 5. files: atomic, with the umask's mode, one line when the disk says no

def test_files_are_written_with_the_umasks_mode(finished):
    for name in ("base.pt", "medusa.pt", "report.json", "report.md", "bpe320.tiktoken", "train_ids.npy"):
        assert (finished / name).stat().st_mode & 0o777 == folder.FILE_MODE, name


def test_a_full_disk_is_one_line_and_the_old_file_stays(run_copy, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    before = (run_copy / "base.pt").read_bytes()
    monkeypatch.setattr(folder.os, "fsync", full)
    with pytest.raises(RunError, match="cannot write .*base.pt: no space left on the device"):
        checkpoints.save(run_copy / "base.pt", Checkpoint(model={}))
    assert (run_copy / "base.pt").read_bytes() == before
    assert not [p for p in run_copy.iterdir() if p.name.endswith(folder.TMP_SUFFIX)]
    with pytest.raises(RunError, match="no space left"):  # found before minutes of measuring
        benchmark.main(["--out", str(run_copy), "--threads", "1"])


def test_a_read_only_folder_is_one_line_before_any_training(tmp_path, monkeypatch):
    real_open = open

    def read_only(path, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr("builtins.open", read_only)
    with pytest.raises(RunError, match="the file system is read-only"):
        train_heads.main(FLAGS + ["--out", str(tmp_path / "new")])
    assert not (tmp_path / "new" / "base.pt").exists()


def test_orphan_temporary_files_are_cleaned_up(run_copy):
    orphan = run_copy / f".base.pt.12345{folder.TMP_SUFFIX}"
    orphan.write_bytes(b"half a checkpoint")
    with folder.locked(str(run_copy)):
        pass
    assert not orphan.exists()


def test_a_second_run_in_the_folder_refuses(run_copy):
    with folder.locked(str(run_copy)):
        with pytest.raises(RunError, match="another run is using"):
            train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH])


def test_broken_pipes_end_quietly_and_a_full_output_is_one_line(finished):
    command = [sys.executable, "sample.py", "--out", str(finished), "--tokens", "40"]
    piped = subprocess.run(" ".join(command) + " | head -c 20", shell=True, cwd=ROOT, capture_output=True, text=True,
                           executable="/bin/bash")
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    with open("/dev/full", "w") as full:
        result = subprocess.run(command, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 1 and result.stderr.startswith("error: No space left on device"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ---------------------------------------------------------------- 6, 7. values: checked at parse time, naming the flag

@pytest.mark.parametrize("main, argv, message", [
    (train_heads.main, ["--base-lr", "inf"], "--base-lr: inf is not a finite number"),
    (train_heads.main, ["--base-lr", "nan"], "--base-lr: nan is not a finite number"),
    (train_heads.main, ["--base-lr", "0"], "--base-lr: 0 must be above 0"),
    (train_heads.main, ["--mtp", "1", "--mtp-lambda", "nan"], "--mtp-lambda: nan is not a finite number"),
    (train_heads.main, ["--weight-decay", "-5"], "--weight-decay: -5 must be at least 0"),
    (train_heads.main, ["--distill-sampled", "2"], "--distill-sampled: 2 must be at most 1"),
    (train_heads.main, ["--distill-sampled", "-1"], "--distill-sampled: -1 must be at least 0"),
    (train_heads.main, ["--threads", "1000"], "--threads: 1000 must be from 1 to"),
    (train_heads.main, ["--seed", str(10**23)], "--seed: 100000000000000000000000 must be from 0"),
    (train_heads.main, ["--out", ""], "--out: must not be empty"),
    (train_heads.main, ["--device", ""], "--device: must not be empty"),
    (train_heads.main, ["--drafters", ""], "--drafters: must not be empty"),
    (train_heads.main, ["--drafters", "medusa,bogus"], "--drafters medusa,bogus: a comma-separated list"),
    (train_heads.main, ["--retrain", "bogus"], "--retrain bogus: stages are"),
    (train_heads.main, ["--no-distill", "--distill-sampled", "0.5"], "--distill-sampled shapes the self-distilled"),
    (train_heads.main, ["--joint-steps", "5"], "--joint-steps sets Medusa-2's steps: give --joint"),
    (train_heads.main, ["--data", "/nonexistent"], "--data /nonexistent: no such file"),
    (train_heads.main, ["--data", "/tmp"], "--data /tmp: a folder"),
    (sample.main, ["--prompt", ""], "--prompt: must not be empty"),
    (sample.main, ["--temperature", "inf"], "--temperature: inf is not a finite number"),
    (sample.main, ["--temperature", "nan"], "--temperature: nan is not a finite number"),
    (sample.main, ["--seed", str(10**23)], "--seed: "),
    (benchmark.main, ["--ops", "--prompts", "3"], "--prompts: --breakdown and --ops measure one"),
    (benchmark.main, ["--drafter", "eagle"], "--drafter picks the drafter"),
    (benchmark.main, ["--nodes", "4,x"], "give tree sizes as numbers"),
])
def test_bad_values_are_one_line_naming_the_flag(main, argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(argv)


# ---------------------------------------------------------------- 8. what the fourth pass found (issue of 2026-12-05)

def test_a_checkpoint_whose_fields_are_the_wrong_shape_is_one_line_naming_it(run_copy):
    """A checkpoint is read through its schema: a base that is a string, a model that is not tensors, a step that
    is text are each one line naming the file, in every command that reads it."""
    path = run_copy / "medusa.pt"
    good = torch.load(path, weights_only=True)
    for field, value in (("base", "gpt"), ("model", {"heads.0.residual.weight": "x"}), ("step", "seven"),
                         ("drafter", {"kind": 3}), ("trees", [1, 2])):
        torch.save({**good, field: value}, path)
        for main in (sample.main, benchmark.main):
            with pytest.raises(RunError, match=f"{path}.*{field}"):
                main(["--out", str(run_copy)] + (["--tokens", "4"] if main is sample.main else ["--threads", "1"]))


def test_benchmark_refuses_more_tokens_than_the_context_holds(finished):
    with pytest.raises(UsageError, match=r"--tokens 8192: .* do not fit in the model's context of 128 tokens"):
        benchmark.main(["--out", str(finished), "--prompts", "1", "--tokens", "8192", "--threads", "1"])


@pytest.mark.parametrize("command", [[benchmark.main], [benchmark.main, "--engine", "llama.cpp"],
                                     [sample.main, "--drafter", "eagle3", "--chat", "hi"]])
def test_a_command_pointed_at_smollm2s_own_folder_names_the_run_folder(tmp_path, command):
    """--out is the run's folder (SmolLM2's drafters are in OUT/smollm2/): pointed at smollm2/ itself, the one line
    says which folder to pass."""
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "eagle3.pt").write_bytes(b"")  # only its name is looked at before the refusal
    main, *flags = command
    said = f"--out names the run's folder, whose smollm2/ holds them: --out {tmp_path})"
    with pytest.raises(RunError, match=re.escape(said)):
        main(["--base", "smollm2", "--out", str(tmp_path / "smollm2"), *flags])


@pytest.mark.parametrize("damage", ["empty", "cut"])
def test_a_damaged_tokenizer_is_one_line_and_nothing_is_written(run_copy, damage):
    bpe = run_copy / "bpe320.tiktoken"
    bpe.write_bytes(b"" if damage == "empty" else bpe.read_bytes()[:300])
    before = snapshot(run_copy)
    with pytest.raises(RunError, match="bpe320.tiktoken is damaged"):
        train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH])
    assert snapshot(run_copy) == before


def test_another_valid_tokenizer_is_refused_before_the_token_caches_are_written(run_copy, tmp_path):
    """A BPE trained on other text is a valid file but not the run's: refused before anything is re-encoded."""
    from lab import data
    data.save_bpe(data.train_bpe(data.load_plays()["hamlet"][:200_000], 320), str(run_copy / "bpe320.tiktoken"))
    before = snapshot(run_copy)
    with pytest.raises(RunError, match="is not the tokenizer .*base.pt was trained with"):
        train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH])
    assert snapshot(run_copy) == before


def test_what_cannot_fit_or_finish_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Memory past what the machine has, a week of training by the plan's estimate (a base step priced at one second
    here, whatever this machine's speed), steps past the flag's range: each refused in one line, nothing written."""
    from lab import plan
    monkeypatch.setattr(plan, "measure_steps", lambda config, run, device: (1.0, 0.01))
    out = tmp_path / "new"
    with pytest.raises(UsageError, match=r"--batch-size 4096 --seq-len 8192: the \w+ stage would need about"):
        train_heads.main(["--preset", "tiny", "--batch-size", "4096", "--seq-len", "8192", "--out", str(out)])
    with pytest.raises(UsageError, match="would take about .* days"):
        train_heads.main(["--preset", "tiny", "--base-steps", str(10**7), "--head-steps", str(10**7), "--out", str(out)])
    with pytest.raises(UsageError, match="--base-steps: 1000000000000 must be from 1 to"):
        train_heads.main(["--preset", "tiny", "--base-steps", str(10**12), "--out", str(out)])
    assert not out.exists() or not list(out.iterdir())


def test_a_rerun_keeps_the_trees_unless_asked(run_copy, capsys):
    """The trees a drafter was given for this machine and dtype are kept by a rerun with other free settings (other
    threads, report sizes); --retree chooses them again."""
    trees = {n: checkpoints.load(run_copy / n).trees for n in ("medusa.pt", "eagle.pt")}
    train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH, "--report-tokens", "6"])
    printed = capsys.readouterr().out
    assert "medusa tree: keeping the one chosen for this machine" in printed and "choosing" not in printed
    assert {n: checkpoints.load(run_copy / n).trees for n in trees} == trees
    train_heads.main(FLAGS + ["--out", str(run_copy), *BOTH, "--report-tokens", "6", "--retree"])
    assert "medusa tree: choosing for" in capsys.readouterr().out


def test_an_interrupted_ablation_resumes(run_copy, monkeypatch):
    """ablation.py stopped during its own training leaves a resumable checkpoint; its rerun says --resume, which it
    takes, and finishes."""
    import ablation
    interrupt_at(monkeypatch, "heads", 3)
    with pytest.raises(SystemExit):
        ablation.main(["--out", str(run_copy), "--threads", "1"])
    monkeypatch.undo()
    with pytest.raises(RunError, match="pass --resume"):
        ablation.main(["--out", str(run_copy), "--threads", "1"])
    ablation.main(["--out", str(run_copy), "--threads", "1", "--resume"])
    assert checkpoints.load(run_copy / "shared" / "medusa.pt").done


def test_a_flag_that_would_do_nothing_is_refused():
    with pytest.raises(UsageError, match="--retrain eagle: eagle is not among --drafters medusa"):
        train_heads.parse_args(["--preset", "tiny", "--drafters", "medusa", "--retrain", "eagle"])


def test_sigterm_outside_a_training_loop_is_ctrl_c(monkeypatch, tmp_path, capsys):
    def terminated(run):
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(gpt_stages, "prepare_data", terminated)
    assert cli.finish(train_heads.main, FLAGS + ["--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_a_stage_that_cannot_be_saved_keeps_its_weights_elsewhere(tmp_path, monkeypatch, finished):
    """A full disk when a stage has trained: one line saying where its weights are, which the rerun reuses."""
    from lab import stage
    out = fresh(finished, tmp_path / "run")
    monkeypatch.setattr(stage, "RESCUE", str(tmp_path / "rescue"))
    real = checkpoints.save

    def full(path, ckpt):
        if str(path) == str(out / "base.pt") and ckpt.done:
            raise RunError(f"cannot write {path}: no space left on the device")
        return real(path, ckpt)
    monkeypatch.setattr(checkpoints, "save", full)
    with pytest.raises(RunError, match=r"base.pt: no space left on the device; the stage's weights are kept in "
                                       r".*rescue/base.pt: free some space, move that file to"):
        train_heads.main(FLAGS + ["--out", str(out)])
    monkeypatch.undo()
    os.replace(tmp_path / "rescue" / "base.pt", out / "base.pt")
    train_heads.main(FLAGS + ["--out", str(out), "--head-steps", "5"])
    assert checkpoints.load(out / "base.pt").done
