"""Everything about the Medusa candidate tree: validation, buffers, candidates, tree growth, pictures.

A tree is a list of paths ("choices"). The path (i1, ..., ik) means: rank i1 of head 1's top-k,
then rank i2 of head 2's top-k, ..., rank ik of head k. The root (depth 0, path ()) is implicit:
it is the base model's own next token. Conventions: docs/medusa.md section 2.
"""
import functools
import itertools
import math
from dataclasses import dataclass

import torch

Path = tuple[int, ...]


@dataclass
class TreeBuffers:
    """Index tensors for one tree, all in node order: root first, then paths by (len(path), path)."""
    node_paths: list[Path]          # N paths; node 0 is the root ()
    attn_mask: torch.Tensor         # (N, N) bool: row = query node, column = key node it may see
    attn_bias: torch.Tensor         # (N, N) the same mask, additive: 0 where visible, -inf elsewhere
    position_ids: torch.Tensor      # (N,) node depth; the model adds the committed length S
    retrieve_indices: torch.Tensor  # (P, L) node indices of each root-to-leaf path, padded with -1
    padding: torch.Tensor           # (P, L) bool: retrieve_indices < 0
    gather_index: torch.Tensor      # (P, L) retrieve_indices with padding read from the root (index 0)
    path_lengths: torch.Tensor      # (P,) real nodes per row, root included
    token_index: torch.Tensor       # (N,) where each node's token sits in [root, head-1 top-k, head-2 top-k, ...]
    children: list[list[int]]       # children[n] = node indices whose parent is node n
    depth: int                      # deepest path length = number of heads the tree uses
    topk: int                       # largest rank + 1 = how many guesses per head the tree needs
    rows: list[list[int]]           # retrieve_indices without padding, on the host (no device read)
    row_of: list[int]               # row_of[n] = the first row whose path passes through node n

    def to(self, device):
        """A copy with every tensor on `device` (built once, before decoding)."""
        tensors = {name: getattr(self, name).to(device) for name in
                   ("attn_mask", "attn_bias", "position_ids", "retrieve_indices", "padding", "gather_index",
                    "path_lengths", "token_index")}
        return TreeBuffers(node_paths=self.node_paths, children=self.children, depth=self.depth,
                           topk=self.topk, rows=self.rows, row_of=self.row_of, **tensors)


def validate_choices(choices) -> list[Path]:
    """Return the paths sorted in node order, or raise ValueError saying what is wrong."""
    if len(choices) == 0:
        raise ValueError("the tree is empty: give at least one path, e.g. [(0,)]")
    paths = []
    for c in choices:
        path = tuple(c)
        if len(path) == 0:
            raise ValueError("the root () is implicit; do not list it among the choices")
        if any(not isinstance(r, int) or r < 0 for r in path):
            raise ValueError(f"path {path} has a rank that is not a non-negative integer")
        paths.append(path)
    if len(set(paths)) != len(paths):
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(f"duplicate paths in the tree: {dupes}")
    present = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in present:
            raise ValueError(f"tree is not prefix-closed: {path} is listed but its parent {path[:-1]} is not")
    return sorted(paths, key=lambda p: (len(p), p))


def build_tree_buffers(choices, device=None) -> TreeBuffers:
    """Mask, position ids and retrieve indices for a tree (docs/medusa.md section 2), on `device`
    (default: the CPU). Build them where the model is: indexing across devices fails.

    Every field is defined by its comment in TreeBuffers, in node order: the root (), then the
    paths sorted by (len(path), path). Retrieve rows: walk the nodes from last to first and start
    a row at every node not yet on a recorded row; so row 0 ends at the last node. ValueError
    (from validate_choices) for an empty, non-prefix-closed or malformed tree."""
    node_paths = [()] + validate_choices(choices)
    index = {path: i for i, path in enumerate(node_paths)}
    N = len(node_paths)
    depth = max(len(p) for p in node_paths)
    topk = max(max(p) for p in node_paths[1:]) + 1

    # A node sees itself, its ancestors and the root: column j is on if path j is a prefix of path i.
    attn_mask = torch.zeros(N, N, dtype=torch.bool)
    for i, path in enumerate(node_paths):
        for k in range(len(path) + 1):
            attn_mask[i, index[path[:k]]] = True

    position_ids = torch.tensor([len(p) for p in node_paths])  # (N,)

    # One row per leaf, found by walking nodes from last to first (deepest, largest first)
    # and keeping each node not already on a recorded path. Ancestors sort before
    # descendants, so every internal node is met after one of its leaves.
    rows, on_a_path = [], set()
    for path in reversed(node_paths[1:]):
        if path in on_a_path:
            continue
        row = [index[path[:k]] for k in range(len(path) + 1)]  # root ... leaf
        on_a_path.update(path[:k] for k in range(len(path) + 1))
        rows.append(row)
    path_lengths = torch.tensor([len(r) for r in rows])  # (P,)
    retrieve_indices = torch.full((len(rows), depth + 1), -1, dtype=torch.long)  # (P, L)
    for r, row in enumerate(rows):
        retrieve_indices[r, :len(row)] = torch.tensor(row)

    # Node (i1..ik) carries head k's rank-ik token. Lay out the tokens as one flat vector
    # [root, head 1 rank 0..topk-1, head 2 rank 0..topk-1, ...]; token_index points into it.
    token_index = torch.tensor([0] + [1 + (len(p) - 1) * topk + p[-1] for p in node_paths[1:]])

    children = [[] for _ in range(N)]
    for i, path in enumerate(node_paths[1:], start=1):
        children[index[path[:-1]]].append(i)
    row_of = [0] * N
    for r in reversed(range(len(rows))):  # the first row through a node wins
        for n in rows[r]:
            row_of[n] = r
    attn_bias = torch.zeros(N, N).masked_fill(~attn_mask, float("-inf"))
    buffers = TreeBuffers(node_paths, attn_mask, attn_bias, position_ids, retrieve_indices, retrieve_indices < 0,
                          retrieve_indices.clamp(min=0), path_lengths, token_index, children, depth, topk, rows, row_of)
    return buffers if device is None else buffers.to(device)


