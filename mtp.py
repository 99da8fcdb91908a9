"""Multi-token prediction (MTP) as DeepSeek-V3 trains it (arXiv 2412.19437, section 2.2), used as a drafter.

Medusa adds heads to a finished model; MTP changes pretraining. Beside the
main model, D sequential modules learn to predict further ahead while the model learns the next
token. Module k, at position i, reads module k-1's hidden state there (the main model's, h^0, for
k = 1) and the embedding of the token k ahead, and predicts the token k + 1 ahead:
    h'_i = M_k [norm(Emb(t_{i+k})); norm(h^{k-1}_i)],   h^k_i = TRM_k(h'_{<=i}),   p = OutHead(norm(h^k_i)).
The embedding and output head are the main model's own; the loss is the main loss plus lambda / D
times the modules' cross-entropies. After training, the modules are a drafter: each reads a hidden
state and a token and predicts the next hidden state, as a feature drafter's layers do, so they draft
a tree depth by depth through feature_drafter.FeatureDrafter, module k drafting depth k and the last
module again deeper (vLLM reuses its module for extra steps). docs/medusa.md, section 9.

Shapes: B batch, T positions, C width, V vocabulary, D modules.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from feature_drafter import lm_head_rows
from kv_cache import KVCache


class MTPModule(nn.Module):
    """Module k: a 2C -> C projection of [norm(embedding of t_{i+k}); norm(h^{k-1}_i)], one block of the
    base's own kind (with its input norm), and a final norm before the base's output head.

    The norms and the block are the base's kinds (a GPT's LayerNorm where DeepSeek-V3 has RMSNorm).
    The concatenation puts the embedding first, as vLLM's DeepSeek MTP does (`enorm`, `hnorm`,
    `eh_proj`; the paper writes [h; emb]: the same model up to the order of M's columns). Positions:
    the block sits at the feature's position i, the token's embedding at its own, i + k."""

    def __init__(self, base, k: int):
        super().__init__()
        C, w = base.config.n_embd, base.lm_head.weight
        self.ahead = k                                   # the token fed with h_i sits at i + k
        self.enorm, self.hnorm = base.new_norm(), base.new_norm()
        self.proj = nn.Linear(2 * C, C, bias=False, device=w.device, dtype=w.dtype)  # DeepSeek-V3's M_k
        self.block = base.new_block()
        self.norm = base.new_norm()                      # the norm in front of the shared output head

    def forward(self, base, h, tokens, positions, attn_mask=None, cache: KVCache | None = None):
        """h (B, T, C): module k-1's hidden states (the base's final ones for k = 1) at positions (T,);
        tokens (B, T): the token k ahead of each -> h^k (B, T, C). attn_mask, cache: as base.run_blocks."""
        e = base.embed(tokens, positions + self.ahead).to(h.dtype)                 # (B, T, C)
        x = self.proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))            # (B, T, 2C) -> (B, T, C)
        return base.run_blocks([self.block], x, positions, attn_mask, cache)

    def norm_out(self, out):
        """What the shared output head reads of the module's hidden state."""
        return self.norm(out)


class MTPModel(nn.Module):
    """A base model (`base`) trained with D MTP modules (`mtp`)."""
    taps = None  # module 1 reads the base's last hidden states (verify.Drafter)

    def __init__(self, base, depth: int = 1):
        super().__init__()
        if depth < 1:
            raise ValueError(f"MTP needs at least one module, got depth {depth}")
        self.base = base
        self.mtp = nn.ModuleList([MTPModule(base, k) for k in range(1, depth + 1)])
        self.draft_dtype = None  # cheaper drafting (verify.Drafter): another dtype, a subset of the vocabulary
        self.draft_vocab = None

    @property
    def layers(self):
        """The draft layers, in the order depths use them (feature_drafter.FeatureDrafter): module k drafts depth k."""
        return list(self.mtp)

    def token_head(self, vocab=None):
        """The shared output head: the base's lm_head (over `vocab` only, if given)."""
        return lm_head_rows(self.base, vocab)


def mtp_losses(model: MTPModel, h, x):
    """The modules' cross-entropies on one batch: (D,).

    h (B, T, C): the main model's final hidden states on x[:, :T]; x (B, T + 1): the tokens, so that
    the main loss is on x[:, 1:]. Module k at position i reads h^{k-1}_i and t_{i+k} and is scored on
    t_{i+k+1}: positions 0 .. T-1-k, causal; its hidden states feed module k + 1."""
    base, T = model.base, h.size(1)
    positions = torch.arange(T, device=h.device)
    losses = []
    for k, module in enumerate(model.mtp, start=1):
        n = T - k                                                       # positions with a token k + 1 ahead
        h = module(base, h[:, :n], x[:, k:k + n], positions[:n])        # (B, n, C)
        logits = base.lm_head(module.norm_out(h))                       # (B, n, V): the shared output head
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), x[:, k + 1:k + 1 + n].flatten()))
    return torch.stack(losses)


def mtp_weight(step: int, steps: int, weight: float | None = None) -> float:
    """lambda: DeepSeek-V3's schedule, 0.3 for its first 10T of 14.8T tokens, then 0.1, scaled to a run of
    `steps`: 0.3 for the first two thirds, then 0.1. A weight given is used throughout."""
    if weight is not None:
        return weight
    return 0.3 if step < 2 * steps / 3 else 0.1
