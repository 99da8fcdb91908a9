"""The verifier: how any drafted tree is checked by the base model, accepted and committed.

A drafter (Medusa's heads in medusa_mini.py, EAGLE's layer in eagle.py, MTP's modules in mtp.py)
proposes a tree of tokens that may follow the committed text. One verification step then:
  1. takes the drafter's tree (Drafter.propose; Medusa's is tree.generate_candidates)
  2. tree_decoding: one forward of the base over every node, with the tree attention mask
  3. evaluate_posterior: the longest prefix the base agrees with (greedy or typical acceptance),
     or sample_tree_walk (exact sampling: the model's own distribution)
  4. update_inputs: commit the accepted nodes, keep their cache entries, and take the next logits
     from the last accepted node; then the drafter is told what was kept (Drafter.commit).
Nothing here knows how the tree was drafted. Read next to docs/medusa.md, section 3.

Shapes: S committed tokens, T new tokens, C width, V vocabulary, N tree nodes (root included),
P root-to-leaf paths, L = tree depth + 1.
"""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kv_cache import KVCache
from tree import TreeBuffers, gather_paths


# ----------------------------------------------------------------------------------------------
# The token sampler plain and tree decoding share, and what a request must satisfy

def sample_token(logits, temperature: float = 0.0):
    """A token from logits (..., V) -> (...): argmax when temperature == 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = F.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.view(-1, probs.size(-1)), 1).view(probs.shape[:-1])  # (rows, V) -> (...)


def check_request(base, idx, max_new_tokens, temperature, sampling=None):
    """ValueError for a request the base cannot serve: empty prompts, nothing to generate, more
    tokens than the context holds, a negative temperature; for tree decoding (a sampling mode
    given), also more than one prompt or an unknown mode."""
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be non-empty prompts of shape (B, S), got {tuple(idx.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if idx.size(1) + max_new_tokens > base.config.block_size:
        raise ValueError(f"prompt ({idx.size(1)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"does not fit in block_size={base.config.block_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if sampling is not None and idx.size(0) != 1:
        raise ValueError(f"tree decoding takes one prompt, shape (1, S); got {tuple(idx.shape)}")
    if sampling is not None and sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")


# ----------------------------------------------------------------------------------------------
# What a drafter is, and what a step carries

@dataclass
class Draft:
    """A drafter's proposal for one step: the tree and its tokens."""
    tokens: torch.Tensor      # (N,) node tokens in node order; tokens[0] is the root the verifier chose
    candidates: torch.Tensor  # (P, L) the tokens of each retrieve row, -1 where padded
    buffers: TreeBuffers      # the tree's mask, positions and retrieve indices


class Drafter:
    """What the verifier asks of a drafter. Subclass it and fill in the three methods.

    The verifier calls start() once, after the prompt's forward; then, every step, propose() before
    the tree forward and commit() after the accepted nodes are committed. A drafter keeps its own
    state between the calls (Medusa: its heads' logits at the last accepted node; EAGLE and MTP:
    their layers' own KV caches). The tree may change from step to step (EAGLE-2 ranks its nodes
    by confidence every step); the verifier only needs each step's buffers.
    `nodes`: the most nodes, root included, a proposed tree can have (the base cache's room).
    `taps`: None, and the drafter reads the base's last hidden states (h, C wide); or the layers whose input it
    reads instead (EAGLE-3: three of them, concatenated, 3C wide), which the same forwards return.

    Drafts are only proposals: whatever tokens a drafter proposes, verification by the base keeps the
    output exact. So a drafter is free to draft cheaply, and the models carry two settings for it:
    `draft_dtype` (draft in another dtype, e.g. bfloat16 weights read half the bytes) and `draft_vocab`
    (token ids to draft over, e.g. those the drafter was trained on); None: as the base."""
    nodes: int = 1
    taps: tuple | None = None

    def start(self, state: "DecodeState", h):
        """After the prompt's forward: h (S, C), the base's last hidden states at every prompt position (or
        its features at the layers in `taps`)."""
        raise NotImplementedError

    def propose(self, state: "DecodeState", root, depth: int) -> Draft:
        """The tree for the next step, rooted at `root` (a 0-d token chosen by the verifier: the argmax of
        state.logits, or a draw), at most `depth` nodes deep (>= 1: the room left before the end)."""
        raise NotImplementedError

    def commit(self, state: "DecodeState", kept: list[int], h):
        """After the step: kept, the accepted node indices (root first, host ints); h (N, C), the tree
        pass's hidden states, or its features at `taps` (h[kept[-1]] is where the next step starts);
        state.tokens, committed."""
        raise NotImplementedError


