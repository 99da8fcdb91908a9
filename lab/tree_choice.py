"""Choosing a drafter's trees for this machine, for both pipelines: accuracies read on text the base
wrote, a tree grown from them (tree.grow_tree, docs/medusa.md section 4), and its size chosen from the
measured cost of a step (lab/timing.step_costs). Exact sampling accepts a node only when the drawn
token is its token, so its tree is grown from accuracies on sampled text (wider, shallower), sized with
the same step costs.

The trees are chosen per decoding dtype (a step's cost depends on it) for the machine they were timed on,
and kept in the drafter's checkpoint under trees[dtype]: a rerun decodes with them and chooses again only
for another machine or dtype, or when asked (lab/pipeline.py). A checkpoint without the dtype asked for
decodes with its float32 trees.
"""
import dataclasses
from dataclasses import dataclass, field

import torch

from feature_drafter import DynamicTree, as_tree
from lab import checkpoints, timing
from lab.cli import RunError
from lab.devices import machine
from lab.dtypes import dtype_name
from tree import expected_tokens_per_step, grow_tree

SAMPLE_T = 0.7  # the temperature the sampling tree is grown for, as in the report


def tree_json(tree):
    """A tree as a checkpoint stores it: rank paths as lists, a DynamicTree as its settings."""
    return dataclasses.asdict(tree) if isinstance(tree, DynamicTree) else [list(p) for p in tree]


def tree_label(tree) -> str:
    """How a tree reads in a table: its node count, or a dynamic tree's settings."""
    if isinstance(tree, DynamicTree):
        return f"dynamic, {tree.nodes} nodes, top-{tree.topk}, {tree.depth} deep"
    return f"{len(tree)} nodes"


def choose_tree(order, accuracies, costs):
    """The prefix of the grown order, and the thread count, with the most expected tokens per second:
    expected tokens per step (from the accuracies) over the measured time of a step.
    Returns (tree, threads)."""
    best = max(((t, n) for t in costs for n in costs[t]["step_ms"]),
               key=lambda tn: expected_tokens_per_step(order[:tn[1]], accuracies) / costs[tn[0]]["step_ms"][tn[1]])
    return order[:best[1]], best[0]


@dataclass
class Trees:
    """A drafter's trees for one decoding dtype, and what they were chosen from."""
    tree: list                    # the chosen greedy tree: a prefix of `order`
    threads: int                  # the thread count it steps fastest at
    order: list                   # grown from `accuracies`: every prefix is a tree
    accuracies: list              # a[d][r] on greedy text
    costs: dict                   # lab/timing.step_costs, at this dtype
    sampling_tree: list | None = None   # for exact sampling, grown from accuracies on sampled text
    sampled_accuracies: list | None = None
    extra: dict = field(default_factory=dict)  # more trees the report times: label -> tree
    machine: str = ""             # the machine the step costs were timed on (lab/devices.machine)

    def to_json(self):
        return {"tree": tree_json(self.tree), "threads": self.threads, "order": tree_json(self.order),
                "accuracies": self.accuracies, "costs": self.costs,
                "sampling_tree": None if self.sampling_tree is None else tree_json(self.sampling_tree),
                "sampled_accuracies": self.sampled_accuracies,
                "extra": {label: tree_json(t) for label, t in self.extra.items()}, "machine": self.machine}

    @classmethod
    def from_json(cls, d, where="a checkpoint"):
        """Trees from what to_json wrote; one line (RunError) if it is not that."""
        try:
            return cls(as_tree(d["tree"]), int(d["threads"]), as_tree(d["order"]), d["accuracies"],
                       {int(t): c for t, c in d["costs"].items()},
                       None if d["sampling_tree"] is None else as_tree(d["sampling_tree"]), d["sampled_accuracies"],
                       {label: as_tree(t) for label, t in d["extra"].items()}, d.get("machine", ""))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RunError(f"{where} holds trees this code cannot read ({type(e).__name__}: {e}): run train_heads.py "
                           f"with --retree to choose them again") from None


