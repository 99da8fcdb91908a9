"""Trained test models, kept per version of the code that trains them.

A module of its own, imported the plain way: pytest imports conftest.py and the test files afresh in
every session, and `grade.py --mutants` runs many sessions in one process."""
import copy
import functools

import medusa_mini

_MODELS = {}
# What training runs through; a fault planted in any of it means training again.
_TRAINING = (medusa_mini.GPT, medusa_mini.Block, medusa_mini.CausalSelfAttention, medusa_mini.MedusaHead,
             medusa_mini.MedusaModel)


def trained_once(build):
    """Memoise a function that trains a model: trained once per process, and again only after
    a fault is planted in the code that trains it. Each call returns its own copy, so a test that
    moves its model to a device (nn.Module.to works in place) leaves the next test's on the CPU."""
    @functools.wraps(build)
    def cached(*args):
        key = (build.__module__, build.__qualname__, args, medusa_mini.medusa_loss.__code__,
               *(f.__code__ for c in _TRAINING for f in vars(c).values() if hasattr(f, "__code__")))
        if key not in _MODELS:
            _MODELS[key] = build(*args)
        return copy.deepcopy(_MODELS[key])
    return cached