@dataclass
class DecodeState:
    """What a step needs: the committed tokens, their cache, and the logits at the last one."""
    tokens: torch.Tensor       # (1, S) committed tokens: a view of `buffer`
    buffer: torch.Tensor       # (1, block_size) room for every token the context can hold
    cache: KVCache             # S entries
    logits: torch.Tensor       # (V,) base logits at the last committed position
    root: torch.Tensor | None = None  # exact sampling: the next root, already drawn


@dataclass
class DecodeStats:
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per step: tokens accepted after the root
    token_depths: list[int] = field(default_factory=list)    # per new token: 0 = root, k = drafted k deep

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per verification step, the root (bonus) token included."""
        return len(self.token_depths) / max(self.steps, 1)


# ----------------------------------------------------------------------------------------------
# The step

def base_pass(base, idx, position_ids=None, attn_mask=None, cache=None, taps=None):
    """One forward of the base: (its last hidden states h (T, C), what the drafter reads: h itself, or the
    residual stream entering the layers in `taps`, concatenated (T, len(taps) * C)), for one sequence."""
    if taps is None:
        h = base.hidden(idx, position_ids, attn_mask, cache)[0]              # (1, T, C) -> (T, C)
        return h, h
    h, features = base.hidden(idx, position_ids, attn_mask, cache, taps)    # (1, T, C), (1, T, 3C)
    return h[0], features[0]


def prefill(base, idx, extra: int = 0, taps=None):
    """Run the prompt (1, S) once; keep its cache and the logits at its last position.
    `extra` cache slots beyond block_size hold the tree nodes being verified.
    Returns (DecodeState, the drafter's features at every prompt position: h (S, C), or those at `taps`)."""
    S = idx.size(1)
    cache = KVCache(base.config, extra=extra, device=idx.device, dtype=base.lm_head.weight.dtype)
    buffer = idx.new_zeros(1, base.config.block_size)
    buffer[:, :S] = idx
    h, features = base_pass(base, idx, cache=cache, taps=taps)
    return DecodeState(buffer[:, :S], buffer, cache, base.lm_head(h[-1])), features


def tree_decoding(base, tree_tokens, buffers: TreeBuffers, cache: KVCache, taps=None):
    """Step 2: one forward over all N tree nodes on top of the S cached tokens (S + N entries after it).

    tree_tokens (N,) in node order. Before: cache.length == S, the committed tokens
    (state.tokens.size(1) before the step). Each node sits at position S + its depth and sees the
    S committed tokens, its ancestors and itself (buffers.attn_bias). After: cache.length == S + N,
    node n's entry in slot S + n. Returns the drafter's features (N, C): the hidden states, or those at
    `taps` (Drafter.taps) and base logits (N, V); logits[n] predicts the token after node n. ValueError if
    the deepest node would sit at or past block_size."""
    S, block = cache.length, base.config.block_size
    if S + buffers.depth >= block:
        raise ValueError(f"a {buffers.depth}-deep tree after {S} tokens does not fit in block_size={block}: "
                         f"cut the tree")
    position_ids = S + buffers.position_ids                                 # (N,): each node at S + its depth
    h, features = base_pass(base, tree_tokens.view(1, -1), position_ids, buffers.attn_bias, cache, taps)  # (N, C)
    return features, base.lm_head(h)


class Accepted(NamedTuple):
    """What step 3 decided: the best candidate row, how many of its drafts after the root are accepted,
    and whether its accepted run ends with a stop token (always False without stop tokens)."""
    best: int
    accept: int
    stopped: bool


def evaluate_posterior(logits, candidates, temperature: float = 0.0, posterior_threshold: float = 0.09,
                       posterior_alpha: float = 0.3, path_lengths=None, stop_tokens=None) -> Accepted:
    """Step 3: the best candidate row and how many of its tokens after the root are accepted.

    logits (P, L, V): logits[r, j] predicts token j+1 of row r. candidates (P, L), padded with -1.
    path_lengths (P,): real tokens per row, root included (default: the non-negative entries).
    A row ends at its first -1 (or at path_lengths); padding is never accepted. Slot 0 (the root)
    is never judged; logits[:, -1] judge nothing.
    Greedy (temperature 0): accept while the token is the argmax; best = first longest row.
    Typical: with p = softmax(logits / temperature) and H its entropy (natural log, 0 log 0 = 0),
    accept while p(token) > min(posterior_threshold, posterior_alpha * exp(-H)) (the paper's epsilon
    and alpha), strictly; among the longest rows the best has the largest sum of log p over its
    accepted tokens only (ties: the first such row).
    A row's accept length is its leading run of accepted drafts: nothing after a rejection counts.
    Nothing accepted anywhere: best 0, accept 0, in both modes.
    stop_tokens (k,): a row also ends after its first stop token (the stop itself can be accepted;
    the root counts too); `stopped` says whether the best row's accepted run ends with one.
    Returns Accepted(best, accept, stopped), Python values: the step's one read from the device.
    A ValueError when the logits are not (P, L, V) for the candidates (P, L)."""
    P, L = candidates.shape
    if logits.shape[:2] != (P, L):
        raise ValueError(f"logits {tuple(logits.shape)} must be (P, L, V) for candidates {tuple(candidates.shape)}")
    drafts = candidates[:, 1:]                                                # (P, L-1)
    if temperature == 0:
        ok = drafts == logits[:, :-1].argmax(-1)                              # (P, L-1): padding (-1) never matches
    else:
        scaled = logits[:, :-1].float() / temperature                         # (P, L-1, V)
        p, logp = F.softmax(scaled, dim=-1), F.log_softmax(scaled, dim=-1)
        # H = -sum p log p, so exp(-H) = exp(sum p log p). The clamp keeps 0 * log 0 at 0, not NaN.
        neg_entropy = (p * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)  # (P, L-1)
        threshold = torch.clamp(posterior_alpha * torch.exp(neg_entropy), max=posterior_threshold)
        index = drafts.clamp(min=0).unsqueeze(-1)                             # (P, L-1, 1): padding reads token 0
        ok = p.gather(-1, index).squeeze(-1) > threshold                      # (P, L-1), strict as in the paper
        ok = ok & (drafts >= 0)
    if path_lengths is not None:  # rows may end before their padding does
        ok = ok & (torch.arange(1, L, device=ok.device) < path_lengths[:, None])  # (P, L-1): slot j+1 is real
    first_stop = None
    if stop_tokens is not None:  # nothing after a row's first stop token: its index, L if none
        is_stop = torch.isin(candidates, stop_tokens)                         # (P, L)
        first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), L)  # (P,)
        ok = ok & (torch.arange(1, L, device=ok.device) <= first_stop[:, None])  # (P, L-1)
    # A row's accept length is the position of its first rejection.
    ok = F.pad(ok, (0, 1), value=False)                                       # (P, L-1) -> (P, L): one always comes
    lengths = ok.float().argmin(1)                                            # (P,): argmin gives the first False
    # The step's one read from the device: every row's length (greedy: the first longest row is found on
    # the host), or the best row and its length (typical); and where a stop token ends the rows.
    if temperature == 0:
        read = lengths if first_stop is None else torch.stack([lengths, first_stop])  # (P,) or (2, P)
        lengths, stops = (read.tolist(), None) if first_stop is None else read.tolist()
        accept = max(lengths)
        best = lengths.index(accept)                                          # the first longest row
        return Accepted(best, accept, stops is not None and stops[best] == accept)
    accepted = torch.arange(L - 1, device=ok.device) < lengths[:, None]      # (P, L-1)
    score = (logp.gather(-1, index).squeeze(-1) * accepted).sum(1)            # (P,): log p of the accepted drafts
    score = score.masked_fill(lengths < lengths.max(), float("-inf"))         # only the longest rows compete
    best = score.argmax().view(1)                                             # (1,); ties: the first such row
    read = [best, lengths[best]] + ([] if first_stop is None else [first_stop[best]])
    best, accept, *stop = torch.cat(read).tolist()
    return Accepted(best, accept, bool(stop) and stop[0] == accept)


