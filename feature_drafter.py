"""Drafting a tree depth by depth with draft layers of their own: what EAGLE's layer (eagle.py), EAGLE-3's
(eagle3.py) and MTP's modules (mtp.py) share.

A feature drafter's layers read the base model's features (its last hidden states, what lm_head reads, or,
for EAGLE-3, the residual stream entering three of its layers) and the embedding of a token after them, and
predict the next feature; an output head (the base's frozen lm_head, or EAGLE-3's own) turns a predicted
feature into a distribution over the next token. Each layer keeps a KV cache of its own:
its entries on the committed text, and, during a step, the entries of the tree drafted so far. So a
tree is drafted one depth per forward, and every node is drafted for its own parent: the branches of a
tree get different guesses, where Medusa's heads give every branch the same ones.

A model drafts with this file when it has `base`, `layers` (the draft layers in the order depths use
them: depth d uses layers[min(d, D) - 1]; each has `ahead`, forward(base, f, tokens, positions, mask,
cache) and norm_out(out)), `taps` (None, or the base layers whose input it reads: verify.Drafter),
token_head(vocab) (the output head's weight (V', C) and the token ids of its rows, or None for all), and
`draft_dtype`, `draft_vocab` (verify.Drafter says why these are free).
The tree is a fixed one (rank paths, as Medusa's) or EAGLE-2's dynamic tree (Li et al., arXiv
2406.16858, section 4), drafted anew every step. Verification is the shared verifier's (verify.py).

Shapes: S committed tokens, C width, V vocabulary, E entries (drafted nodes) in one draft forward,
K the top-k of one node, N tree nodes (root included).
"""
import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kv_cache import KVCache
from tree import build_tree_buffers, tree_cuts
from verify import Draft, Drafter, speculative_generate


def lm_head_rows(base, vocab=None):
    """The base's frozen lm_head as a drafter's output head: (its weight (V', C), the token ids of its rows),
    over the token ids `vocab` (V',) only, or all of them (ids None)."""
    return (base.lm_head.weight, None) if vocab is None else (base.lm_head.weight[vocab], vocab)


def base_features(model, seq, base=None):
    """What a feature drafter reads of the base on a text seq (B, T), from one forward: its last hidden states
    (B, T, C), or, for a drafter that taps layers, their inputs (B, T, len(taps) * C). base: another copy of
    the same base to read them from (default model.base)."""
    base = model.base if base is None else base
    return base.hidden(seq) if model.taps is None else base.hidden(seq, taps=model.taps)[1]


def feature_width(model) -> int:
    """How wide the features a feature drafter reads are: C, or len(taps) * C."""
    return model.base.config.n_embd * (len(model.taps) if model.taps else 1)


# ----------------------------------------------------------------------------------------------
# The trees: a fixed one, or EAGLE-2's dynamic tree

