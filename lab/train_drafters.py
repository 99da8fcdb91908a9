"""Training the drafters on a frozen base: what each drafter's registry entry (lab/drafters.py) runs, on the
same data for both bases.

A training function takes (model, data, run, save, resume_from): `data` is a TrainingData, which gives
batches(seed)(step) -> (h, y): the frozen base's last hidden states h (B, T, C) on its self-distilled text
and the next tokens y (B, T) (y[:, t] is the token after position t; -100 where there is none: after an
answer's end, in padding). The tiny GPT computes h batch by batch; SmolLM2 stores the h its own decoding
computed. data.vocab (V',): the token ids the softmax runs over (a sampled softmax: SmolLM2's texts use a
few thousand of its 49152 tokens, and a drafter trained so drafts over them alone, model.draft_vocab);
None: all of them. Each returns lab/train.train_loop's history.
"""
import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from eagle import LOSSES, eagle_loss
from eagle3 import ttt_loss
from lab.train import autocast, rows_batch, step_generator, stream_seed, train_loop
from medusa_mini import medusa_loss


@dataclass
class TrainingData:
    """What the drafters of a run train on, as the base's stages leave it."""
    batches: Callable                   # batches(seed, taps=None) -> (step -> (h, y), or (h, y, features at taps))
    vocab: torch.Tensor | None = None   # (V',) on the device, or None: the whole vocabulary
    text: torch.Tensor | None = None    # the self-distilled rows (rows, T + 1), for a stage that runs the base
    base_loss: float | None = None      # the base's held-out loss, before a stage that trains it


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


def train_heads(model, data, run, save, resume_from=None):
    """Medusa-1: the heads alone, base and lm_head frozen; loss sum_k 0.8^k CE(head k at t, token t+k+1)
    (medusa_loss), run.head_steps steps at run.head_lr."""
    model.base.requires_grad_(False)
    V = model.base.config.vocab_size
    device = model.base.lm_head.weight.device
    batches = data.batches(stream_seed(run.seed, "medusa"))

    def loss_fn(step):
        h, y = batches(step)
        with autocast(device):
            logits = head_logits(model, h, data.vocab).float()              # (K, B, T, V')
        loss, per_head = medusa_loss(logits, vocab_targets(y, data.vocab, V))
        return loss, {"head1": per_head[0]}  # tensors: train_loop reads them only when it logs

    params = [p for head in model.heads for p in head.parameters()]
    history, _ = train_loop("heads", [(params, 1.0)], loss_fn, run.head_steps, run.head_lr, save, resume_from)
    return history


JOINT_HEADS_WEIGHT = 0.2    # lambda_0, as in the Medusa authors' stage-2 config (axolotl
#                             examples/medusa/vicuna_7b_qlora_stage2.yml: medusa_heads_coefficient 0.2)
JOINT_HEADS_LR_MULT = 300.0  # heads' lr over the backbone's. The authors use 4 on a 7B model; this small
#                             backbone is kept nearly still (docs/results.md has the Medusa-2 run)


def train_joint(model, data, run, save, resume_from=None):
    """Medusa-2, self-distilled: backbone and heads together on the model's own text, after the heads-only
    stage (Medusa-1, the warm-up, kept in its own checkpoint). The base loss is KL(original || model) to
    a frozen copy of the original base, so the model keeps its distribution; plus 0.2 x the Medusa-1
    loss, heads at half the Medusa-1 lr, the backbone at 1/300 of that, run.joint_steps steps."""
    device = model.base.lm_head.weight.device
    original = copy.deepcopy(model.base).eval().requires_grad_(False)
    model.base.requires_grad_(True)
    model.train()
    seed = stream_seed(run.seed, "joint")

    def loss_fn(step):
        x, y = rows_batch(data.text, run.batch_size, step_generator(seed, step), device)
        with torch.no_grad(), autocast(device):
            target = F.log_softmax(original(x).float(), -1)                             # (B, T, V)
        with autocast(device):
            base_logits, head_logits = model(x)
            kl = F.kl_div(F.log_softmax(base_logits.float(), -1), target, log_target=True,
                          reduction="none").sum(-1).mean()                               # KL(original || model)
            medusa, _ = medusa_loss(head_logits.float(), y)
        return kl + JOINT_HEADS_WEIGHT * medusa, {"kl": kl}

    head_params = [p for head in model.heads for p in head.parameters()]
    history, _ = train_loop("joint", [(list(model.base.parameters()), 1.0), (head_params, JOINT_HEADS_LR_MULT)],
                            loss_fn, run.joint_steps, run.head_lr / 2 / JOINT_HEADS_LR_MULT, save, resume_from)
    model.eval().base.requires_grad_(False)
    return history


def train_eagle(model, data, run, save, resume_from=None):
    """EAGLE's layer on the frozen base (eagle.eagle_loss, run.eagle_loss: a key of eagle.LOSSES): entry t is
    fed the feature at t (with EAGLE-1's noise, drawn from the step's generator) and the token after it, and
    predicts the feature at t + 1; entries count where the feature at t + 1 exists."""
    model.base.requires_grad_(False)
    device = model.base.lm_head.weight.device
    batches = data.batches(stream_seed(run.seed, "eagle"))

    def loss_fn(step):
        h, y = batches(step)
        counts = (y[:, :-1] >= 0) & (y[:, 1:] >= 0)                           # (B, T-1): f_{t+1} exists
        positions = torch.arange(h.size(1), device=device)
        with autocast(device):
            total, feature, token, agree = eagle_loss(model.eagle, model.base, h.float(), y.clamp(min=0), positions,
                                                      counts, data.vocab, weights=LOSSES[run.eagle_loss],
                                                      generator=step_generator(run.seed + 1, step, device))
        return total, {"feature": feature, "token": token, "top1": agree}

    history, _ = train_loop("eagle", [(list(model.eagle.parameters()), 1.0)], loss_fn, run.eagle_steps, run.eagle_lr,
                            save, resume_from)
    return history


def train_eagle3(model, data, run, save, resume_from=None):
    """EAGLE-3's layer on the frozen base (eagle3.ttt_loss): the base's fused features at its layers model.taps
    and its next-token distributions, the layer unrolled run.eagle3_ttt steps on its own predictions (the
    training-time test), step j weighing run.eagle3_decay ** j. Its vocabulary is the training text's (data.vocab;
    all tokens where there is none), set before the first step."""
    model.base.requires_grad_(False)
    device = model.base.lm_head.weight.device
    if resume_from is None:
        model.set_vocab(data.vocab if data.vocab is not None else torch.arange(model.base.config.vocab_size))
    batches = data.batches(stream_seed(run.seed, "eagle3"), taps=model.taps)

    def loss_fn(step):
        h, y, features = batches(step)
        with autocast(device):
            loss, agree = ttt_loss(model, features, y, h, run.eagle3_ttt, run.eagle3_decay)
        return loss, {"top1": agree[0], f"top1 step {len(agree)}": agree[-1]}

    history, _ = train_loop("eagle3", [(list(model.eagle3.parameters()), 1.0)], loss_fn, run.eagle3_steps,
                            run.eagle3_lr, save, resume_from)
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
