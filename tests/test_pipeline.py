"""train_heads.py end to end on the tiny preset, its checkpoints, and sample.py."""
import json
import os
import re
import time

import pytest
import torch

import benchmark
import sample
import train_heads
from conftest import PERIOD, random_medusa
from lab import checkpoints, drafters, gpt_stages, plan, report, report_files, timing, train, tree_choice
from lab.checkpoints import BaseInfo, Checkpoint
from lab.cli import RunError, UsageError
from lab.config import PRESETS, gpt_run
from lab.timing import Mode
from medusa_mini import GPT, GPTConfig, generate
from kv_cache import KVCache
from tree import dense_tree, validate_choices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One `train_heads.py --preset tiny --mtp 1 --drafters medusa,eagle,mtp` run, shared by the tests below:
    a base trained with an MTP module, then the three drafters on it, compared (in OUT/mtp1/)."""
    out = tmp_path_factory.mktemp("tiny")
    report = train_heads.main(["--preset", "tiny", "--out", str(out), "--threads", "1", "--mtp", "1",
                               "--drafters", "medusa,eagle,mtp"])
    return out / "mtp1", report


def test_tiny_preset_compares_the_drafters(tiny_run):
    """report.json with the top-level keys, a mode per drafter and sampling mode, a summary per drafter,
    report.md with both tables, the drafters' plot; greedy output identical for every drafter and tree."""
    out, _ = tiny_run
    report = json.load(open(out / "report.json"))
    for key in ("tokens_per_step", "speedup", "greedy_identical"):
        assert isinstance(report[key], float)
    assert report["drafter"] == "medusa" and set(report["drafters"]) == {"medusa", "eagle", "mtp"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", report["date"]) and report["command"].startswith("python ")
    modes = report["modes"]
    assert len(modes) == plan.report_modes_count(gpt_run("tiny", drafters=("medusa", "eagle", "mtp"), mtp_modules=1))
    for drafter in ("medusa", "eagle", "mtp"):
        for kind in ("greedy, chosen tree", "typical T=0.7", "exact T=0.7, sampling tree"):
            assert any(name.startswith(f"{drafter} {kind}") for name in modes), (drafter, kind)
        summary = report["drafters"][drafter]
        assert summary["greedy_identical"] == 1.0 and summary["greedy"]["tokens_per_step"] >= 1.0
        assert summary["parameters"] > 0 and summary["training"]["seconds"] > 0
    assert any(name.startswith("eagle greedy, dynamic tree") for name in modes)
    mtp = checkpoints.load(out / "mtp.pt")
    assert mtp.base.mtp_modules == 1 and (mtp.drafter.kind, mtp.drafter.config) == ("mtp", {"depth": 1})
    assert any(k.startswith("mtp.0.") for k in mtp.model)  # the modules, saved with the base they trained with
    assert all(r["greedy_identical"] == 1.0 for r in modes.values() if "greedy_identical" in r)
    assert (out / "drafters.png").exists() and len(list(out.glob("*.png"))) >= 3
    text = (out / "report.md").read_text()
    assert "| mode |" in text and "| drafter |" in text


def test_a_tree_is_grown_for_exact_sampling(tiny_run, capsys):
    """medusa.pt holds a tree for exact sampling: a prefix of the order grown from accuracies read on
    sampled text (not the greedy ones); the report measures exact sampling on it, and
    sample.py --sampling exact decodes with it."""
    out, report = tiny_run
    chosen = tree_choice.trees_of(checkpoints.load(out / "medusa.pt"))
    tree = chosen.sampling_tree
    assert validate_choices(tree) and chosen.sampled_accuracies != chosen.accuracies
    assert f"medusa exact T=0.7, sampling tree ({len(tree)} nodes)" in report["modes"]
    sample.main(["--out", str(out), "--tokens", "12", "--temperature", "0.7", "--sampling", "exact"])
    assert f"tree: {len(tree)} nodes" in capsys.readouterr().out


def test_an_mtp_base_is_never_taken_for_a_plain_one(tiny_run):
    """The MTP run's folder holds a base trained with MTP: a plain run pointed at it refuses it, in one line."""
    out, _ = tiny_run
    with pytest.raises(RunError, match=r"base.pt was trained for other settings: this run asks for --mtp 0 \(it holds 1\)"):
        train_heads.main(["--preset", "tiny", "--out", str(out), "--threads", "1"])


def test_medusa1_leaves_backbone_and_lm_head_unchanged(tiny_run):
    """Medusa-1 trains the heads only: every base weight in medusa.pt equals base.pt's (here the GPT of a
    base trained with an MTP module: base.pt holds both, the GPT's weights under base.)."""
    out, _ = tiny_run
    base = {k: v for k, v in torch.load(out / "base.pt", weights_only=True)["model"].items() if k.startswith("base.")}
    heads = torch.load(out / "medusa.pt", weights_only=True)["model"]
    assert base and set(base) <= set(heads)
    for name, tensor in base.items():
        assert torch.equal(heads[name], tensor), name
    head_w = heads["heads.0.proj.weight"]
    assert not torch.equal(head_w, base["base.lm_head.weight"])  # ... while the heads did move


def test_second_run_reuses_checkpoints(tiny_run, capsys):
    """Later runs reuse the base model and the drafters instead of training again."""
    out, _ = tiny_run
    train_heads.main(["--preset", "tiny", "--out", str(out.parent), "--mtp", "1", "--drafters", "medusa,eagle,mtp",
                      "--threads", "1", "--report-prompts", "1", "--report-tokens", "8"])
    printed = capsys.readouterr().out
    assert "base: reusing" in printed and "medusa: reusing" in printed and "eagle: reusing" in printed


def test_checkpoint_round_trip_and_clear_errors(tmp_path):
    """Save then load gives the same tensors; a truncated or foreign file is one line (RunError)."""
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=4)
    path = tmp_path / "ckpt.pt"
    model = GPT(config)
    checkpoints.save(path, Checkpoint(base=BaseInfo("gpt", config.__dict__.copy()), model=model.state_dict()))
    loaded = checkpoints.load(path)
    assert all(torch.equal(loaded.model[k], v) for k, v in model.state_dict().items())
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]  # the atomic write left no temp file
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(RunError, match="not a readable medusa-mini checkpoint"):
        checkpoints.load(path)
    (tmp_path / "junk.pt").write_bytes(b"\x00not a checkpoint")
    with pytest.raises(RunError, match="not a readable"):
        checkpoints.load(tmp_path / "junk.pt")


