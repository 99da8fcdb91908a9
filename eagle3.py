"""EAGLE-3: a draft layer that reads three of the base model's layers and is trained on its own predictions
(Li, Wei, Zhang, Zhang: EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test, arXiv 2503.01840; read next to SafeAILab/EAGLE, eagle/model/cnets.py and
eagle/traineagle3/cnets.py, at commit cb7e0841).

It drafts as EAGLE does (eagle.py): one layer of the base's own kind, run once per depth of the tree on
its own KV cache, each node drafted for its own parent (feature_drafter.FeatureDrafter), and verified by
the shared verifier (verify.py). It differs from EAGLE-1 in three places, each marked in the code:

1. Fused features. The layer reads the residual stream entering three of the base's layers, low, middle
   and high, concatenated (3C), where EAGLE-1 reads the last hidden state (C); `fc` projects them to C
   without a bias. The verifier's own forwards return them (verify.Drafter.taps): no second forward.
2. No feature loss, and a vocabulary of its own. The layer is trained only to give the base's
   next-token distribution, over a draft vocabulary (the tokens its training text uses), through an
   output head of its own (`lm_head`, D x C); `d2t` maps a draft id to its token (token = id + d2t[id],
   offsets, as the engines store it) and `t2d` marks the tokens it drafts.
3. Training-time test. Training unrolls the layer for several steps: step 0 reads the base's fused
   features, step j >= 1 the layer's own output of step j - 1 at the same position, the token j further
   on, and sees, besides the base's positions up to its own (causal), only its own chain's entries of the
   earlier steps (feature_drafter.chain_mask): what it sees when it drafts depth j + 1. EAGLE-1 is
   trained on the base's true features only, and then drafts on its own, which it never saw in training.

The layers it reads (`feature_layers`): the reference's rule, the inputs of layers 2, N/2 and N - 3 (SmolLM2,
30 layers: 2, 15, 27; what vLLM, SGLang and llama.cpp assume when a draft names none). On a base of fewer than
8 layers that rule repeats layers or runs backwards (the tiny GPT has 4: 2, 2, 1), so there they are spread
evenly: the inputs of layers N // 4, N // 2 and N - N // 4 (4 layers: 1, 2, 3; 2 layers: 0, 1, 2, the
embedding, the middle and the last block's output before the final norm).

Shapes: B batch, T positions, C width, V the base's vocabulary, D the draft vocabulary.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from feature_drafter import unroll

STEPS = 7      # the reference unrolls 7 steps (eagle/traineagle3/cnets.py, self.length)
DECAY = 0.8    # step j's loss weighs DECAY ** j (eagle/traineagle3/main.py)


def feature_layers(n_layer: int) -> tuple:
    """The three base layers whose input EAGLE-3 reads, low to high (the module docstring says why)."""
    if n_layer >= 8:
        return (2, n_layer // 2, n_layer - 3)
    return (n_layer // 4, n_layer // 2, n_layer - n_layer // 4)


class Eagle3Layer(nn.Module):
    """f^ = block(x = [input_norm(embed(t)); hidden_norm(f)], residual f), where f is fc(the base's fused features)
    or, deeper in a draft, the layer's own previous output; its tokens come from norm(f^) through its own lm_head.
    The block is of the base's own kind; its attention reads 2C (the embedding and the feature side by side, the
    embedding first, as the reference and every engine concatenate them)."""
    ahead = 1  # the token fed with feature f_i sits this many positions after it

    def __init__(self, base, taps, draft_vocab_size):
        super().__init__()
        C, w = base.config.n_embd, base.lm_head.weight
        self.fc = nn.Linear(len(taps) * C, C, bias=False, device=w.device, dtype=w.dtype)  # NEW (1): 3C -> C
        self.input_norm, self.hidden_norm = base.new_norm(), base.new_norm()
        self.block = base.new_block(input_norm=False, attn_in=2 * C)
        self.norm = base.new_norm()
        self.lm_head = nn.Linear(C, draft_vocab_size, bias=False, device=w.device, dtype=w.dtype)  # NEW (2)

    def forward(self, base, f, tokens, positions, attn_mask=None, cache=None):
        """f (B, T, 3C) the base's fused features, or (B, T, C) the layer's own outputs, at `positions` (T,); tokens
        (B, T) one position after each -> the layer's outputs (B, T, C), before its final norm (what a deeper
        draft reads). attn_mask and cache as in base.run_blocks."""
        if f.size(-1) != self.norm.weight.size(-1):  # NEW (1): the base's features are fused; its own are not
            f = self.fc(f)                                                            # (B, T, 3C) -> (B, T, C)
        e = base.embed(tokens, positions + self.ahead).to(f.dtype)                     # (B, T, C)
        x = torch.cat([self.input_norm(e), self.hidden_norm(f)], dim=-1)               # (B, T, 2C)
        return base.run_blocks([self.block], f, positions, attn_mask, cache, attn_input=x)

    def norm_out(self, out):
        """What its lm_head reads of the layer's output: normed, as a base's final hidden state is."""
        return self.norm(out)


class Eagle3Model(nn.Module):
    """A base model (`base`, frozen) and its EAGLE-3 draft layer (`eagle3`), reading the base's layers `taps`,
    drafting over `draft_vocab_size` tokens (d2t, t2d: set by set_vocab before training)."""

    def __init__(self, base, taps=None, draft_vocab_size=None):
        super().__init__()
        self.base = base
        self.taps = tuple(taps) if taps is not None else feature_layers(base.config.n_layer)
        V = base.config.vocab_size
        D = draft_vocab_size or V
        self.eagle3 = Eagle3Layer(base, self.taps, D)
        device = base.lm_head.weight.device
        self.register_buffer("d2t", torch.zeros(D, dtype=torch.long, device=device))   # NEW (2): token = id + d2t[id]
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool, device=device))   # the tokens it drafts
        self.draft_dtype = None  # cheaper drafting (verify.Drafter): another dtype
        self.draft_vocab = None  # its vocabulary is its own (d2t): a drafting vocabulary given is not used

    @property
    def layers(self):
        """The draft layers, in the order depths use them: one, used at every depth."""
        return [self.eagle3]

    @property
    def draft_ids(self):
        """The token id of each row of its lm_head: (D,)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab(self, ids):
        """Draft over the token ids `ids` (D,), ascending: d2t and t2d, and lm_head started from the base's rows for
        them (the reference starts it at random; the base's rows are a better start and cost nothing)."""
        ids = ids.to(self.d2t.device).sort().values
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()[ids] = True
        self.eagle3.lm_head.weight.copy_(self.base.lm_head.weight[ids])

    def token_head(self, vocab=None):
        """Its own output head and the token ids of its rows (vocab: unused, the vocabulary is its own)."""
        return self.eagle3.lm_head.weight, (None if bool((self.d2t == 0).all()) and len(self.d2t) ==
                                            self.base.config.vocab_size else self.draft_ids)


