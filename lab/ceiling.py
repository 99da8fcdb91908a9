"""The exact-sampling ceiling (benchmark.py --ceiling): tokens per step our drafters could reach at a
temperature, against the best any Medusa heads, or a perfect conditional drafter, could. Any drafter: it
takes registry entries (lab/drafters.py).
"""
import statistics

import torch

from medusa_mini import generate
from tree import grow_tree


def accepted_depth(ranks, tree):
    """How deep a sample goes into the tree: ranks[k] is the rank of its token k+1 after the root in
    the proposals at depth k+1 (-1: not among them); the tree is a set of rank paths, prefix-closed."""
    d = 0
    while d < len(ranks) and tuple(ranks[:d + 1]) in tree:
        d += 1
    return d


def _rank_in(proposals, drawn):
    """proposals (N, D, ranks) token ids per draw and depth, drawn (N, D) -> (N, D): each drawn token's rank
    among its depth's proposals, or -1."""
    hit = drawn[:, :, None] == proposals                                                 # (N, D, ranks)
    return torch.where(hit.any(-1), hit.int().argmax(-1), -1)


@torch.no_grad()
def exact_sampling_ceiling(base, drafted, prompts, temperature, sizes, depth, new_tokens=96, every=4, draws=384,
                           ranked=256, ranks=10):
    """Exact sampling's tokens/step with our drafters' proposals, the best any Medusa heads could make, and
    the best a drafter conditioned on its path could make.

    The tree walk is lossless, so a step commits the root and then the longest prefix of a sample from
    the model that the tree holds: tokens/step can be measured by sampling, without decoding. At every
    `every`-th position of a sample of new_tokens from each prompt, `draws` continuations of the root
    and `depth` tokens are drawn. Each set of proposals ranks the drawn tokens at each depth:
    - drafted: {name: (registry entry, model)}: each drafter's own proposals (kind.proposals);
    - ceiling: the tokens ranked by how often the first `ranked` draws hold them at that depth: the
      model's own distribution of the tokens after the root, the most a head can know (it guesses
      before the root is drawn, the same guesses on every branch);
    - conditional: the model's own top tokens given each draw's path so far (root included): what a
      drafter that conditions on the tokens before it could know at best.
    Trees are grown from each set's accuracies on the first `ranked` draws and scored on the others: a
    drafter whose drafts ignore the path (and the ceiling) by each depth's frequency, the others given
    the path in reach. Returns {name: {size: tokens/step}, "positions": count}."""
    D, V = depth, base.config.vocab_size
    conditional = {"ceiling": False, "conditional": True} | {n: kind.conditional for n, (kind, _) in drafted.items()}
    found = {name: [] for name in conditional}               # per position: (draws, D) ranks, -1 where not within `ranks`
    for prompt in prompts:
        sample = generate(base, prompt.view(1, -1), new_tokens, temperature)[0]
        last = min(sample.numel(), base.config.block_size - D - 1)  # the draws must fit in the context
        for t in range(prompt.numel(), last + 1, every):
            context = sample[None, :t]                                                   # (1, t)
            seq = generate(base, context.expand(draws, -1), D + 1, temperature)         # (draws, t + D + 1)
            drawn = seq[:, t + 1:]                                                       # (draws, D) after the root
            h = base.hidden(seq)                                                         # (draws, t + D + 1, C)
            counts = [torch.bincount(drawn[:ranked, k], minlength=V) for k in range(D)]  # D x (V,)
            ceiling = torch.stack([c.topk(ranks).indices for c in counts])               # (D, ranks)
            found["ceiling"].append(_rank_in(ceiling.expand(draws, -1, -1), drawn))
            top = base.lm_head(h[:, t:t + D]).topk(ranks, -1).indices                   # (draws, D, ranks): given the path
            found["conditional"].append(_rank_in(top, drawn))
            for name, (kind, model) in drafted.items():
                found[name].append(_rank_in(kind.proposals(model, seq, h, t, D, ranks), drawn))

    result = {"positions": len(found["ceiling"])}
    for name, per_position in found.items():
        per_position = torch.stack(per_position)                                         # (positions, draws, D)
        train, test = per_position[:, :ranked].flatten(0, 1), per_position[:, ranked:].flatten(0, 1)
        if conditional[name]:  # given the path in reach: the chain rule
            reached = torch.cumprod(torch.cat([torch.ones_like(train[:, :1]), train[:, :-1] >= 0], 1), 1).bool()
            accuracies = [[float(((train[:, k] == r) & reached[:, k]).sum() / reached[:, k].sum().clamp(min=1))
                           for r in range(ranks)] for k in range(D)]
        else:  # guesses made before the root: each depth's own frequency
            accuracies = [[float((train[:, k] == r).float().mean()) for r in range(ranks)] for k in range(D)]
        order = grow_tree(accuracies, max(sizes))
        rows = test.tolist()
        result[name] = {n: statistics.fmean(1 + accepted_depth(r, set(order[:n])) for r in rows) for n in sizes}
    return result


def format_ceiling(ceiling, temperature):
    sizes = list(ceiling["ceiling"])
    lines = [f"exact sampling at T={temperature}, tokens/step on {ceiling['positions']} positions of sampled text",
             "| proposals | " + " | ".join(f"{n} nodes" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    labels = {"ceiling": "any Medusa heads, estimated best: the model's own distribution of each future token",
              "conditional": "a perfect conditional drafter (a bound): the model's own top tokens given each path"}
    for name, row in ceiling.items():
        if name != "positions":
            lines.append(f"| {labels.get(name, f'our {name} drafter')} | " +
                         " | ".join(f"{row[n]:.2f}" for n in sizes) + " |")
    return "\n".join(lines)