def sample_tree_walk(logits, tree_tokens, buffers: TreeBuffers, temperature: float):
    """Exact sampling: from the root, draw x ~ softmax(logits[node] / T); step into the child whose
    token is x, else stop. Returns (walked node indices, x drawn at the stopping node = next root).

    logits (N, V): per tree node, logits[n] predicts the token after node n. tree_tokens (N,): the
    root's token, tree_tokens[0], is already drawn and committed; the walk only decides what follows
    it. buffers.children[n]: node n's children. One draw per node visited (sample_token at
    `temperature`), none after the walk stops. walked: a list of Python ints starting with 0, each a
    child of the one before; x: the 0-d tensor drawn at walked[-1], never the token of one of its
    children."""
    node, walked = 0, [0]
    while True:
        x = sample_token(logits[node], temperature)
        child = next((c for c in buffers.children[node] if tree_tokens[c] == x), None)
        if child is None:
            return walked, x
        node = child
        walked.append(node)


def update_inputs(state: DecodeState, buffers: TreeBuffers, best: int, accept: int, candidates, logits):
    """Step 4: commit row `best`'s first accept + 1 nodes, keep their cache entries in contiguous
    slots, and take the next logits from the last accepted node (no extra forward).

    best, accept: Python ints from step 3; candidates (P, L); logits (N, V) from the tree pass.
    Before: S = state.tokens.size(1) committed tokens, and the cache holds S + N entries (the
    tree's, node n in slot S + n). After: state.tokens (1, S + accept + 1), a view of
    state.buffer, ends with row best's first accept + 1 tokens (the root first); the cache holds
    exactly their entries, in slots S .. S + accept; state.logits (V,) are the base logits at the
    last accepted node. Returns the kept node indices, a tensor (accept + 1,)."""
    S = state.tokens.size(1)
    nodes = buffers.retrieve_indices[best, :accept + 1]             # (a+1,) node indices on the device
    kept = buffers.rows[best][:accept + 1]                          # the same nodes, read on the host
    state.buffer[0, S:S + accept + 1] = candidates[best, :accept + 1]
    state.tokens = state.buffer[:, :S + accept + 1]                 # (1, S+a+1)
    if kept == list(range(accept + 1)):  # nodes 0..accept already sit in slots S..S+accept (the root alone always does)
        state.cache.rollback(S + accept + 1)
    else:
        state.cache.keep(S, nodes)
    state.logits = logits[kept[-1]]                                 # (V,)
    return nodes