class GrowingCache:
    """A KV cache with KVCache's interface that concatenates where KVCache writes in place, so that training can
    take gradients through every step's keys and values (the training-time test reads earlier steps')."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def append(self, layer, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)    # (B, nh, length + T, hs)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def advance(self, n: int):
        self.length += n


def ttt_loss(model, features, y, h, steps=STEPS, decay=DECAY):
    """The training-time test on one batch (NEW (3)): the layer unrolled `steps` steps along the text, each
    step's output scored against the base's own next-token distribution over the draft vocabulary.

    features (B, T, 3C): the base's fused features at positions 0 .. T-1; y (B, T): the token after each
    position (-100 where there is none); h (B, T, C): the base's last hidden states there (its
    distributions, lm_head(h), are the targets: no feature loss, NEW (2)). Step j's entry at position t
    is fed token t + 1 + j and, for j >= 1, its own step j - 1 output at t (feature_drafter.unroll, with
    chain_mask), and predicts the base's distribution at t + 1 + j (the token t + 2 + j). Soft
    cross-entropy over the draft vocabulary, at positions where that distribution exists and the text's next
    token is one the layer drafts (the reference asks it of the base's top token: on the base's own greedy
    text the two are the same token, and this needs no pass over the whole vocabulary); step j weighs
    decay ** j. Returns (loss, per-step top-1 agreement with the base (steps,))."""
    B, T = y.shape
    n = T - steps                                                             # positions every step scores
    seq = torch.cat([y.new_zeros(B, 1), y.clamp(min=0)], dim=1)              # (B, T + 1): seq[t + 1] = y[t]
    with torch.no_grad():  # the base's distributions at every position, once for all the steps
        rows = model.base.lm_head.weight[model.draft_ids]                     # (D, C): the base's, over the draft ids
        targets = F.softmax(F.linear(h, rows).float(), dim=-1)                # (B, T, D): over the draft vocabulary
        draftable = model.t2d[y.clamp(min=0)] & (y >= 0)                      # (B, T): the text's next token is one it drafts
    total, agree = 0.0, []
    for j, (layer, out) in enumerate(unroll(model, seq, steps, features, new_cache=GrowingCache)):
        p = targets[:, 1 + j:1 + j + n]                                       # (B, n, D): the base at t + 1 + j
        counts = (y[:, j:j + n] >= 0) & draftable[:, 1 + j:1 + j + n]         # (B, n): the token fed, the target
        logq = F.log_softmax(F.linear(layer.norm_out(out), layer.lm_head.weight).float(), dim=-1)  # (B, n, D)
        step = -(p * logq).sum(-1)                                            # (B, n)
        total = total + decay ** j * (step * counts).sum() / counts.sum().clamp(min=1)
        agree.append(((logq.argmax(-1) == p.argmax(-1)) & counts).sum() / counts.sum().clamp(min=1))
    return total, torch.stack(agree)