def tree_cuts(choices, device) -> dict[int, TreeBuffers]:
    """{d: the tree cut to depth d} for d = 1..depth, on `device`. Near the end of the context or of
    the requested tokens, a step uses the deepest cut that still fits. Built once per (tree, device)
    and shared by every later call: treat the buffers as read-only."""
    return _tree_cuts(tuple(tuple(p) for p in choices), str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _tree_cuts(choices: tuple, device: str) -> dict[int, TreeBuffers]:
    full = build_tree_buffers(choices)
    return {d: build_tree_buffers([p for p in full.node_paths[1:] if len(p) <= d], device)
            for d in range(1, full.depth + 1)}


def gather_paths(node_values: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
    """Lay per-node values (N, ...) out along the root-to-leaf paths: (P, L, ...).

    out[r, j] = node_values[retrieve_indices[r, j]]. Padded slots (-1) read the root's value, not
    the last node's; acceptance never looks at them (path_lengths)."""
    return node_values[buffers.gather_index]  # (N, ...) -> (P, L, ...)


def generate_candidates(base_logits, head_logits, buffers: TreeBuffers, root=None):
    """Step 1 of a Medusa step: the tree's tokens and its candidate paths at the last position.

    base_logits (V,), head_logits (K, V) -> tree_tokens (N,), candidates (P, L) padded with -1.
    The root is the base model's argmax unless a sampled `root` token (0-d tensor) is given.
    Node (i1..ik) carries head k's rank-ik token (rank 0 = most likely); only the first
    buffers.depth heads are read. candidates[r] = the tokens of retrieve row r, -1 where padded."""
    if root is None:
        root = base_logits.argmax(-1)
    guesses = head_logits[:buffers.depth].topk(buffers.topk, dim=-1).indices  # (K, V) -> (D, topk)
    flat = torch.cat([root.view(1), guesses.flatten()])                       # (1 + D*topk,): root, head 1's, ...
    tree_tokens = flat[buffers.token_index]                                   # (N,)
    candidates = gather_paths(tree_tokens, buffers).masked_fill(buffers.padding, -1)  # (P, L), padding -1
    return tree_tokens, candidates


def dense_tree(widths) -> list[Path]:
    """The cartesian tree: widths [s1, .., sK] gives every path with rank_k < s_k, depth <= K."""
    return [path for k in range(1, len(widths) + 1)
            for path in itertools.product(*(range(w) for w in widths[:k]))]


def path_probability(path: Path, accuracies) -> float:
    """P(path is on the accepted path) under independence: prod_k accuracies[k][rank_k].

    ValueError, saying the path needs more heads or ranks than the accuracy table has, when the
    path is deeper than the table or one of its ranks is past its head's row."""
    if len(path) > len(accuracies) or any(r >= len(accuracies[k]) for k, r in enumerate(path)):
        raise ValueError(f"path {path} needs more heads or ranks than the accuracy table has")
    return math.prod(accuracies[k][r] for k, r in enumerate(path))


def expected_tokens_per_step(choices, accuracies) -> float:
    """1 (the root, always committed) + the sum over tree nodes of each node's path probability."""
    return 1.0 + sum(path_probability(p, accuracies) for p in validate_choices(choices))


def grow_tree(accuracies, num_nodes: int) -> list[Path]:
    """The paper's greedy sparse tree (section 2.3.3): add the most probable frontier node, num_nodes times.

    accuracies[k][i] is the single-rank accuracy of head k+1's rank-i guess. The frontier holds each
    chosen node's next sibling and first child. Ties go to the first node in node order
    (shorter path, then smaller ranks). Returns the paths in the order they were added.
    With K heads and R ranks (the shortest row), the table supplies sum_k R**k nodes (k = 1..K);
    ValueError, saying how many nodes the table supplies, when num_nodes is not between 1 and that."""
    K, R = len(accuracies), min(len(row) for row in accuracies)
    capacity = sum(R ** k for k in range(1, K + 1))
    if not 1 <= num_nodes <= capacity:
        raise ValueError(f"num_nodes={num_nodes}: a table of {K} heads x {R} ranks supplies 1..{capacity} nodes")
    chosen, frontier = [], {(0,)}
    while len(chosen) < num_nodes:
        best = min(frontier, key=lambda p: (-path_probability(p, accuracies), len(p), p))
        frontier.remove(best)
        chosen.append(best)
        if best[-1] + 1 < R:
            frontier.add(best[:-1] + (best[-1] + 1,))  # next sibling
        if len(best) < K:
            frontier.add(best + (0,))                  # first child
    return chosen


def _label(path: Path) -> str:
    return "root" if path == () else ",".join(map(str, path))


def plot_tree_mask(buffers: TreeBuffers, ax=None, committed: int = 0):
    """Heatmap of the tree attention mask: row = query node, column = key, dark = may attend.

    committed = S > 0 also draws the S committed tokens' columns (the KV cache), which every node sees:
    the full (N, S + N) mask of the verification forward."""
    import matplotlib.pyplot as plt
    N = len(buffers.node_paths)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.5 + 0.35 * (committed + N), 1.2 + 0.35 * N))
    labels = [_label(p) for p in buffers.node_paths]
    mask = torch.cat([torch.ones(N, committed, dtype=torch.bool), buffers.attn_mask.cpu()], dim=1)  # (N, S+N)
    ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.3)
    ax.set_xticks(range(committed + N), [f"prefix {s}" for s in range(committed)] + labels, rotation=90, fontsize=8)
    ax.set_yticks(range(N), labels, fontsize=8)
    if committed:
        ax.axvline(committed - 0.5, color="crimson", lw=1.5)
    ax.set_xlabel("key (what is attended to)" + (": committed tokens, then tree nodes" if committed else ""))
    ax.set_ylabel("query node")
    ax.set_title(f"Tree attention mask ({N} nodes" + (f" after {committed} committed tokens)" if committed else ")"))
    return ax


