"""The drafter registry: everything the lab and the commands need to know of a drafter, in one entry.

A drafter is one file of the core (medusa_mini.py, eagle.py, mtp.py: its model, its verify.Drafter, its
decoding) and one entry here. Nothing outside this file asks which drafter it holds: the pipelines,
the report, the probes and the commands read the entry. To add a drafter, write its file and
register() an entry for it (tests/test_registry.py registers a toy one from the test file alone).
"""
from dataclasses import dataclass, field
from typing import Callable


import eagle
import medusa_mini
import mtp
from feature_drafter import DynamicTree, FeatureDrafter, chain_hits, chain_proposals, feature_generate
from lab import export, stages
from tree import dense_tree

DENSE_WIDTHS = [3, 3, 2]  # 3 + 9 + 18 = 30 nodes: the dense tree the report compares Medusa's grown one with


@dataclass(frozen=True)
class DrafterKind:
    """One drafter, as the lab and the commands use it."""
    name: str                 # its --drafters name, its checkpoint's file name (NAME.pt) and its kind
    model: type               # model(base, **config): the base and the drafter's weights (.base, .draft_dtype, ...)
    drafter: type             # drafter(model, tree, device): the verify.Drafter one generation drafts with
    generate: Callable        # generate(model, idx, n, tree, temperature, sampling, ..., stop_tokens, stream)
    settings: tuple           # the run fields (lab/config.py) that shape its weights: its own train_heads.py flags
    config: Callable          # config(run) -> model's keyword arguments (stored in the checkpoint)
    hits: Callable            # hits(model, seq, start, depth, ranks, features, vocab): how often a draft is right
    depth: Callable           # depth(model, run): how deep its trees may grow
    extra_trees: Callable     # extra_trees(model, order, chosen, run) -> {label: tree}: more trees the report times
    proposals: Callable       # proposals(model, seq, h, t, depth, ranks) -> (draws, depth, ranks) drafted token ids
    conditional: bool         # whether a depth's drafts depend on the path above it (trees grown by the chain rule)
    train: Callable | None = None  # train(model, batches, run, save, resume_from, vocab) -> history; None: the
    #                                base's own stage trains it (MTP's modules), and the drafter is that model
    steps: Callable = field(default=lambda run: 0)  # its training steps in a run (for the plan's estimate)
    distilled: Callable = field(default=lambda run: True)  # whether it trains on self-distilled text
    exports: dict = field(default_factory=dict)  # {format: lab.export.Target}: what export.py writes it as
    #                                              (or refuses, saying why); empty: it cannot leave the project


REGISTRY: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    REGISTRY[kind.name] = kind
    return kind


def get(name: str) -> DrafterKind:
    return REGISTRY[name]


def names() -> list[str]:
    return list(REGISTRY)


# ---------------------------------------------------------------------------------------- Medusa

def medusa_extra_trees(model, order, chosen, run):
    return {"grown tree": order[:64], "dense " + "x".join(map(str, DENSE_WIDTHS)):
            dense_tree(DENSE_WIDTHS[:len(model.heads)])}


def train_medusa(model, batches, run, save, resume_from=None, vocab=None):
    return stages.train_heads(model, batches, run.head_steps, run.head_lr, save, resume_from, vocab)


register(DrafterKind(
    name="medusa", model=medusa_mini.MedusaModel, drafter=medusa_mini.MedusaDrafter,
    generate=medusa_mini.medusa_generate,
    settings=("distill", "num_heads", "head_steps", "head_lr", "share_lm_head", "joint", "joint_steps"),
    config=lambda run: {"num_heads": run.num_heads, "share_lm_head": run.share_lm_head},
    hits=medusa_mini.head_hits, depth=lambda model, run: len(model.heads), extra_trees=medusa_extra_trees,
    proposals=medusa_mini.head_proposals, conditional=False, train=train_medusa, steps=lambda run: run.head_steps,
    distilled=lambda run: getattr(run, "distill", True), exports=export.MEDUSA_TARGETS))


# ---------------------------------------------------------------------------------------- EAGLE and MTP

def dynamic_tree(model, order, chosen, run):
    """EAGLE-2's tree, as many nodes as the chosen one, drafted anew every step."""
    return {"dynamic tree": DynamicTree(topk=min(4, len(chosen)), nodes=len(chosen),
                                        depth=min(run.eagle_depth, len(chosen)))}


def train_eagle(model, batches, run, save, resume_from=None, vocab=None):
    return stages.train_eagle(model, batches, run.eagle_steps, run.eagle_lr, save, run.seed, resume_from, vocab,
                              getattr(run, "eagle_loss", "eagle1"))


register(DrafterKind(
    name="eagle", model=eagle.EagleModel, drafter=FeatureDrafter, generate=feature_generate,
    settings=("eagle_steps", "eagle_lr", "eagle_loss"), config=lambda run: {},
    hits=chain_hits, depth=lambda model, run: run.eagle_depth, extra_trees=dynamic_tree,
    proposals=chain_proposals, conditional=True, train=train_eagle, steps=lambda run: run.eagle_steps,
    exports=export.EAGLE_TARGETS))

register(DrafterKind(
    name="mtp", model=mtp.MTPModel, drafter=FeatureDrafter, generate=feature_generate,
    settings=(), config=lambda run: {"depth": run.mtp_modules},
    hits=chain_hits, depth=lambda model, run: run.eagle_depth, extra_trees=dynamic_tree,
    proposals=chain_proposals, conditional=True, train=None, distilled=lambda run: False))