@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's tree (section 4): at each depth, expand the `topk` nodes of the last depth with the
    highest value (the product of the draft's probabilities along the path), each proposing its
    `topk` best tokens; `depth` depths; then keep the `nodes` nodes of highest value over all depths
    (root not counted): a connected tree, since a child's value never exceeds its parent's."""
    topk: int = 4
    nodes: int = 16
    depth: int = 5


def as_tree(tree):
    """A static tree (a list of rank paths, as Medusa's) or a DynamicTree, from what a checkpoint stores."""
    if isinstance(tree, DynamicTree):
        return tree
    if isinstance(tree, dict):
        return DynamicTree(**tree)
    return [tuple(p) for p in tree]


@functools.lru_cache(maxsize=4096)
def _buffers(choices: tuple, device: str):
    """The verifier's buffers for a tree drafted this step, built once per shape (shapes recur)."""
    return build_tree_buffers(list(choices), device)


@dataclass
class _StaticDepth:
    rank_index: torch.Tensor    # (n_d,) each depth-d node's slot in the (E_{d-1} * K_d) top-k of the entries above
    expand: torch.Tensor        # (E_d,) which depth-d nodes have children: their entries draft depth d + 1
    parent_entry: torch.Tensor  # (E_d,) for those, their parent's entry among depth d-1's (the root: 0)
    mask: torch.Tensor          # (E_d, P_d + E_d) additive: what each entry sees of its layer's tree entries


@functools.lru_cache(maxsize=256)
def _static_plan(node_paths: tuple, layers: int, device: str):
    """For a fixed tree (node paths in node order) drafted by `layers` layers, the index tensors and the
    tree masks that draft it depth by depth: ([top-k needed at each depth], [_StaticDepth for depths
    1..D]). An entry sees the entries of its ancestors in the same layer cache, and itself."""
    depth = max(len(p) for p in node_paths)
    by_depth = [[p for p in node_paths if len(p) == d] for d in range(depth + 1)]
    entry = {(): 0}  # a node with children -> its entry's index among its depth's entries
    seen = []        # the tree entries already in the current layer's cache, as node paths
    topk, plan = [], []
    tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
    for d in range(1, depth + 1):
        nodes = by_depth[d]
        K = max(p[-1] for p in nodes) + 1
        parents = {p[:-1] for p in by_depth[d + 1]} if d < depth else set()
        expand = [i for i, p in enumerate(nodes) if p in parents]
        if d > 1 and min(d, layers - 1) != min(d - 1, layers - 1):
            seen = []  # this depth's entries go to another layer (a model with a layer per depth)
        new = [nodes[i] for i in expand]
        visible = torch.tensor([[q == p[:len(q)] for q in seen + new] for p in new], dtype=torch.bool)  # (E, P+E)
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).to(device)
        plan.append(_StaticDepth(tensor([entry[p[:-1]] * K + p[-1] for p in nodes]), tensor(expand),
                                 tensor([entry[nodes[i][:-1]] for i in expand]), mask))
        entry = {p: e for e, p in enumerate(new)}
        seen += new
        topk.append(K)
    return topk, plan


class FeatureDrafter(Drafter):
    """Drafts with feature-level layers (EAGLE's one layer; MTP's modules): one draft forward per depth,
    over that depth's expanded nodes, each layer with its own KV cache.

    The entry that drafts the children of a node n at depth d is fed the feature predicted by the
    entry of n's parent (for the root: the base's feature at the last committed position) and n's own
    token, and runs in layer min(d + 1, D) of the model's D layers (EAGLE: D = 1, its layer at every
    depth). It sees its layer's committed entries, the entries of n's ancestors in the same layer and
    itself: the tree mask, on the draft cache. Committed entries are computed from the base's true
    features once the tokens they pair with are known ("catch-up"); tree entries are forgotten after
    every step. The tree: a fixed one (rank paths, as Medusa's) or EAGLE-2's DynamicTree."""

    def __init__(self, model, tree, device):
        self.model, self.base, self.layers, self.taps = model, model.base, model.layers, model.taps
        self.device = torch.device(device)
        self.tree = as_tree(tree)
        if isinstance(self.tree, DynamicTree):
            if min(self.tree.topk, self.tree.nodes, self.tree.depth) < 1:
                raise ValueError(f"a dynamic tree needs topk, nodes and depth of at least 1, got {self.tree}")
            self.trees, self.nodes = None, self.tree.nodes + 1
            self.max_depth, self.max_entries = self.tree.depth, self.tree.topk * self.tree.depth
            largest_rank = self.tree.topk - 1
        else:
            self.trees = tree_cuts(self.tree, self.device)  # {depth: the tree cut there}, built once per (tree, device)
            full = self.trees[max(self.trees)]
            self.nodes, self.max_depth, self.max_entries = len(full.node_paths), full.depth, len(full.node_paths)
            largest_rank = full.topk - 1
        # Cheaper drafting (model.draft_dtype, model.draft_vocab): the layers in that dtype, and the output head's
        # rows for the drafting vocabulary.
        base = self.base
        head, self.vocab = model.token_head(model.draft_vocab)                          # (V', C), (V',) or None
        if largest_rank >= len(head):
            raise ValueError(f"the tree asks for rank {largest_rank} but the drafting vocabulary has {len(head)} tokens")
        self.dtype = model.draft_dtype or base.lm_head.weight.dtype
        self.run = [layer if self.dtype == base.lm_head.weight.dtype else copy.deepcopy(layer).to(self.dtype)
                    for layer in self.layers]
        self.head = head.to(self.dtype)                                                  # (V', C)
        self.caches = [KVCache(base.config, extra=self.max_entries, device=self.device, dtype=self.dtype, n_layer=1)
                       for _ in self.layers]
        self.committed = [0] * len(self.layers)  # each cache's committed entries (its tree's come after them)
        # Features by position: [0] the base's (C wide, or 3C: the layers EAGLE-3 taps), [l] layer l's outputs on
        # committed tokens (layer l + 1's input, C wide).
        C = base.config.n_embd
        self.features = [torch.zeros(base.config.block_size, C * (len(self.taps) if self.taps and l == 0 else 1),
                                     device=self.device, dtype=self.dtype) for l in range(len(self.layers))]
        self.known = 0  # base features are known at positions 0 .. known - 1

    # -------------------------------------------------------------- once per generation, and after each step

    def start(self, state, h):
        self.features[0][:h.size(0)] = h.to(self.dtype)
        self.known = h.size(0)

    def commit(self, state, kept, h):
        self.features[0][self.known:self.known + len(kept)] = h[kept].to(self.dtype)  # the accepted nodes' true features
        self.known += len(kept)
        for cache, length in zip(self.caches, self.committed):
            cache.rollback(length)                                                    # forget the tree's entries

    # -------------------------------------------------------------- the pieces of one step

    def _logits(self, index, out):
        """Logits over the drafting vocabulary of layer `index`'s outputs (E, C): (E, V'). Ranks need no more."""
        return F.linear(self.run[index].norm_out(out), self.head)

    def _logp(self, index, out):
        """Log-probabilities over the drafting vocabulary: what a dynamic tree's values add up."""
        return F.log_softmax(self._logits(index, out).float(), -1)

    def _layer_of(self, d):
        """(which layer drafts the children of a depth-d node, how far past L - 1 its entry sits)."""
        return min(d, len(self.layers) - 1), max(0, d + 1 - len(self.layers))

    def _catch_up(self, tokens):
        """Each layer's committed entries, up to the last its tokens allow; tokens (L + 1,): the committed
        ones and the root. Returns the root's entry output (C,): layer 1's at position L - 1."""
        L = tokens.numel() - 1
        for index, (layer, cache) in enumerate(zip(self.run, self.caches)):
            start, end = cache.length, L - layer.ahead + 1          # entries start..end-1 pair with known tokens
            f = self.features[index][start:end]                                        # (E, C) or (E, 3C)
            out = layer(self.base, f[None], tokens[None, start + layer.ahead:end + layer.ahead],
                        torch.arange(start, end, device=self.device), None, cache)[0]  # (E, C)
            if index + 1 < len(self.layers):
                self.features[index + 1][start:end] = out                              # the next layer's input
            if index == 0:
                root_out = out[-1]
            self.committed[index] = cache.length
        return root_out

    def _expand(self, d, parent_out, node_tokens, mask, L):
        """The entries of E nodes at depth d >= 1, in one forward: fed their parents' entry outputs (E, C)
        and their own tokens (E,); mask (E, P + E): what each sees of the P tree entries already in this
        layer and of the new ones (its ancestors' and itself), bool or additive; the layer's committed
        entries are visible to all. Returns the outputs (E, C)."""
        index, offset = self._layer_of(d)
        anchors = torch.full((node_tokens.numel(),), L - 1 + offset, device=self.device)
        return self.run[index](self.base, parent_out[None], node_tokens[None], anchors, mask, self.caches[index])[0]

    def _rows_for(self, d, rows, parents):
        """The new entries' rows over this layer's tree entries: their parents' rows, then themselves (E, P+E);
        none of the parents' when depth d's entries go to another layer than their parents'."""
        if not (d > 1 and self._layer_of(d)[0] == self._layer_of(d - 1)[0]):
            rows = rows[:, :0]
        own = torch.eye(len(parents), dtype=torch.bool, device=self.device)
        return torch.cat([rows[parents], own], 1)

    def _tokens(self, ids):
        return ids if self.vocab is None else self.vocab[ids]  # drafting-vocabulary slots -> token ids

    # -------------------------------------------------------------- one step's tree

    def propose(self, state, root, depth):
        tokens = torch.cat([state.tokens[0], root.view(1)])                 # (L + 1,): committed, then the root
        L = tokens.numel() - 1
        root_out = self._catch_up(tokens)                                    # (C,)
        depth = min(depth, self.max_depth)
        if self.trees is not None:
            return self._static(root, root_out, self.trees[depth], L)
        return self._dynamic(root, root_out, depth, L)

    def _static(self, root, root_out, buffers, L):
        """A fixed tree: node (r1, ..., rd) carries rank rd of the distribution drafted for its parent."""
        topk, plan = _static_plan(tuple(buffers.node_paths), len(self.layers), str(self.device))
        ranks = self._logits(0, root_out[None]).topk(topk[0], -1).indices  # (1, K_1): the root's children
        out, tokens = root_out[None], [root.view(1)]
        for d, step in enumerate(plan, start=1):
            tokens.append(self._tokens(ranks.flatten()[step.rank_index]))   # (n_d,) this depth's tokens
            if d < len(plan):                                                 # draft depth d + 1
                out = self._expand(d, out[step.parent_entry], tokens[-1][step.expand], step.mask, L)
                ranks = self._logits(self._layer_of(d)[0], out).topk(topk[d], -1).indices  # (E_d, K_{d+1})
        tree_tokens = torch.cat(tokens)                                      # (N,): node order is depth by depth
        candidates = torch.where(buffers.padding, -1, tree_tokens[buffers.gather_index])  # (P, L)
        return Draft(tree_tokens, candidates, buffers)

    def _dynamic(self, root, root_out, depth, L):
        """EAGLE-2: expand the top-k nodes of each depth by value, then keep the best `nodes` of all."""
        k = self.tree.topk
        top = self._logp(0, root_out[None])[0].topk(k)                       # the root's k children
        values, ids, frontiers = [top.values.double()], [top.indices], []    # per depth: path log-probs, slots
        out, rows = root_out[None].expand(k, -1), torch.zeros(1, 0, dtype=torch.bool, device=self.device)
        frontier, parents = torch.arange(k, device=self.device), torch.zeros(k, dtype=torch.long, device=self.device)
        for d in range(1, depth):                                            # draft depth d + 1
            rows = self._rows_for(d, rows, parents)                          # (k, P + k)
            out = self._expand(d, out, self._tokens(ids[-1][frontier]), rows, L)
            top = self._logp(self._layer_of(d)[0], out).topk(k, -1)         # (k, k): each node's k best
            children = values[-1][frontier, None] + top.values.double()     # (k, k): the paths' log-probs
            values.append(children.flatten())                                # (k*k,) entry-major
            ids.append(top.indices.flatten())
            frontier = values[-1].topk(k).indices                            # the next depth's k best
            frontiers.append(frontier)
            parents = frontier // k                                          # their parents' entries
            out = out[parents]
        # The best `nodes` drafted; a tiny penalty per depth keeps a parent ahead of a child of equal value
        # (a probability of 1 in float32: the values are float64, where the penalty is exact).
        flat = torch.cat([v - 1e-6 * d for d, v in enumerate(values)])
        keep = flat.topk(min(self.tree.nodes, flat.numel())).indices
        read = torch.cat([keep] + frontiers[:-1]).tolist()                   # the drafter's one read from the device
        keep, expanded = read[:keep.numel()], read[keep.numel():]  # and which nodes of depths 2 .. depth-1 were expanded
        return self._build(root, keep, expanded, k, depth, torch.cat([self._tokens(i) for i in ids]))

    def _build(self, root, keep, expanded, k, depth, flat_tokens):
        """The host side of a dynamic tree: the kept nodes' rank paths, their buffers (cached per shape),
        and their tokens in node order. keep: flat indices over the depths' nodes (k, then k*k per
        depth); expanded: the indices, within depths 2 .. depth - 1, of the nodes that were expanded."""
        expanded = [expanded[i * k:(i + 1) * k] for i in range(depth - 2)]
        starts = [0] + [k + i * k * k for i in range(depth - 1)]             # where each depth's nodes begin

        def path(d, i):  # node i of depth d (1-based depth) -> its rank path
            if d == 1:
                return (i,)
            parent = i // k if d == 2 else expanded[d - 3][i // k]           # its parent among depth d-1's nodes
            return path(d - 1, parent) + (i % k,)

        paths = {}
        for f in keep:
            d = max(j for j, s in enumerate(starts) if s <= f) + 1
            paths[path(d, f - starts[d - 1])] = f
        buffers = _buffers(tuple(sorted(paths, key=lambda p: (len(p), p))), str(self.device))
        index = torch.tensor([paths[p] for p in buffers.node_paths[1:]], device=self.device)
        tree_tokens = torch.cat([root.view(1), flat_tokens[index]])         # (N,) in node order
        candidates = torch.where(buffers.padding, -1, tree_tokens[buffers.gather_index])  # (P, L)
        return Draft(tree_tokens, candidates, buffers)


@torch.no_grad()
def feature_generate(model, idx, max_new_tokens: int, tree, temperature: float = 0.0, sampling: str = "typical",
                     posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, stop_tokens=None, stream=None):
    """Decoding with a feature drafter (EAGLE's layer, MTP's modules): (1, S) -> ((1, S + n), DecodeStats), as
    medusa_mini.medusa_generate, the tree (rank paths, or a DynamicTree) drafted depth by depth by
    model.layers and verified by verify.speculative_generate."""
    drafter = FeatureDrafter(model, tree, idx.device)
    return speculative_generate(model.base, drafter, idx, max_new_tokens, temperature, sampling,
                                posterior_threshold, posterior_alpha, stop_tokens, stream)


# ----------------------------------------------------------------------------------------------
# How often drafts are right, depth by depth: what a tree is grown from

def chain_accuracies(model, seq, start, depth, ranks, features=None, vocab=None):
    """chain_hits, as frequencies: a[d][r], depth lists of `ranks` floats (0 where no path reached d)."""
    return [(hits / max(count, 1)).tolist() for hits, count in chain_hits(model, seq, start, depth, ranks, features,
                                                                          vocab)]


@torch.no_grad()
def chain_hits(model, seq, start, depth, ranks, features=None, vocab=None):
    """How often the layers' rank-r draft at depth d + 1 is the text's own token, given that the drafts
    before it were within the top `ranks`: the table tree.grow_tree grows a tree from, as Medusa's head
    accuracies are. For a drafter conditioned on its path, a product of these is the chain rule, not an
    assumption of independence.

    seq (B, T): text the base wrote (greedy for greedy trees, sampled for exact sampling's); start:
    the first position whose next token counts (the prompt's last). Returns, per depth, (hits at each
    rank (ranks,), positions counted): texts of different lengths are scored one by one and summed."""
    w, ids = model.token_head(vocab)                                            # (V', C), (V',) or None
    B, T = seq.shape
    reached = torch.ones(B, T - 1 - depth, dtype=torch.bool, device=seq.device)
    found = []
    for d, (layer, out) in enumerate(chain_outputs(model, seq, depth, features), start=1):
        guesses = F.linear(layer.norm_out(out), w.to(out.dtype)).topk(ranks, -1).indices  # (B, n, ranks)
        guesses = guesses if ids is None else ids[guesses]
        hits = guesses == seq[:, d + 1:d + 1 + out.size(1), None]               # token i + d + 1: (B, n, ranks)
        counted = reached[:, start:]                                            # positions whose path is in reach
        found.append((hits[:, start:][counted].float().sum(0).cpu(), int(counted.sum())))
        reached &= hits.any(-1)
    return found


def chain_mask(n, chains, device=None):
    """(n, n * (chains + 1)) bool: what a draft layer's entry at position i sees when it drafts on its own
    predictions, `chains` steps past its true entries: its true entries up to i (causal), then, in each step
    since, only its own chain's entry, at i (the diagonal). Decoding sees exactly this on a tree's path
    (FeatureDrafter's tree mask); EAGLE-3's training-time test trains on it (eagle3.py)."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return torch.cat([causal] + [torch.eye(n, dtype=torch.bool, device=device)] * chains, 1)


def unroll(model, seq, depth, features=None, new_cache=None):
    """Teacher-forced drafting along a text: for d = 1 .. depth, (the layer that drafts depth d, its
    outputs (B, n, C) at every position i = 0 .. n-1, n = T - 1 - depth), the entry at position i being
    the one a step whose root is t_{i+1} would draft depth d with, had its earlier drafts been the
    text's tokens. Each depth is fed the text's token and the layer's own predicted feature.

    features (B, T, C) (or 3C: the layers a drafter taps): the base's at seq, when already at hand (default:
    a forward). One forward per depth on a batch cache per layer: layer d runs causally over its true
    entries; past the last layer, the last layer's entry at i sees its true entries up to i and its own chain
    (chain_mask). new_cache: makes each layer's cache (default a KVCache; training passes one that keeps
    the gradients). chain_outputs runs this without gradients; EAGLE-3's training-time test with them."""
    base, layers = model.base, model.layers
    B, T = seq.shape
    D = len(layers)
    f = base_features(model, seq) if features is None else features                 # (B, T, C) or (B, T, 3C)
    width = feature_width(model)
    if f.size(-1) != width:  # another drafter's features (EAGLE-3 reads three layers) would draft silently wrong
        raise ValueError(f"features {f.size(-1)} wide: this drafter reads {width} (taps {model.taps})")
    n = T - 1 - depth                                                                # positions with a token depth + 1 ahead
    caches = [new_cache() if new_cache else KVCache(base.config, batch_size=B, capacity=T * (depth + 1),
                                                    device=seq.device, dtype=f.dtype, n_layer=1) for _ in layers]
    positions = torch.arange(n, device=seq.device)
    out = layers[0](base, f[:, :n], seq[:, 1:n + 1], positions, None, caches[0])     # (B, n, C): layer 1's entries
    for d in range(1, depth + 1):                                                   # out: the entries drafting depth d
        yield layers[min(d, D) - 1], out
        if d == depth:
            return
        tokens = seq[:, d + 1:d + 1 + n]                                            # the text's token at depth d
        if d < D:  # layer d + 1: along the text its entries are all true ones, causal
            out = layers[d](base, out, tokens, positions, None, caches[d])
        else:      # the last layer again, each entry on its own chain: its true entries up to i, then its own
            out = layers[-1](base, out, tokens, positions + d + 1 - D, chain_mask(n, d + 1 - D, seq.device),
                             caches[-1])


@torch.no_grad()
def chain_outputs(model, seq, depth, features=None):
    """unroll, without gradients: what the accuracies a tree is grown from read."""
    yield from unroll(model, seq, depth, None if features is None else features.to(model.base.lm_head.weight.dtype))


@torch.no_grad()
def chain_proposals(model, seq, h, t, depth, ranks):
    """The layers' top tokens at each depth along each draw's own path (the entries at position t - 1); h: the
    base's last hidden states on seq (read again where the drafter taps other layers)."""
    w, ids = model.token_head()
    outs = [layer.norm_out(out[:, t - 1]) for layer, out in chain_outputs(model, seq, depth,
                                                                          h if model.taps is None else None)]
    top = F.linear(torch.stack(outs, 1), w).topk(ranks, -1).indices                           # (draws, D, ranks)
    return top if ids is None else ids[top]