SAMPLING = ("typical", "typical-fast", "exact")


def choose_root(state: DecodeState, temperature: float, sampling: str):
    """The next token the step commits whatever the drafts (the root), 0-d: the draw the exact walk made at the
    end of the previous step (exact), a draw from state.logits (typical), or their argmax (greedy; typical-fast,
    the reference's fast path, deterministic at any temperature)."""
    if temperature > 0 and sampling == "exact":
        return state.root
    if temperature > 0 and sampling == "typical":
        return sample_token(state.logits, temperature)
    return state.logits.argmax(-1)


def verify_step(base, drafter: Drafter, state: DecodeState, depth: int, temperature=0.0, sampling="typical",
                posterior_threshold=0.09, posterior_alpha=0.3, stop_tokens=None):
    """One verification step of the drafter's tree, at most `depth` deep: commits accept + 1 tokens.
    Returns (kept: the accepted node indices, root first, host ints; stopped: whether the committed
    tokens end with a stop token).

    The root: choose_root. sampling (temperature > 0): "typical" accepts drafts by the typical rule (fast,
    varied, not the model's distribution); "exact" walks the tree and keeps the model's distribution."""
    exact = temperature > 0 and sampling == "exact"
    draft = drafter.propose(state, choose_root(state, temperature, sampling), depth)   # 1
    h, logits = tree_decoding(base, draft.tokens, draft.buffers, state.cache, drafter.taps)  # 2
    buffers, stopped = draft.buffers, False
    if exact:                                                                           # 3
        walked, state.root = sample_tree_walk(logits, draft.tokens, buffers, temperature)
        if stop_tokens is not None:  # the walk reads tokens on the host anyway; this is one read more
            hits = torch.isin(draft.tokens[walked], stop_tokens).tolist()
            if True in hits:
                walked, stopped = walked[:hits.index(True) + 1], True
        best, accept = buffers.row_of[walked[-1]], len(walked) - 1  # a row whose prefix is the walk
    else:
        best, accept, stopped = evaluate_posterior(gather_paths(logits, buffers), draft.candidates, temperature,
                                                   posterior_threshold, posterior_alpha,
                                                   stop_tokens=stop_tokens)  # padding (-1) ends each row
    update_inputs(state, buffers, best, accept, draft.candidates, logits)              # 4
    kept = buffers.rows[best][:accept + 1]
    drafter.commit(state, kept, h)
    return kept, stopped


