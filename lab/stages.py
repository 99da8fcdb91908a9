"""Training a drafter on a frozen base: the stages both pipelines share (the tiny GPT's, SmolLM2's).

Both feed a stage the same thing, batch by batch: batches(step) -> (h, y), the frozen base's last
hidden states h (B, T, C) on a text and its next tokens y (B, T) (y[:, t] is the token after position
t; -100 where there is none: after an answer's end, in padding). The tiny GPT computes h batch by
batch from its self-distilled text; SmolLM2 stores the h its own decoding computed. vocab (V',): the
token ids the softmax runs over (a sampled softmax: SmolLM2's texts use a few thousand of its 49152
tokens, and a drafter trained so drafts over them alone, model.draft_vocab); None: all of them.
"""
import torch
import torch.nn.functional as F

from eagle import LOSSES, eagle_loss
from lab.train import autocast, step_generator, train_loop
from medusa_mini import medusa_loss


def vocab_targets(y, vocab, vocab_size):
    """y's token ids as indices into vocab (-100 stays -100): the targets of a softmax over vocab only."""
    if vocab is None:
        return y
    index = torch.full((vocab_size,), -100, dtype=torch.long, device=y.device)
    index[vocab] = torch.arange(len(vocab), device=y.device)
    return torch.where(y >= 0, index[y.clamp(min=0)], -100)


def head_logits(model, h, vocab=None):
    """The Medusa heads' logits (K, B, T, V), or over the token ids `vocab` only (K, B, T, V'), for heads
    that project through the shared lm_head (its rows for vocab)."""
    if vocab is None:
        return model.head_logits(h)
    if not model.share_lm_head:
        raise ValueError("a softmax over part of the vocabulary needs heads that share the base's lm_head")
    rows = model.base.lm_head.weight[vocab]                                   # (V', C)
    return torch.stack([head(h, lambda r: F.linear(r, rows)) for head in model.heads])


def train_heads(model, batches, steps, lr, save, resume_from=None, vocab=None):
    """Medusa-1: the heads alone, base and lm_head frozen; loss sum_k 0.8^k CE(head k at t, token t+k+1)
    (medusa_loss). Returns train_loop's history."""
    model.base.requires_grad_(False)
    V = model.base.config.vocab_size
    device = model.base.lm_head.weight.device

    def loss_fn(step):
        h, y = batches(step)
        with autocast(device):
            logits = head_logits(model, h, vocab).float()                    # (K, B, T, V')
        loss, per_head = medusa_loss(logits, vocab_targets(y, vocab, V))
        return loss, {"head1": per_head[0]}  # tensors: train_loop reads them only when it logs

    params = [p for head in model.heads for p in head.parameters()]
    history, _ = train_loop("heads", [(params, 1.0)], loss_fn, steps, lr, save, resume_from)
    return history


def train_eagle(model, batches, steps, lr, save, seed, resume_from=None, vocab=None, loss="eagle1"):
    """EAGLE's layer on the frozen base (eagle.eagle_loss): entry t is fed the feature at t (with EAGLE-1's
    noise, drawn from the step's generator) and the token after it, and predicts the feature at t + 1;
    entries count where the feature at t + 1 exists. loss: a key of eagle.LOSSES. Returns the history."""
    model.base.requires_grad_(False)
    device = model.base.lm_head.weight.device

    def loss_fn(step):
        h, y = batches(step)
        counts = (y[:, :-1] >= 0) & (y[:, 1:] >= 0)                           # (B, T-1): f_{t+1} exists
        positions = torch.arange(h.size(1), device=device)
        with autocast(device):
            total, feature, token, agree = eagle_loss(model.eagle, model.base, h.float(), y.clamp(min=0), positions,
                                                      counts, vocab, weights=LOSSES[loss],
                                                      generator=step_generator(seed + 1, step, device))
        return total, {"feature": feature, "token": token, "top1": agree}

    history, _ = train_loop("eagle", [(list(model.eagle.parameters()), 1.0)], loss_fn, steps, lr, save, resume_from)
    return history


@torch.no_grad()
def head_metrics(model, x, y, device):
    """Per-head loss, top-1 and top-5 accuracy of Medusa heads on one batch of text (head k at t against
    token t+k+1): x (B, T) tokens, y (B, T) the next ones."""
    with autocast(device):
        logits = model.head_logits(model.base.hidden(x)).float()             # (K, B, T, V)
    _, losses = medusa_loss(logits, y)
    top1, top5 = [], []
    for k in range(1, logits.size(0) + 1):
        target = y[:, k:]                                                    # (B, T-k)
        guesses = logits[k - 1, :, :y.size(1) - k].topk(5, -1).indices       # (B, T-k, 5)
        top1.append(float((guesses[..., 0] == target).float().mean()))
        top5.append(float((guesses == target[..., None]).any(-1).float().mean()))
    return {"loss": losses.tolist(), "top1": top1, "top5": top5}
