"""The setup every notebook of the course shares, so its first cell is three lines:

    import course                                   # the repository on sys.path, one CPU thread, plot style
    import medusa_mini, tree, verify
    model, enc, ckpt, args, train_ids, val_ids = course.load()

and the few things the notebooks do alike: the chosen tree printed in one format (chosen_tree), cells
that wait for an assignment in a student copy (needs), and the exercises' check (predicted).
Nothing here is Medusa: the model, the tree and decoding are imported from the repository's files.
"""
import os
import platform
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder above notebooks/
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from lab import checkpoints, gpt_pipeline, stubs  # noqa: E402
from lab.devices import pick_device  # noqa: E402
from lab.trees import trees_of  # noqa: E402

torch.set_num_threads(1)  # the course runs on small shared machines: one thread is steadier
plt.rcParams.update({"figure.dpi": 100, "font.size": 11})
FAST = gpt_pipeline.fast_mode()  # CI=true or MEDUSA_FAST=1: tiny sizes, so every notebook runs in CI
device = pick_device()


def load():
    """(model, tokenizer, checkpoint, run settings, training ids, held-out ids), and a line about each.

    The model is the one `python train_heads.py` wrote to out/medusa.pt; in fast mode, or before that
    run has finished, the tiny preset, trained once (a minute or two on a CPU) and kept in out/tiny/.
    The held-out ids are the plays train_heads.py evaluated on, read back from its token cache.
    In a student copy, see _trained."""
    print(f"python {platform.python_version()}, torch {torch.__version__}, matplotlib {matplotlib.__version__}")
    print(f"device: {device}, {torch.get_num_threads()} CPU thread; fast mode: {FAST}")
    model, enc, path, ckpt = _trained("medusa")
    cfg = model.base.config
    _, run = gpt_pipeline.reopen(path, device)
    _, _, _, train_ids, val_ids = gpt_pipeline.prepare_data(run)
    print(f"model: preset {run.preset!r} from {os.path.relpath(run.out, ROOT)}/: {cfg.n_layer} layers, "
          f"width {cfg.n_embd}, vocabulary {cfg.vocab_size}, context {cfg.block_size}, {len(model.heads)} Medusa heads")
    return model, enc, ckpt, run, train_ids, val_ids


def load_drafter(name):
    """(model, checkpoint) of another drafter of the same run as load()'s model: "eagle" (its base is a copy of
    the same trained base)."""
    model, _, _, ckpt = _trained(name)
    return model, ckpt


def _trained(drafter):
    """gpt_pipeline.trained_model's (model, tokenizer, checkpoint path, checkpoint). In a student copy
    (kit/make_assignment.py), where some assignments are still stubs, training would run them: the run
    must be there already, and while a drafter's own model is a stub (Medusa's heads before assignment 1)
    its model is the base alone (model.heads is empty)."""
    waiting = sorted({n for n, _, _ in stubs.stubs_in(_modules())})
    if not waiting:
        return gpt_pipeline.trained_model(device=device, drafter=drafter)
    path = os.path.join(ROOT, "out", f"{drafter}.pt")
    if FAST or not gpt_pipeline.run_finished(path):
        path = os.path.join(ROOT, "out", "tiny", f"{drafter}.pt")
    if not gpt_pipeline.run_finished(path):
        raise RuntimeError(f"this copy cannot train the course's model: training runs the code of assignments "
                           f"{', '.join(map(str, waiting))}, still to write here. kit/make_assignment.py copies "
                           f"out/tiny/ in; or copy it from a full checkout where `python train_heads.py --preset tiny "
                           f"--out out/tiny --drafters medusa,eagle` has run")
    try:
        return gpt_pipeline.trained_model(device=device, drafter=drafter)
    except NotImplementedError:  # the drafter's own model is still to write here: the base alone
        ckpt = checkpoints.load(path, device)
    base = checkpoints.build_base(ckpt["base"], device)
    base.load_state_dict({k.removeprefix("base."): v for k, v in ckpt["model"].items() if k.startswith("base.")})
    print(f"the {drafter} drafter's code is not written in this copy: the model is the base alone, without it")
    return (types.SimpleNamespace(base=base.eval(), heads=[]), checkpoints.load_tokenizer(path, ckpt), path, ckpt)


def _modules():
    """The project's root modules (the core and the commands), where a student copy's stubs are."""
    return [name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")]


def needs(*numbers):
    """Whether assignments `numbers` are written in this copy of the project (none of their functions is a
    stub); for each that is not, one line saying so. A notebook guards the cells that run an assignment's
    code with it, so that a student copy runs top to bottom. The stubs carry their assignment's number
    (lab/stubs.py), so this reads the source, not the course kit."""
    found = stubs.stubs_in(_modules())
    missing = [n for n in numbers if any(m == n for m, _, _ in found)]
    for n in missing:
        names = ", ".join(key.partition(":")[2] for m, key, _ in found if m == n)
        print(f"this cell needs assignment {n} ({names}), not done in this copy")
    return not missing


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