def plot_tree(choices, ax=None, highlight=None, labels=None):
    """Draw the tree left to right, one column per depth; `highlight` (a path) is drawn in red.

    labels: optional {path: text} shown in the nodes (e.g. the candidate tokens); default: the rank."""
    import matplotlib.pyplot as plt
    paths = [()] + validate_choices(choices)
    if ax is None:
        leaves = sum(1 for p in paths if not any(q[:-1] == p for q in paths if q))
        _, ax = plt.subplots(figsize=(2.5 + 1.6 * max(len(p) for p in paths), 1 + 0.4 * leaves))
    on_highlight = {tuple(highlight)[:k] for k in range(len(highlight) + 1)} if highlight is not None else set()

    # Leaves get consecutive rows in depth-first order; a parent sits at the mean of its children.
    y, next_row = {}, itertools.count()
    def place(p):
        kids = sorted(q for q in paths if q[:-1] == p and q)
        y[p] = sum(place(k) for k in kids) / len(kids) if kids else next(next_row)
        return y[p]
    place(())

    for p in paths[1:]:
        red = p in on_highlight
        ax.plot([len(p) - 1, len(p)], [y[p[:-1]], y[p]], color="crimson" if red else "0.7",
                lw=2.5 if red else 1, zorder=1)
    for p in paths:
        red = p in on_highlight
        text = labels.get(p, _label(p)) if labels else ("root" if p == () else str(p[-1]))
        ax.text(len(p), y[p], text, ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round", fc="mistyrose" if red else "white", ec="crimson" if red else "0.4"))
    depth = max(len(p) for p in paths)
    ax.set_xticks(range(depth + 1), ["root"] + [f"head {k}" for k in range(1, depth + 1)])
    ax.set_xlim(-0.6, depth + 0.6)
    ax.set_ylim(max(y.values()) + 0.8, -0.8)
    ax.set_yticks([])
    ax.set_xlabel("depth (which head proposed the token)")
    ax.set_ylabel("candidate paths")
    ax.set_title(f"Medusa tree, {len(paths) - 1} nodes" + (f", accepted path {tuple(highlight)}" if highlight else ""))
    return ax
