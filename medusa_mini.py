"""medusa-mini: a small GPT, Medusa heads, and Medusa decoding (Cai, Dao et al., 2024).

Read next to the paper and docs/medusa.md. Medusa is the first of three drafters on one verifier
(verify.py); this file holds the base model, plain decoding (the reference), the heads and Medusa's
drafter. Shapes: B batch, T new tokens, S committed tokens, C = n_embd, nh heads of size
hs = C // nh, V vocab, K Medusa heads, N tree nodes, P root-to-leaf paths, L = tree depth + 1.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tree import generate_candidates, tree_cuts
from kv_cache import KVCache, cache_mask
from verify import Draft, Drafter, check_request, sample_token, speculative_generate


# ----------------------------------------------------------------------------------------------
# The base model: a GPT-2 style decoder whose attention takes an explicit mask, positions and cache.
# Every base (this GPT, smollm.Llama) answers to the same names, which the drafters use: config
# (n_embd, n_layer, n_kv_head, head_dim, vocab_size, block_size), embed, run_blocks, hidden (with `taps`: the
# residual stream entering chosen layers, which EAGLE-3 reads), lm_head, new_block and new_norm.

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


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, n_in: int | None = None):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.c_attn = nn.Linear(n_in or config.n_embd, 3 * config.n_embd)  # n_in: EAGLE-3's layer reads 2C
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, mask, cache: KVCache | None, layer: int):
        B, T, C = *x.shape[:2], self.n_embd
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
    def __init__(self, config: GPTConfig, input_norm: bool = True, attn_in: int | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd) if input_norm else nn.Identity()
        self.attn = CausalSelfAttention(config, attn_in)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x, mask, cache, layer, attn_input=None):
        """attn_input: what attention reads instead of ln_1(x) (EAGLE-3's draft layer); x stays the residual."""
        x = x + self.attn(self.ln_1(x) if attn_input is None else attn_input, mask, cache, layer)
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

    def embed(self, idx, position_ids):
        """The input of the first block: token plus learned position embedding, (B, T) -> (B, T, C).
        Positions enter here and nowhere else in a GPT (a Llama rotates them into attention instead)."""
        return self.wte(idx) + self.wpe(position_ids)

    def run_blocks(self, blocks, x, position_ids, attn_mask=None, cache: KVCache | None = None, taps=None,
                   attn_input=None):
        """x (B, T, C) through `blocks` in order (blocks[i] writes layer i of the cache), then the cache
        counts the T new entries. attn_mask (T, T) as in hidden(). Returns (B, T, C), before any final
        norm; with taps (layer indices), also [x entering each tapped block] (index len(blocks): after
        the last). position_ids are already in x (embed): the GPT's blocks take none. attn_input: what
        the one block's attention reads instead of its normed input (EAGLE-3's draft layer)."""
        mask = cache_mask(attn_mask, x.size(1), cache, x.dtype, x.device)   # (T, S+T) or None
        entering = []
        for layer, block in enumerate(blocks):
            entering.append(x)
            x = block(x, mask, cache, layer, attn_input)
        if cache is not None:
            cache.advance(x.size(1))
        return x if taps is None else (x, [(entering + [x])[i] for i in taps])

    def hidden(self, idx, position_ids=None, attn_mask=None, cache: KVCache | None = None, taps=None):
        """Last hidden states h (B, T, C), after the final layer norm.

        idx (B, T) new tokens. With a cache they sit after its S committed entries.
        position_ids (T,): default S, S+1, ... A tree passes depth + S; the caller keeps those
        below block_size (checking them here would read them back from the device every step).
        attn_mask (T, T) among the new tokens, bool (True = may attend) or additive (0 or -inf);
        default causal; a tree passes its own. Every new token also sees all S committed tokens.
        taps (layer indices): also return the residual stream entering those layers, concatenated,
        (B, T, len(taps) * C): (h, features), from the same forward."""
        T = idx.size(1)
        S = cache.length if cache is not None else 0
        if position_ids is None:
            if S + T > self.config.block_size:
                raise ValueError(f"{S + T} positions do not fit in block_size={self.config.block_size}")
            position_ids = self.positions[S:S + T]                      # (T,): a view, nothing computed
        x = self.embed(idx, position_ids)                               # (B, T, C)
        if taps is None:
            return self.ln_f(self.run_blocks(self.h, x, position_ids, attn_mask, cache))
        x, tapped = self.run_blocks(self.h, x, position_ids, attn_mask, cache, taps)
        return self.ln_f(x), torch.cat(tapped, dim=-1)                  # (B, T, C), (B, T, len(taps) * C)

    def forward(self, idx, position_ids=None, attn_mask=None, cache=None):
        """Next-token logits (B, T, V)."""
        return self.lm_head(self.hidden(idx, position_ids, attn_mask, cache))

    def new_block(self, input_norm: bool = True, attn_in: int | None = None) -> Block:
        """A fresh block of this model's kind, on its device and in its dtype (for a drafter's own layer).
        input_norm=False leaves out the block's first norm (EAGLE's draft layer has none); attn_in: the width
        its attention reads (EAGLE-3's reads 2C), default C."""
        w = self.lm_head.weight
        return Block(self.config, input_norm, attn_in).to(device=w.device, dtype=w.dtype)

    def new_norm(self) -> nn.Module:
        """A fresh final norm of this model's kind (LayerNorm), on its device and in its dtype."""
        w = self.lm_head.weight
        return nn.LayerNorm(self.config.n_embd, device=w.device, dtype=w.dtype)


# ----------------------------------------------------------------------------------------------
# NEW in Medusa: extra heads that guess tokens further ahead from the same hidden state

class MedusaHead(nn.Module):
    """logits_k = W2 (h + SiLU(W1 h + b1)). With W1 = 0 and b1 = 0 it is exactly the base lm_head.

    W2 is the head's own copy of lm_head (the paper), or, with share_lm_head, the base's frozen
    lm_head itself (as EAGLE's draft layer reads its tokens through it): then a head is only its
    residual block."""

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
        self.draft_dtype = None  # cheaper drafting (verify.Drafter): another dtype, a subset of the vocabulary
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
    Returns (loss, a 0-d tensor; per-head losses, (K,)). A ValueError if T <= K (a head with no target),
    saying the sequences must be longer than the number of heads."""
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
# How often the heads guess right: what a Medusa tree is grown from (docs/medusa.md section 4)

@torch.no_grad()
def head_hits(model, seq, start, depth, ranks, features=None, vocab=None):
    """docs/medusa.md section 4: how often head k's rank-r guess at position t is the text's token t+k+1,
    for t from `start` (the prompt's last position). Each head alone: Medusa's heads guess independently.
    seq (B, T): text the base wrote; features (B, T, C): its hidden states, when at hand. Returns, per
    head, (hits at each rank (ranks,), positions counted)."""
    if vocab is not None and not model.share_lm_head:
        raise ValueError("accuracies over part of the vocabulary need heads that share the base's lm_head")
    h = model.base.hidden(seq) if features is None else features.to(model.base.lm_head.weight.dtype)  # (B, T, C)
    proj = model.base.lm_head if vocab is None else (lambda r, rows=model.base.lm_head.weight[vocab]: F.linear(r, rows))
    found = []
    for k, head in enumerate(model.heads[:depth], start=1):
        positions = torch.arange(start, seq.size(1) - k - 1, device=seq.device)   # t with a token t+k+1
        guesses = head(h[:, positions], proj).topk(ranks, -1).indices              # (B, n, ranks)
        guesses = guesses if vocab is None else vocab[guesses]
        hits = guesses == seq[:, positions + k + 1, None]                          # (B, n, ranks)
        found.append((hits.flatten(0, 1).float().sum(0).cpu(), hits.size(0) * hits.size(1)))
    return found


@torch.no_grad()
def head_proposals(model, seq, h, t, depth, ranks):
    """Head k's top guesses at position t - 1, made before the root is drawn: the same on every path."""
    guesses = model.head_logits(h[0, t - 1], depth).topk(ranks, -1).indices           # (D, ranks)
    return guesses.expand(seq.size(0), -1, -1)                                     # (draws, D, ranks)


# ----------------------------------------------------------------------------------------------
# Plain decoding: the reference every drafter is checked against

@torch.no_grad()
def generate(model, idx, max_new_tokens: int, temperature: float = 0.0, stop_tokens=None):
    """Plain KV-cached decoding, one token per forward: (B, S) -> (B, S + max_new_tokens).

    Takes a base (GPT, smollm.Llama) or a model that carries one as `.base` (MedusaModel). A batch of
    equal-length prompts serves self-distillation; tree decoding compares against batch 1.
    stop_tokens: token ids that end a row; a row that has ended repeats its stop token, and decoding
    ends when every row has, so the output may be shorter: (B, S + n) with n <= max_new_tokens
    (with stop tokens, one read from the device per token)."""
    base = getattr(model, "base", model)
    check_request(base, idx, max_new_tokens, temperature)
    B, S = idx.shape
    cache = KVCache(base.config, device=idx.device, dtype=base.lm_head.weight.dtype, batch_size=B,
                    capacity=S + max_new_tokens)  # prompt + new tokens, not block_size
    out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # (B, S+n): filled in place
    stop = torch.tensor(list(stop_tokens), device=idx.device) if stop_tokens else None  # (k,)
    done = torch.zeros(B, dtype=torch.bool, device=idx.device) if stop is not None else None  # (B,)
    logits = base.lm_head(base.hidden(idx, cache=cache)[:, -1])  # prefill, logits at the last position: (B, V)
    for t in range(S, S + max_new_tokens):
        token = sample_token(logits, temperature)                # (B,)
        if stop is not None:
            token = torch.where(done, out[:, t - 1], token)      # a row that has ended repeats its stop token
            done |= torch.isin(token, stop)
        out[:, t] = token
        if stop is not None and bool(done.all()):
            return out[:, :t + 1]
        if t + 1 < S + max_new_tokens:
            logits = base(out[:, t:t + 1], cache=cache)[:, -1]  # (B, 1, V) -> (B, V)
    return out


# ----------------------------------------------------------------------------------------------
# Medusa decoding: the heads draft a fixed tree, the verifier (verify.py) checks it. One step is
# four named phases, as in the paper and the reference:
#   1. generate_candidates (tree.py, called by MedusaDrafter.propose)  2. tree_decoding
#   3. evaluate_posterior  4. update_inputs (the last three in verify.py)

class MedusaDrafter(Drafter):
    """Medusa's drafts: head k's top-k guesses at the last accepted node, laid out on a fixed tree.

    All heads read the same hidden state h_t, so every depth-k node with the same last rank carries
    the same token, whatever its parent (docs/medusa.md section 2). One drafter serves one generation."""

    def __init__(self, model: MedusaModel, choices, device):
        self.trees = tree_cuts(choices, device)  # {depth: the tree cut there}, built once per (tree, device)
        self.full = self.trees[max(self.trees)]
        if self.full.depth > len(model.heads):
            raise ValueError(f"the tree is {self.full.depth} deep but the model has only {len(model.heads)} heads")
        if self.full.topk > model.base.config.vocab_size:
            raise ValueError(f"the tree asks for rank {self.full.topk - 1} but the vocabulary has "
                             f"{model.base.config.vocab_size} tokens")
        self.model, self.nodes = model, len(self.full.node_paths)
        self.stack = HeadStack(model)  # the heads' weights, stacked once for the whole generation
        self.head_logits = None        # (D, V): the heads' logits at the last committed position
        self.depth = self.full.depth   # how many heads the next tree reads

    def start(self, state, h):
        self.head_logits = self.stack(h[-1], self.depth)                # (C,) -> (D, V)

    def propose(self, state, root, depth):
        buffers = self.trees[min(depth, self.full.depth)]
        self.depth = buffers.depth
        tree_tokens, candidates = generate_candidates(state.logits, self.head_logits, buffers, root)   # 1
        return Draft(tree_tokens, candidates, buffers)

    def commit(self, state, kept, h):
        # Only the heads this tree uses: each is a large product next to a small model.
        self.head_logits = self.stack(h[kept[-1]], self.depth)         # (C,) -> (D, V)


@torch.no_grad()
def medusa_generate(model: MedusaModel, idx, max_new_tokens: int, choices, temperature: float = 0.0,
                    sampling: str = "typical", posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                    stop_tokens=None, stream=None):
    """Medusa decoding: (1, S) -> ((1, S + max_new_tokens), DecodeStats); fewer tokens when a stop
    token ends the text (verify.speculative_generate).

    temperature 0: greedy acceptance, output identical to generate(). temperature > 0: sampling
    "typical" (the paper's typical acceptance with a sampled root: fast, varied, but not the model's
    distribution), "typical-fast" (the same with the argmax root: deterministic) or "exact" (the
    lossless tree walk: the same distribution as generate() at that temperature)."""
    drafter = MedusaDrafter(model, choices, idx.device)
    return speculative_generate(model.base, drafter, idx, max_new_tokens, temperature, sampling,
                                posterior_threshold, posterior_alpha, stop_tokens, stream)