@torch.no_grad()
def speculative_generate(base, drafter: Drafter, idx, max_new_tokens: int, temperature: float = 0.0,
                         sampling: str = "typical", posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                         stop_tokens=None, stream=None):
    """Tree-verified decoding with any drafter: (1, S) -> ((1, S + n), DecodeStats), n = max_new_tokens,
    or fewer when a stop token is committed (it is the last token then).

    temperature 0: greedy acceptance, output identical to plain greedy decoding (medusa_mini.generate).
    temperature > 0: sampling "typical", "typical-fast" or "exact" (verify_step). stop_tokens: token ids
    that end the text; with none given, stopping costs nothing. stream: called after every step with
    the list of token ids it committed (a read from the device per step)."""
    check_request(base, idx, max_new_tokens, temperature, sampling)
    stop = torch.tensor(list(stop_tokens), device=idx.device) if stop_tokens else None  # (k,)
    state, h = prefill(base, idx, extra=drafter.nodes, taps=drafter.taps)
    drafter.start(state, h)
    if temperature > 0 and sampling == "exact":
        state.root = sample_token(state.logits, temperature)
    stats, end = DecodeStats(), idx.size(1) + max_new_tokens
    while state.tokens.size(1) < end:
        S = state.tokens.size(1)
        # Near the end, the drafter cuts its tree to the depth that still fits (end <= block_size, so positions fit).
        if end - S - 1 == 0:  # one token left: the root alone, nothing to verify
            state.buffer[0, S] = choose_root(state, temperature, sampling)
            state.tokens = state.buffer[:, :S + 1]
            kept, stopped = [0], False
        else:
            kept, stopped = verify_step(base, drafter, state, end - S - 1, temperature, sampling,
                                        posterior_threshold, posterior_alpha, stop)
        accept = len(kept) - 1
        stats.steps += 1
        stats.accept_lengths.append(accept)
        stats.token_depths.extend(range(accept + 1))  # the k-th committed node was drafted k deep
        if stream is not None:
            stream(state.tokens[0, S:].tolist())
        if stopped:
            break
    return state.tokens, stats
