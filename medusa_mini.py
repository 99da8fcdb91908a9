"""medusa-mini: a small GPT, Medusa heads, and tree-verified decoding (Cai, Dao et al., 2024).

Read next to the paper and docs/medusa.md. Shapes: B batch, T new tokens, S committed
tokens, C = n_embd, nh heads of size hs = C // nh, V vocab, K Medusa heads, N tree nodes,
P root-to-leaf paths, L = tree depth + 1.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from tree import TreeBuffers, gather_paths, generate_candidates, tree_cuts


# ----------------------------------------------------------------------------------------------
# The base model: a GPT-2 style decoder whose attention takes an explicit mask, positions and cache

@dataclass
class GPTConfig:
    vocab_size: int = 2048  # tokens in the tokenizer
    block_size: int = 256   # longest sequence: the size of the position table
    n_layer: int = 4        # transformer blocks
    n_head: int = 4         # attention heads per block
    n_embd: int = 256       # width of the residual stream

    # What the KV cache needs to know; a model with grouped-query attention has fewer KV heads.
    @property
    def n_kv_head(self) -> int:
        return self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class KVCache:
    """Keys and values of every committed token, for every layer.

    Preallocated, not concatenated: rejecting draft tokens is then just "do not advance `length`"
    (as in gpt-fast), and keeping the accepted tree path is one indexed copy. During a forward
    each layer writes its T new entries after the `length` committed ones; `advance(T)` then
    counts them. `extra` slots beyond block_size hold the tree nodes being verified.
    `capacity` (default block_size + extra) sizes a cache for a known length, e.g. prompt + new tokens.
    Medusa decoding uses batch 1; a batch of B rows (same length) serves plain sampling.
    """

    def __init__(self, config: GPTConfig, extra: int = 0, device=None, dtype=torch.float32, batch_size: int = 1,
                 capacity: int | None = None):
        capacity = capacity or config.block_size + extra
        shape = (2, config.n_layer, batch_size, config.n_kv_head, capacity, config.head_dim)
        # Keys and values in one tensor, so that keep() moves both at once; k and v are its two halves,
        # views of shape (n_layer, B, n_kv, capacity, hs).
        self.kv = torch.zeros(shape, device=device, dtype=dtype)  # (2, n_layer, B, n_kv, capacity, hs)
        self.k, self.v = self.kv[0], self.kv[1]
        self.length = 0  # committed entries

    def append(self, layer: int, k, v):
        """Write new entries after the committed ones; return all keys and values (B, nh, length+T, hs)."""
        end = self.length + k.size(2)
        if end > self.k.size(3):
            raise ValueError(f"KV cache full: {end} entries asked for, capacity {self.k.size(3)}")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int):
        """Count the n entries the last forward appended as committed."""
        self.length += n

    def keep(self, start: int, indices):
        """Keep entries start + indices (ascending) in slots start, start+1, ...; drop every other entry after start.

        indices: a 1-D integer tensor on the cache's device, ascending, offsets counted from `start`
        (so 0 is the entry in slot `start`). Every layer, keys and values alike. Afterwards
        length == start + len(indices); slots from there on are free to be written over."""
        n = len(indices)
        # Keys and values of every layer, (2, n_layer, B, n_kv, n, hs): entries start + indices,
        # gathered, into slots start .. start+n-1
        self.kv[..., start:start + n, :] = self.kv[..., start:, :][..., indices, :]
        self.length = start + len(indices)

    def rollback(self, length: int):
        """Forget every entry after the first `length` (the slots are simply overwritten later).

        Afterwards self.length == length; nothing is erased or copied."""
        self.length = length


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, mask, cache: KVCache | None, layer: int):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)                             # (B, T, 3C) -> 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))                                        # (B, T, C) -> (B, nh, T, hs)
        if cache is not None:
            k, v = cache.append(layer, k, v)                                  # (B, nh, S+T, hs)
        # mask (T, S+T), True = may attend. No mask: causal without a cache (training, the fused
        # kernel), or one new token after the cache, which may see everything.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           is_causal=mask is None and cache is None)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                      # (B, nh, T, hs) -> (B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x, mask, cache, layer):
        x = x + self.attn(self.ln_1(x), mask, cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2 and nanoGPT
        self.register_buffer("positions", torch.arange(config.block_size), persistent=False)  # 0, 1, ...
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden(self, idx, position_ids=None, attn_mask=None, cache: KVCache | None = None):
        """Last hidden states h (B, T, C), after the final layer norm.

        idx (B, T) new tokens. With a cache they sit after its S committed entries.
        position_ids (T,): default S, S+1, ... A tree passes depth + S; the caller keeps those
        below block_size (checking them here would read them back from the device every step).
        attn_mask (T, T) among the new tokens, bool (True = may attend) or additive (0 or -inf);
        default causal; a tree passes its own. Every new token also sees all S committed tokens."""
        B, T = idx.shape
        S = cache.length if cache is not None else 0
        if position_ids is None:
            if S + T > self.config.block_size:
                raise ValueError(f"{S + T} positions do not fit in block_size={self.config.block_size}")
            position_ids = self.positions[S:S + T]                      # (T,): a view, nothing computed
        x = self.wte(idx) + self.wpe(position_ids)                      # (B, T, C)
        mask = None
        if attn_mask is not None or (cache is not None and T > 1):
            if attn_mask is None:
                attn_mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            if attn_mask.dtype == torch.bool:  # additive (0 or -inf): attention would convert it in every layer
                attn_mask = torch.zeros(T, T, device=x.device).masked_fill(~attn_mask, float("-inf"))
            mask = F.pad(attn_mask.to(x.dtype), (S, 0), value=0.0)      # (T, T) -> (T, S+T): the cache is visible
        for layer, block in enumerate(self.h):
            x = block(x, mask, cache, layer)
        if cache is not None:
            cache.advance(T)
        return self.ln_f(x)

    def forward(self, idx, position_ids=None, attn_mask=None, cache=None):
        """Next-token logits (B, T, V)."""
        return self.lm_head(self.hidden(idx, position_ids, attn_mask, cache))


# ----------------------------------------------------------------------------------------------
# NEW in Medusa: extra heads that guess tokens further ahead from the same hidden state

class MedusaHead(nn.Module):
    """logits_k = W2 (h + SiLU(W1 h + b1)). With W1 = 0 and b1 = 0 it is exactly the base lm_head.

    W2 is the head's own copy of lm_head (the paper), or, with share_lm_head, the base's frozen
    lm_head itself (as Hydra and EAGLE do): then a head is only its residual block."""

    def __init__(self, base, share_lm_head: bool = False):
        """The head of a base GPT: `residual`, nn.Linear(C, C) holding W1 and b1, and `proj`,
        nn.Linear(C, V, bias=False) holding W2 (None when share_lm_head: the base's lm_head serves).
        On the base's device and in its dtype. At init the head's logits equal the base's exactly
        (torch.equal) for every input, and W2 is the head's own copy of lm_head's weight."""
        super().__init__()
        C, V = base.config.n_embd, base.config.vocab_size
        w = base.lm_head.weight  # the heads live where the base does, in its dtype
        self.residual = nn.Linear(C, C, device=w.device, dtype=w.dtype)
        nn.init.zeros_(self.residual.weight)
        nn.init.zeros_(self.residual.bias)  # the reference leaves the bias random: heads would not be exact
        self.proj = None
        if not share_lm_head:
            self.proj = nn.Linear(C, V, bias=False, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                self.proj.weight.copy_(w)

    def forward(self, h, lm_head: nn.Module):
        """h (..., C) last hidden states -> logits (..., V). `lm_head` is the base's, used as W2 when
        the head has no `proj` of its own."""
        proj = lm_head if self.proj is None else self.proj
        return proj(h + F.silu(self.residual(h)))  # (..., C) -> (..., V)


class MedusaModel(nn.Module):
    """A base model (`base`) plus K heads; head k (1-based) at position t scores token t+k+1."""

    def __init__(self, base, num_heads: int = 5, share_lm_head: bool = False):
        super().__init__()
        self.base = base
        self.share_lm_head = share_lm_head
        self.heads = nn.ModuleList([MedusaHead(base, share_lm_head) for _ in range(num_heads)])
        # Decoding may draft more cheaply (HeadStack): in another dtype (e.g. bfloat16), and over a
        # subset of the vocabulary (token ids, e.g. those the heads were trained on). Drafts are only
        # proposals: verification by the base keeps the output exact whatever they are. None: as the base.
        self.draft_dtype = None
        self.draft_vocab = None

    def head_logits(self, h, num_heads: int | None = None):
        """Logits of the first num_heads heads (default all): (..., C) -> (K, ..., V)."""
        return torch.stack([head(h, self.base.lm_head) for head in self.heads[:num_heads]])

    def forward(self, idx, position_ids=None, attn_mask=None, cache=None):
        """(base_logits (B, T, V), head_logits (K, B, T, V))."""
        h = self.base.hidden(idx, position_ids, attn_mask, cache)
        return self.base.lm_head(h), self.head_logits(h)


class HeadStack:
    """`MedusaModel.head_logits` at one position, in four ops instead of four per head.

    A decoding step evaluates the heads at one hidden state; on a GPU what that costs is mostly one
    kernel launch per op. Stacking the heads' weights once per generation turns K small products
    into one batched product (tested equal to head_logits). The weights are taken in
    model.draft_dtype when it is set (a bfloat16 copy reads half the bytes of an fp32 projection),
    and only the rows of model.draft_vocab when it is set (a large vocabulary's projection is most
    of a head's cost). Built from the model's current weights: build a new one after training."""

    def __init__(self, model: MedusaModel):
        heads, dtype, vocab = model.heads, model.draft_dtype or model.base.lm_head.weight.dtype, model.draft_vocab
        rows = slice(None) if vocab is None else vocab
        self.w1 = torch.stack([head.residual.weight for head in heads]).to(dtype)           # (K, C, C)
        self.b1 = torch.stack([head.residual.bias for head in heads]).unsqueeze(1).to(dtype)  # (K, 1, C)
        self.w2 = None if model.share_lm_head else \
            torch.stack([head.proj.weight[rows] for head in heads]).to(dtype)               # (K, V', C)
        self.lm_head = model.base.lm_head.weight[rows].to(dtype)  # (V', C): a copy only if rows or dtype differ
        self.vocab, self.V = vocab, model.base.config.vocab_size

    def __call__(self, h, num_heads: int):
        """h (C,) -> (D, V) logits of the first D = num_heads heads, in the stack's dtype."""
        D, C = num_heads, h.size(-1)
        h = h.to(self.w1.dtype)                                             # a no-op unless drafting in another dtype
        r = torch.baddbmm(self.b1[:D], h.expand(D, 1, C), self.w1[:D].mT)   # (D, 1, C): W1 h + b1, per head
        r = h + F.silu(r)                                                   # (D, 1, C)
        logits = F.linear(r, self.lm_head) if self.w2 is None else torch.bmm(r, self.w2[:D].mT)  # (D, 1, V')
        logits = logits.view(D, -1)                                         # (D, 1, V') -> (D, V')
        if self.vocab is not None:  # tokens outside the drafting vocabulary are never proposed
            logits = logits.new_full((D, self.V), float("-inf")).index_copy_(1, self.vocab, logits)  # (D, V)
        return logits


def medusa_loss(head_logits, targets, decay: float = 0.8):
    """Medusa-1 loss sum_k decay^k CE_k: head k at position t is trained on token t+k+1.

    head_logits (K, B, T, V); targets (B, T), the next tokens (targets[:, t] = token t+1).
    So head k (1-based) at position t is scored against targets[:, t+k]: only T - k positions.
    CE_k is the mean cross-entropy over those positions and the batch.
    Returns (loss, a 0-d tensor; per-head losses, (K,)). ValueError if T <= K (a head with no target)."""
    K, B, T, V = head_logits.shape
    if T <= K:
        raise ValueError(f"{T} positions leave head {K} no target: sequences must be longer than the number of heads")
    losses = []
    for k in range(1, K + 1):
        logits = head_logits[k - 1, :, :T - k]                          # (B, T-k, V)
        losses.append(F.cross_entropy(logits.reshape(-1, V), targets[:, k:].reshape(-1)))
    loss = sum(decay ** k * l for k, l in enumerate(losses, start=1))
    return loss, torch.stack(losses)


# ----------------------------------------------------------------------------------------------
# Plain decoding: the reference every fast path is checked against

def _check_request(model, idx, max_new_tokens, temperature):
    base = model.base if isinstance(model, MedusaModel) else model
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be non-empty prompts of shape (B, S), got {tuple(idx.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if idx.size(1) + max_new_tokens > base.config.block_size:
        raise ValueError(f"prompt ({idx.size(1)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"does not fit in block_size={base.config.block_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return base


def sample_token(logits, temperature: float = 0.0, top_k: int | None = None):
    """A token from logits (..., V) -> (...): argmax when temperature == 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs.view(-1, probs.size(-1)), 1).view(probs.shape[:-1])  # (rows, V) -> (...)


@torch.no_grad()
def generate(model, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None):
    """Plain KV-cached decoding, one token per forward: (B, S) -> (B, S + max_new_tokens).

    Takes a GPT or a MedusaModel (then only its base is used). A batch of equal-length prompts
    serves self-distillation; Medusa decoding compares against batch 1."""
    base = _check_request(model, idx, max_new_tokens, temperature)
    B, S = idx.shape
    cache = KVCache(base.config, device=idx.device, dtype=base.lm_head.weight.dtype, batch_size=B,
                    capacity=S + max_new_tokens)  # prompt + new tokens, not block_size
    out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # (B, S+n): filled in place
    logits = base.lm_head(base.hidden(idx, cache=cache)[:, -1])  # prefill, logits at the last position: (B, V)
    for t in range(S, S + max_new_tokens):
        out[:, t] = sample_token(logits, temperature, top_k)    # (B,)
        if t + 1 < S + max_new_tokens:
            logits = base(out[:, t:t + 1], cache=cache)[:, -1]  # (B, 1, V) -> (B, V)
    return out


# ----------------------------------------------------------------------------------------------
# Medusa decoding. One step = four named phases, as in the paper and the reference:
#   1. generate_candidates (tree.py)  2. tree_decoding  3. evaluate_posterior  4. update_inputs

@dataclass
class DecodeState:
    """What a step needs: the committed tokens, their cache, and the logits at the last one."""
    tokens: torch.Tensor       # (1, S) committed tokens: a view of `buffer`
    buffer: torch.Tensor       # (1, block_size) room for every token the context can hold
    cache: KVCache             # S entries
    logits: torch.Tensor       # (V,) base logits at the last committed position
    head_logits: torch.Tensor  # (K, V) Medusa head logits there (the first K the tree uses)
    heads: HeadStack           # the heads' weights, stacked once for the whole generation
    root: torch.Tensor | None = None  # exact sampling: the next root, already drawn


@dataclass
class MedusaStats:
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per step: tokens accepted after the root
    token_depths: list[int] = field(default_factory=list)    # per new token: 0 = root, k = head k

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per verification step, the root (bonus) token included."""
        return len(self.token_depths) / max(self.steps, 1)


def prefill(model: MedusaModel, idx, extra: int = 0) -> DecodeState:
    """Run the prompt (1, S) once; keep its cache and the logits at its last position.
    `extra` cache slots beyond block_size hold the tree nodes being verified."""
    base = model.base
    S = idx.size(1)
    cache = KVCache(base.config, extra=extra, device=idx.device, dtype=base.lm_head.weight.dtype)
    buffer = idx.new_zeros(1, base.config.block_size)
    buffer[:, :S] = idx
    h = base.hidden(idx, cache=cache)[0, -1]  # (1, S, C) -> (C,)
    return DecodeState(buffer[:, :S], buffer, cache, base.lm_head(h), model.head_logits(h), HeadStack(model))


def tree_decoding(model: MedusaModel, tree_tokens, buffers: TreeBuffers, cache: KVCache):
    """Step 2: one forward over all N tree nodes on top of the S cached tokens (S + N entries after it).

    tree_tokens (N,) in node order. Before: cache.length == S, the committed tokens
    (state.tokens.size(1) before the step). Each node sits at position S + its depth and sees the
    S committed tokens, its ancestors and itself (buffers.attn_bias). After: cache.length == S + N,
    node n's entry in slot S + n. Returns hidden states (N, C) and base logits (N, V);
    logits[n] predicts the token after node n. ValueError if the deepest node would sit at or
    past block_size."""
    S, block = cache.length, model.base.config.block_size
    if S + buffers.depth >= block:
        raise ValueError(f"a {buffers.depth}-deep tree after {S} tokens does not fit in block_size={block}: "
                         f"cut the tree")
    position_ids = buffers.positions(block)[S]                              # (N,): S + depth, a row of a table
    h = model.base.hidden(tree_tokens.view(1, -1), position_ids, buffers.attn_bias, cache)[0]  # (N, C)
    return h, model.base.lm_head(h)


def evaluate_posterior(logits, candidates, temperature: float = 0.0, posterior_threshold: float = 0.09,
                       posterior_alpha: float = 0.3, path_lengths=None):
    """Step 3: the best candidate row and how many of its tokens after the root are accepted.

    logits (P, L, V): logits[r, j] predicts token j+1 of row r. candidates (P, L), padded with -1.
    path_lengths (P,): real tokens per row, root included (default: the non-negative entries).
    A row ends at its first -1 (or at path_lengths); padding is never accepted. Slot 0 (the root)
    is never judged; logits[:, -1] judge nothing.
    Greedy (temperature 0): accept while the token is the argmax; best = first longest row.
    Typical: with p = softmax(logits / temperature) and H its entropy (natural log, 0 log 0 = 0),
    accept while p(token) > min(posterior_threshold, posterior_alpha * exp(-H)) (the paper's epsilon
    and alpha), strictly; among the longest rows the
    best has the largest sum of log p over its accepted tokens only (ties: the first such row).
    A row's accept length is its leading run of accepted drafts: nothing after a rejection counts.
    Nothing accepted anywhere: (0, 0) in both modes.
    Returns (best_row, accept_length) Python ints: the step's only read from the device."""
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
        logp_draft = logp.gather(-1, index).squeeze(-1)                       # (P, L-1)
        ok = ok & (drafts >= 0)
    if path_lengths is not None:  # rows may end before their padding does
        ok = ok & (torch.arange(1, L, device=ok.device) < path_lengths[:, None])  # (P, L-1): slot j+1 is real
    # A row's accept length is the position of its first rejection.
    ok = F.pad(ok, (0, 1), value=False)                                       # (P, L-1) -> (P, L): one always comes
    lengths = ok.float().argmin(1)                                            # (P,): argmin gives the first False
    if temperature == 0:
        lengths = lengths.tolist()                                            # the step's one read from the device
        accept = max(lengths)
        return lengths.index(accept), accept                                  # the first longest row
    accepted = torch.arange(L - 1, device=ok.device) < lengths[:, None]      # (P, L-1)
    score = (logp_draft * accepted).sum(1)                                    # (P,)
    accept = lengths.max()
    best = score.masked_fill(lengths < accept, float("-inf")).argmax()       # ties: the first row
    best, accept = torch.stack([best, accept]).tolist()                      # the step's one read from the device
    return best, accept


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


def update_inputs(model: MedusaModel, state: DecodeState, buffers: TreeBuffers, best: int, accept: int,
                  candidates, h, logits):
    """Step 4: commit row `best`'s first accept + 1 nodes, keep their cache entries in contiguous
    slots, and take the next logits from the last accepted node (no extra forward).

    best, accept: Python ints from step 3; candidates (P, L); h (N, C) and logits (N, V) from the
    tree pass. Before: S = state.tokens.size(1) committed tokens, and the cache holds S + N entries
    (the tree's, node n in slot S + n). After: state.tokens (1, S + accept + 1), a view of
    state.buffer, ends with row best's first accept + 1 tokens (the root first); the cache holds
    exactly their entries, in slots S .. S + accept; state.logits (V,) and state.head_logits
    (buffers.depth, V) are the base and head logits at the last accepted node (state.heads gives
    the heads' logits in one batched product). Returns the kept node indices, a tensor (accept + 1,)."""
    S = state.tokens.size(1)
    nodes = buffers.retrieve_indices[best, :accept + 1]             # (a+1,) node indices on the device
    kept = buffers.rows[best][:accept + 1]                          # the same nodes, read on the host
    last = kept[-1]
    state.buffer[0, S:S + accept + 1] = candidates[best, :accept + 1]
    state.tokens = state.buffer[:, :S + accept + 1]                 # (1, S+a+1)
    if kept == list(range(accept + 1)):  # nodes 0..accept already sit in slots S..S+accept (the root alone always does)
        state.cache.rollback(S + accept + 1)
    else:
        state.cache.keep(S, nodes)
    state.logits = logits[last]                                     # (V,)
    # Only the heads this tree uses: each is a large product next to a small model.
    state.head_logits = state.heads(h[last], buffers.depth)         # (C,) -> (D, V)
    return nodes


def medusa_step(model, state: DecodeState, buffers: TreeBuffers, temperature=0.0, sampling="typical",
                posterior_threshold=0.09, posterior_alpha=0.3):
    """One verification step; commits accept + 1 tokens and returns (accepted nodes, accept_length).

    sampling (temperature > 0): "typical" draws the root from the model and accepts drafts by the
    typical rule; "typical-fast" takes the argmax root, so the output is deterministic (the
    reference's fast path); "exact" walks the tree and keeps the model's distribution."""
    root = None
    if temperature > 0 and sampling == "exact":
        root = state.root
    elif temperature > 0 and sampling == "typical":
        root = sample_token(state.logits, temperature)
    tree_tokens, candidates = generate_candidates(state.logits, state.head_logits, buffers, root)   # 1
    h, logits = tree_decoding(model, tree_tokens, buffers, state.cache)                            # 2
    if temperature > 0 and sampling == "exact":                                                    # 3
        walked, state.root = sample_tree_walk(logits, tree_tokens, buffers, temperature)
        best, accept = buffers.row_of[walked[-1]], len(walked) - 1  # a row whose prefix is the walk
    else:
        best, accept = evaluate_posterior(gather_paths(logits, buffers), candidates, temperature,
                                          posterior_threshold, posterior_alpha)  # padding (-1) ends each row
    nodes = update_inputs(model, state, buffers, best, accept, candidates, h, logits)              # 4
    return nodes, accept


SAMPLING = ("typical", "typical-fast", "exact")


@torch.no_grad()
def medusa_generate(model: MedusaModel, idx, max_new_tokens: int, choices, temperature: float = 0.0,
                    sampling: str = "typical", posterior_threshold: float = 0.09, posterior_alpha: float = 0.3):
    """Medusa decoding: (1, S) -> ((1, S + max_new_tokens), MedusaStats).

    temperature 0: greedy acceptance, output identical to generate(). temperature > 0: sampling
    "typical" (the paper's typical acceptance with a sampled root: fast, varied, but not the model's
    distribution), "typical-fast" (the same with the argmax root: deterministic) or "exact" (the
    lossless tree walk: the same distribution as generate() at that temperature)."""
    base = _check_request(model, idx, max_new_tokens, temperature)
    if idx.size(0) != 1:
        raise ValueError(f"Medusa decoding takes one prompt, shape (1, S); got {tuple(idx.shape)}")
    if sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
    trees = tree_cuts(choices, idx.device)  # built once per (tree, device), reused by every call
    full = trees[max(trees)]
    if full.depth > len(model.heads):
        raise ValueError(f"the tree is {full.depth} deep but the model has only {len(model.heads)} heads")
    if full.topk > base.config.vocab_size:
        raise ValueError(f"the tree asks for rank {full.topk - 1} but the vocabulary has {base.config.vocab_size} tokens")

    state = prefill(model, idx, extra=len(full.node_paths))
    if temperature > 0 and sampling == "exact":
        state.root = sample_token(state.logits, temperature)
    stats, end = MedusaStats(), idx.size(1) + max_new_tokens
    while state.tokens.size(1) < end:
        # Near the end, the tree cut to the depth that still fits (end <= block_size, so positions fit).
        depth = min(full.depth, end - state.tokens.size(1) - 1)
        if depth == 0:  # one token left: the root alone, nothing to verify
            root = state.root if state.root is not None else sample_token(state.logits, temperature)
            S = state.tokens.size(1)
            state.buffer[0, S] = root
            state.tokens = state.buffer[:, :S + 1]
            stats.steps += 1
            stats.accept_lengths.append(0)
            stats.token_depths.append(0)
            break
        _, accept = medusa_step(model, state, trees[depth], temperature, sampling,
                                posterior_threshold, posterior_alpha)
        stats.steps += 1
        stats.accept_lengths.append(accept)
        stats.token_depths.extend(range(accept + 1))  # the k-th committed node was proposed by head k
    return state.tokens, stats
