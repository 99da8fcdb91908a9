"""EAGLE: a draft layer that predicts the base model's next feature from its own features and the
tokens drafted so far (Li, Wei, Zhang, Zhang: EAGLE, arXiv 2401.15077; EAGLE-2, arXiv 2406.16858).

Medusa's heads all guess from the same hidden state h_t, each token independently of the ones
before it, so every branch at depth k gets the same guesses. EAGLE drafts autoregressively at the
feature level: from the feature f_i (the base's last hidden state, what lm_head reads) and the
embedding of the token after it, one block of the base's own kind predicts f_{i+1}; the base's
frozen lm_head turns it into a distribution over the next token; the predicted feature and a drafted
token are fed back for the next. So each subtree is drafted for its own parent.

This file is the layer and its loss. Drafting a tree with it, depth by depth on the layer's own KV
cache, is feature_drafter.FeatureDrafter (the layer is used at every depth), with a fixed tree or
EAGLE-2's dynamic one, and feature_drafter.feature_generate decodes with it; verification is the shared
verifier's (verify.py). docs/medusa.md, section 7.

Shapes: B batch, T positions, C width, V vocabulary.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from feature_drafter import lm_head_rows
from kv_cache import KVCache


# ----------------------------------------------------------------------------------------------
# The draft layer (EAGLE-1, section 4.2)

class EagleLayer(nn.Module):
    """f^_{i+1} = block(fc([embed(t_{i+1}); f_i])): one block of the base's own kind, its first norm left
    out (the fused input needs none), and no final norm: lm_head reads f^ as it reads the base's f.

    Positions: the block sits at the feature's position i (a Llama block rotates it, RoPE); the token's
    embedding is the base's own at the token's position i + 1 (a GPT adds its learned position
    embedding there, as it does for its own input), so the GPT's draft layer knows positions the way
    the GPT does, from its input."""
    ahead = 1  # the token fed with feature f_i sits this many positions after it

    def __init__(self, base):
        super().__init__()
        C, w = base.config.n_embd, base.lm_head.weight
        self.fc = nn.Linear(2 * C, C, device=w.device, dtype=w.dtype)   # [embedding; feature] -> C, as EAGLE's fc
        self.block = base.new_block(input_norm=False)

    def forward(self, base, f, tokens, positions, attn_mask=None, cache: KVCache | None = None):
        """f (B, T, C) features at `positions` (T,), tokens (B, T) one position after each -> f^ (B, T, C),
        the predicted features one position after each. attn_mask and cache as in base.run_blocks."""
        e = base.embed(tokens, positions + self.ahead).to(f.dtype)                  # (B, T, C), in the drafting dtype
        x = self.fc(torch.cat([e, f], dim=-1))                                      # (B, T, 2C) -> (B, T, C)
        return base.run_blocks([self.block], x, positions, attn_mask, cache)

    def norm_out(self, out):
        """What lm_head reads of the layer's output: EAGLE's predicted feature as it is, no norm."""
        return out


class EagleModel(nn.Module):
    """A base model (`base`, frozen) and its EAGLE draft layer (`eagle`)."""
    taps = None  # it reads the base's last hidden states (verify.Drafter)

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.eagle = EagleLayer(base)
        self.draft_dtype = None  # cheaper drafting (verify.Drafter): another dtype, a subset of the vocabulary
        self.draft_vocab = None

    @property
    def layers(self):
        """The draft layers, in the order depths use them: EAGLE has one, used at every depth."""
        return [self.eagle]

    def token_head(self, vocab=None):
        """The head its features are read through: the base's frozen lm_head (over `vocab` only, if given)."""
        return lm_head_rows(self.base, vocab)


NOISE = 0.2             # EAGLE-1: uniform noise U(-0.1, 0.1) on the input features, for robustness to its own errors
TOKEN_LOSS_WEIGHT = 0.1  # EAGLE-1: loss = SmoothL1(feature) + 0.1 x cross-entropy(token distribution)
LOSSES = {"eagle1": (1.0, TOKEN_LOSS_WEIGHT),  # (feature weight, token weight): EAGLE-1's loss
          "tokens": (0.0, 1.0)}                # the token loss alone, as EAGLE-3 trains (without its training-time test)


def eagle_loss(layer, base, f, tokens, positions, mask=None, vocab=None, noise=NOISE, weights=LOSSES["eagle1"],
               generator=None):
    """EAGLE-1's training loss on one batch of a frozen base's features.

    f (B, T, C): the base's last hidden states at positions (T,); tokens (B, T): the token after each
    (tokens[:, i] = t_{i+1}). Entry i, fed f_i + noise and t_{i+1}, predicts f_{i+1}: SmoothL1 against
    the true f_{i+1}, plus the cross-entropy from the base's next-token distribution there (softmax of
    lm_head(f_{i+1}), soft targets) to the draft's, weighted by `weights` (feature, token). Causal over the T - 1 entries.
    mask (B, T - 1): the entries that count (rows of different lengths; default all). vocab (V',):
    both distributions over those token ids only (SmolLM2: the tokens its texts use). generator: where
    the noise comes from (a torch.Generator on f's device; default torch's own). Returns (loss,
    feature loss, token loss, top-1 agreement with the base), 0-d tensors."""
    u = torch.rand(f[:, :-1].shape, generator=generator, device=f.device, dtype=f.dtype)  # (B, T-1, C) in [0, 1)
    inputs = f[:, :-1] + (u - 0.5) * noise                                             # (B, T-1, C)
    out = layer(base, inputs, tokens[:, :-1], positions[:-1])                          # (B, T-1, C)
    target = f[:, 1:]                                                                  # (B, T-1, C)
    mask = torch.ones(out.shape[:2], dtype=torch.bool, device=f.device) if mask is None else mask
    w = base.lm_head.weight if vocab is None else base.lm_head.weight[vocab]          # (V', C)
    feature_loss = F.smooth_l1_loss(out[mask].float(), target[mask].float())          # over (M, C)
    logp = F.log_softmax(F.linear(out[mask], w).float(), -1)                          # (M, V')
    with torch.no_grad():
        p_base = F.softmax(F.linear(target[mask], w).float(), -1)                     # (M, V')
    token_loss = -(p_base * logp).sum(-1).mean()
    agree = (logp.argmax(-1) == p_base.argmax(-1)).float().mean()
    return weights[0] * feature_loss + weights[1] * token_loss, feature_loss, token_loss, agree