@pytest.mark.parametrize("content, message", [(b"", "empty"), (b"   \n", "empty"), (b"caf\xe9 \xff", "not UTF-8")])
def test_bad_data_files_give_a_clear_error(tmp_path, content, message):
    """`--data` with an empty or non-UTF-8 file: one line saying what is wrong, before any training."""
    path = tmp_path / "text.txt"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        train_heads.main(["--preset", "tiny", "--data", str(path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "base.pt").exists()


def test_head_accuracies_read_the_right_offsets(periodic_model):
    """On the periodic model every head's rank-0 guess is the token k+1 steps later: accuracy ~1 at rank 0."""
    prompts = torch.tensor([PERIOD[:5], PERIOD[3:8]])
    seq = generate(periodic_model.base, prompts, 20)
    acc = tree_choice.accuracies(drafters.get("medusa"), periodic_model, [(seq, 4, None)], 4, 3)
    assert len(acc) == 4 and all(len(a) == 3 for a in acc)
    assert all(a[0] > 0.95 and a[1] < 0.05 for a in acc)


def test_compare_picks_a_thread_count_on_the_first_prompt(monkeypatch):
    """A mode in `picked` runs at every thread count on the first prompt, then only at the one that
    was fastest for it there, on every prompt; the other modes run at every count throughout."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda t: calls.append(t))

    def decode(model, idx, n_new, slow_at):  # as fast as the thread count allows: slow at `slow_at` threads
        time.sleep(0.02 if calls[-1] == slow_at else 0.001)
        return torch.cat([idx, torch.zeros(1, n_new, dtype=idx.dtype)], 1)

    modes = {"a": Mode(decode, dict(slow_at=1), every_thread_count=False),
             "b": Mode(decode, dict(slow_at=2), every_thread_count=False), "c": Mode(decode, dict(slow_at=1))}
    prompts = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])]
    runs = timing.compare(None, prompts, 3, modes, repeats=2, threads=[1, 2])
    assert sorted(runs) == [("a", 2), ("b", 1), ("c", 1), ("c", 2)]
    assert all(len(run["seconds"]) == len(run["outputs"]) == 3 for run in runs.values())
    assert len(calls) == 2 * (3 * 2) + 2 * 2 * 4 + 1  # 2 repeats: the first prompt 3 modes x 2 counts, then 2 x 4 keys
    assert calls[-1] == torch.get_num_threads()  # and the caller's count put back


def test_report_runs_the_other_modes_at_one_thread_count():
    """run_report: the plain modes and the drafter's chosen tree at every thread count, every other mode
    at one (compare picks it); the table shows "-" where a mode did not run."""
    order = dense_tree([2, 2, 1, 1])  # by depth: every prefix is a tree
    chosen = tree_choice.Trees(order[:2], 1, order, [[0.5]] * 4, {}, order[:1], [[0.5]] * 4, {"grown tree": order[:14]})
    d = report.Drafted(drafters.get("medusa"), random_medusa(), chosen)
    prompts = [torch.tensor(PERIOD[:6]), torch.tensor(PERIOD[2:8])]
    rep = report.run_report([d], prompts, 6, [1, 2], ops=False, sweep=False, repeats=1)
    ran = {name: sorted(row["tokens_per_s_by_threads"]) for name, row in rep["modes"].items()}
    every = {"plain greedy", "plain sampling T=0.7", "medusa greedy, chosen tree (2 nodes)"}
    assert set(ran) == every | {"medusa greedy, grown tree (14 nodes)", "medusa typical T=0.7, chosen tree",
                                "medusa exact T=0.7, chosen tree", "medusa exact T=0.7, sampling tree (1 nodes)"}
    assert all(ran[name] == [1, 2] if name in every else len(ran[name]) == 1 for name in ran), ran
    assert rep["speedup_1_thread"] > 0 and rep["modes"]["medusa greedy, grown tree (14 nodes)"]["greedy_identical"] == 1
    row = rep["modes"]["medusa greedy, grown tree (14 nodes)"]
    line = next(line for line in report_files.format_table(rep).splitlines() if line.startswith("| medusa greedy, grown"))
    assert line.split(" | ")[2:4] == (["-", f"{row['tokens_per_s']:.0f}*"] if row["threads"] == 2
                                      else [f"{row['tokens_per_s']:.0f}*", "-"])


def test_sample_prints_text_and_stats(tiny_run, capsys):
    """sample.py --compare prints the continuation, the drafter's stats line and both speeds."""
    out, _ = tiny_run
    sample.main(["--out", str(out), "--prompt", "ROMEO:", "--tokens", "12", "--compare"])
    printed = capsys.readouterr().out
    assert printed.startswith("ROMEO:") and "tokens/step" in printed and "plain 12 tokens" in printed
    assert "\033[" not in printed  # not a terminal: no colour codes
    assert "decoding in float32 (auto: the tiny GPT decodes in float32" in printed  # what auto picked, and why


def test_sample_and_benchmark_decode_in_the_dtype_asked(tiny_run, capsys):
    """--dtype bfloat16 takes effect: sample.py says so and still writes text; benchmark.py times the drafters
    in bf16 (its ops count runs the bf16 model)."""
    out, _ = tiny_run
    sample.main(["--out", str(out), "--prompt", "ROMEO:", "--tokens", "8", "--dtype", "bfloat16"])
    assert "decoding in bfloat16 (--dtype bfloat16)" in capsys.readouterr().out
    benchmark.main(["--out", str(out), "--ops", "--drafter", "medusa", "--tokens", "8", "--dtype", "bfloat16"])
    assert "decoding in bfloat16 (--dtype bfloat16)" in capsys.readouterr().out


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_generate_only_at_trained_positions(preset):
    """The context is the training window, and no stage generates past it (distillation, head
    accuracies, report; the notebooks size their lengths from the context too)."""
    run = train_heads.parse_args(["--preset", preset, "--device", "cpu"])
    assert "block_size" not in PRESETS[preset]  # block_size = seq_len, set in one place
    for stage, length in gpt_stages.generation_lengths(run).items():
        assert length <= run.seq_len, (preset, stage, length)
    with pytest.raises(UsageError, match="past the"):  # refused up front
        train_heads.parse_args(["--preset", preset, "--device", "cpu", "--report-tokens", str(run.seq_len)])


def test_later_positions_are_no_worse(tiny_run):
    """Every position is trained: on held-out windows, the loss over the second half of the
    positions does not exceed the first half's (it has more context)."""
    out, _ = tiny_run
    first, second = checkpoints.load(out / "base.pt").metrics["val_loss_halves"]
    assert second <= first


def test_training_dtype_follows_the_device(monkeypatch):
    """bf16 autocast only where the hardware has bf16 (a CUDA GPU by is_bf16_supported(including_emulation=False),
    a CPU with bf16 instructions); fp16 (with a GradScaler) on other CUDA GPUs; fp32 on other CPUs and MPS."""
    for native, cuda_dtype, cpu_dtype in ((True, torch.bfloat16, torch.bfloat16), (False, torch.float16, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        monkeypatch.setattr(train, "cpu_has_native_bf16", lambda n=native: n)
        assert train.training_dtype(torch.device("cuda")) == cuda_dtype
        assert train.training_dtype(torch.device("cpu")) == cpu_dtype
        assert train.training_dtype(torch.device("mps")) == torch.float32


def test_gpu_preset_fits_a_6gb_card(monkeypatch):
    """With the free memory of a 6 GB card (a CPU stand-in for torch.cuda.mem_get_info), the
    distillation batch is sized to fit, and every stage's estimated peak stays under 6 GB."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(5.5 * gib), 6 * gib))
    run = gpt_run("gpu", device="cuda", drafters=("medusa", "eagle"))
    config = GPTConfig(vocab_size=run.vocab_size, block_size=run.seq_len, n_layer=run.n_layer,
                       n_head=run.n_head, n_embd=run.n_embd)
    rows = plan.generation_batch_size(config, plan.DISTILL_PROMPT + run.distill_len, run.device)
    assert 1 <= rows <= 1024
    memory = plan.estimate_memory(config, run, torch.bfloat16)
    assert all(b < 5.5 * gib for b in memory.values()), {k: b / gib for k, b in memory.items()}


def test_generation_estimate_covers_the_kv_cache():
    """The memory estimate for batched generation is at least the KV cache generate() allocates
    (prompt + new tokens, not the whole context)."""
    config = GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=2, n_embd=16)
    cache = KVCache(config, batch_size=3, capacity=24)
    assert cache.k.size(3) == 24
    assert plan.estimate_generation_bytes(config, 3, 24) >= 2 * cache.k.numel() * cache.k.element_size()


def test_the_gpu_check_runs_each_check_on_the_device_asked(tmp_path):
    """tools/gpu_check.py: the core exactness tests, the preset's training (float32) and a bf16 report of the
    same run, each on the device asked; the commands are ones their own parsers take (here on the CPU)."""
    gpu_check = pytest.importorskip("tools.gpu_check")
    commands = dict(gpu_check.steps("cuda", "gpu", str(tmp_path), python="python"))
    assert list(commands) == ["tests", "train", "bf16"]
    assert "--device=cuda" in commands["tests"] and all(os.path.exists(os.path.join(gpu_check.ROOT, f))
                                                      for f in gpu_check.CORE_TESTS)
    for step, dtype in (("train", "float32"), ("bf16", "bfloat16")):
        argv = commands[step]
        assert argv[argv.index("--device") + 1] == "cuda" and argv[argv.index("--dtype") + 1] == dtype
        assert argv[argv.index("--out") + 1] == os.path.join(str(tmp_path), "gpu")  # the bf16 report reads the run
    here = dict(gpu_check.steps("cpu", "tiny", str(tmp_path)))
    assert train_heads.parse_args(here["train"][2:]).drafters == ("medusa", "eagle", "eagle3")
    assert benchmark.parse_args(here["bf16"][2:]).dtype == "bfloat16"
