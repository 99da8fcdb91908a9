"""The setup every notebook of the course shares, so its first cell is three lines:

    import course                                   # the repository on sys.path, one CPU thread, plot style
    import medusa_mini, tree, verify
    model, enc, ckpt, args, train_ids, val_ids = course.load()

Nothing here is Medusa: the model, the tree and decoding are imported from the repository's files.
"""
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder above notebooks/
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import training  # noqa: E402
from common import pick_device, prepare_data, run_args  # noqa: E402

torch.set_num_threads(1)  # the course runs on small shared machines: one thread is steadier
plt.rcParams.update({"figure.dpi": 100, "font.size": 11})
FAST = training.fast_mode()  # CI=true or MEDUSA_FAST=1: tiny sizes, so every notebook runs in CI
device = pick_device()


def load():
    """(model, tokenizer, checkpoint, run settings, training ids, held-out ids), and a line about each.

    The model is the one `python train_heads.py` wrote to out/medusa.pt; in fast mode, or before that
    run has finished, the tiny preset, trained once (seconds on a CPU) and kept in out/tiny/.
    The held-out ids are the plays train_heads.py evaluated on, read back from its token cache."""
    print(f"python {platform.python_version()}, torch {torch.__version__}, matplotlib {matplotlib.__version__}")
    print(f"device: {device}, {torch.get_num_threads()} CPU thread; fast mode: {FAST}")
    model, enc, ckpt = training.trained_model(device=device)
    cfg = model.base.config
    out = os.path.dirname(ckpt["tokenizer"]["path"])  # the folder the checkpoint came from
    settings = {k: v for k, v in ckpt["settings"].items() if k != "preset"}
    args = run_args(ckpt["settings"]["preset"], out, device, **settings)
    _, _, train_ids, val_ids = prepare_data(args)
    print(f"model: preset {ckpt['settings']['preset']!r} from {os.path.relpath(out, ROOT)}/: {cfg.n_layer} layers, "
          f"width {cfg.n_embd}, vocabulary {cfg.vocab_size}, context {cfg.block_size}, {len(model.heads)} Medusa heads")
    return model, enc, ckpt, args, train_ids, val_ids


def token_printer(enc):
    """tok(t): one token as readable text, a newline shown as ⏎ and a space as ·."""
    def tok(t):
        return enc.decode([int(t)]).replace("\n", "⏎").replace(" ", "·")
    return tok


def frequency_baseline(train_ids, targets, k=1):
    """Top-k accuracy of always guessing the k most frequent training tokens: the bar every head
    accuracy should be read against. targets: a tensor of token ids."""
    common = torch.from_numpy(np.bincount(train_ids).argsort()[::-1][:k].copy()).to(targets.device)  # (k,)
    return float((targets[..., None] == common).any(-1).float().mean())
