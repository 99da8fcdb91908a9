"""The setup every notebook of the course shares, so its first cell is three lines:

    import course                                   # the repository on sys.path, one CPU thread, plot style
    import medusa_mini, tree, verify
    model, enc, ckpt, args, train_ids, val_ids = course.load()

and the few things the notebooks do alike: the chosen tree printed in one format (chosen_tree) and the
exercises' check (predicted).
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

from lab import gpt_stages, runs  # noqa: E402
from lab.devices import pick_device  # noqa: E402
from lab.tree_choice import trees_of  # noqa: E402

torch.set_num_threads(1)  # the course runs on small shared machines: one thread is steadier
plt.rcParams.update({"figure.dpi": 100, "font.size": 11})
FAST = runs.fast_mode()  # CI=true or MEDUSA_FAST=1: tiny sizes, so every notebook runs in CI
device = pick_device()


def load():
    """(model, tokenizer, checkpoint, run settings, training ids, held-out ids), and a line about each.

    The model is the one `python train_heads.py` wrote to out/medusa.pt; in fast mode, or before that
    run has finished, the tiny preset, trained once (a minute or two on a CPU) and kept in out/tiny/.
    The held-out ids are the plays train_heads.py evaluated on, read back from its token cache."""
    print(f"python {platform.python_version()}, torch {torch.__version__}, matplotlib {matplotlib.__version__}")
    print(f"device: {device}, {torch.get_num_threads()} CPU thread; fast mode: {FAST}")
    model, enc, path, ckpt = _trained("medusa")
    cfg = model.base.config
    _, run = runs.reopen(path, device)
    _, _, _, train_ids, val_ids = gpt_stages.prepare_data(run)
    print(f"model: preset {run.preset!r} from {os.path.relpath(run.out, ROOT)}/: {cfg.n_layer} layers, "
          f"width {cfg.n_embd}, vocabulary {cfg.vocab_size}, context {cfg.block_size}, {len(model.heads)} Medusa heads")
    return model, enc, ckpt, run, train_ids, val_ids


def load_drafter(name):
    """(model, checkpoint) of another drafter of the same run as load()'s model: "eagle" (its base is a copy of
    the same trained base)."""
    model, _, _, ckpt = _trained(name)
    return model, ckpt


def _trained(drafter):
    """lab.runs.trained_model's (model, tokenizer, checkpoint path, checkpoint)."""
    return runs.trained_model(device=device, drafter=drafter)


def chosen_tree(ckpt):
    """The tree the run chose for this device, as rank paths, printed in the one format every notebook
    uses (tests/test_notebooks.py checks that all notebooks print the same one: the same run)."""
    paths = [tuple(p) for p in trees_of(ckpt).tree]
    print(f"chosen tree: {len(paths)} nodes {[list(p) for p in paths]}")
    return paths


def predicted(*predictions):
    """An exercise's check runs once its prediction is filled in: False, with one line, while any
    prediction is still None (the answer is never printed: the check asserts against it)."""
    if any(p is None for p in predictions):
        print("make a prediction first: set the variable in the cell above, then run this cell again")
        return False
    return True


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