def trees_of(ckpt, dtype="float32", where="a checkpoint") -> Trees:
    """A drafter checkpoint's trees for decoding in `dtype`, else its float32 ones, else those it has (a
    tree chosen for another dtype still decodes exactly; only its size was chosen for other costs).
    A KeyError when it has none."""
    trees = ckpt.trees
    if not trees:
        raise KeyError("no trees")
    return Trees.from_json(trees.get(dtype_name(dtype)) or trees.get("float32") or next(iter(trees.values())), where)


def kept(ckpt, dtype) -> Trees | None:
    """The trees a checkpoint keeps for decoding in exactly `dtype`, or None."""
    found = ckpt.trees.get(dtype_name(dtype))
    return None if found is None else Trees.from_json(found)


def keep(path, chosen: Trees, dtype="float32"):
    """Write a drafter's trees for decoding in `dtype` into its checkpoint, beside those of other dtypes."""
    checkpoints.keep_trees(path, dtype_name(dtype), chosen.to_json())


def accuracies(kind, model, texts, depth, ranks, vocab=None):
    """a[d][r]: how often the drafter's rank-r draft at depth d + 1 is the text's token (kind.hits), summed
    over texts: a list of (seq (B, T), start, features (B, T, C) or None)."""
    totals = None
    for seq, start, features in texts:
        found = kind.hits(model, seq, start, depth, ranks, features, vocab)
        totals = found if totals is None else [(a + b, m + n) for (a, m), (b, n) in zip(totals, found)]
    return [(hits / max(count, 1)).tolist() for hits, count in totals]


@torch.no_grad()
def text_accuracies(kind, model, prompts, n_new, ranks, depth, temperature=0.0):
    """accuracies() on text the base writes from `prompts` (B, S): greedy, or sampled at `temperature` (from
    torch's global generator), scored from each prompt's last position."""
    from medusa_mini import generate
    seq = generate(model.base, prompts, n_new, temperature)                 # (B, S + n_new)
    return accuracies(kind, model, [(seq, prompts.size(1) - 1, None)], depth, ranks)


def choose(kind, model, run, greedy_texts, sampled_texts, prompt, device, max_tree, ranks, vocab=None,
           sizes=None, repeats=timing.STEP_COST_REPEATS, n_new=timing.STEP_COST_TOKENS, threads=None) -> Trees:
    """A drafter's trees for this device and the model's decoding dtype: grown from its accuracies on
    greedy text, sized from step costs timed on `prompt` (1-D ids); the sampling tree from sampled text
    (None: no sampling tree), sized by the same costs. Prints what it chose."""
    depth = kind.depth(model, run)
    greedy = accuracies(kind, model, greedy_texts, depth, ranks, vocab)
    order = grow_tree(greedy, max_tree)  # grow_tree adds nodes in order: every prefix is a tree
    costs = timing.step_costs(model, kind.generate, order, prompt, device, threads, sizes, repeats, n_new)
    chosen, best = choose_tree(order, greedy, costs)
    dtype = dtype_name(model.base.lm_head.weight.dtype)
    print(f"{kind.name} tree: {len(chosen)} nodes chosen for {device} in {dtype}, {best} thread{'s' * (best != 1)} "
          f"(expected {expected_tokens_per_step(chosen, greedy):.2f} tokens/step at "
          f"{costs[best]['relative'][len(chosen)]:.2f}x the cost of a plain step); top-1 by depth "
          + " ".join(f"{a[0]:.2f}" for a in greedy))
    trees = Trees(chosen, best, order, greedy, costs, extra=kind.extra_trees(model, order, chosen, run),
                  machine=machine(device))
    if sampled_texts:
        sampled = accuracies(kind, model, sampled_texts, depth, ranks, vocab)
        trees.sampling_tree, _ = choose_tree(grow_tree(sampled, max_tree), sampled, costs)
        trees.sampled_accuracies = sampled
        print(f"{kind.name} sampling tree: {len(trees.sampling_tree)} nodes for exact sampling at T={SAMPLE_T} "
              f"(expected {expected_tokens_per_step(trees.sampling_tree, sampled):.2f} tokens/step)")
    return trees


def sampled(generate_text, seed):
    """generate_text() at T = SAMPLE_T from a fixed seed (torch's global generator), the global state restored."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return generate_text()
    finally:
        torch.random.set_rng_state(state)
