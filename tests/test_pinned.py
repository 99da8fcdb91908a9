"""Decoding outputs pinned before the drafter seam: the verifier moved out of medusa_mini.py and
Medusa became one drafter among several, and none of it may change a token.

The sequences and accept lengths below were produced by commit 9609dfc (the last commit before the
seam) with this exact model, prompt, tree and seed, on the CPU in fp32. Greedy, typical (sampled
root), typical-fast (argmax root) and exact sampling each consume the random generator in the same
order as then, so a change in which draws happen, or in which path a step accepts, shows here."""
import pytest
import torch

from medusa_mini import GPT, GPTConfig, MedusaModel, medusa_generate

PINNED = {  # sampling mode: (40 new tokens, accept length of every step)
    "greedy": ([8, 22, 8, 18, 37, 22, 8, 8, 8, 31, 31, 3, 33, 26, 8, 26, 26, 8, 9, 9, 13, 8, 22, 8, 36, 31, 6, 8, 9,
                9, 3, 22, 36, 30, 30, 31, 31, 22, 31, 9],
               [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0,
                0]),
    "typical": ([13, 31, 4, 22, 36, 38, 3, 0, 8, 31, 13, 13, 13, 9, 37, 9, 3, 8, 13, 13, 8, 36, 3, 3, 3, 38, 5, 13,
                 11, 31, 6, 37, 15, 15, 13, 22, 36, 38, 13, 22],
                [0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 2, 0, 2, 1, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
    "typical-fast": ([8, 22, 8, 22, 22, 8, 27, 8, 13, 31, 33, 22, 38, 38, 22, 22, 38, 33, 26, 22, 8, 22, 22, 8, 31,
                      38, 22, 8, 3, 8, 36, 22, 22, 22, 22, 22, 31, 38, 38, 27],
                     [0, 0, 1, 0, 1, 1, 2, 2, 0, 2, 0, 0, 1, 0, 2, 0, 0, 0, 0, 0, 2, 0, 1, 1]),
    "exact": ([13, 31, 4, 3, 13, 0, 3, 8, 16, 4, 27, 1, 26, 6, 13, 22, 8, 11, 8, 8, 8, 15, 11, 13, 31, 25, 22, 31, 22,
               13, 18, 8, 22, 9, 2, 22, 36, 38, 39, 7],
              [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0,
               0]),
}
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
PROMPT = [5, 17, 3, 22, 9]


def pinned_model():
    """A 2-layer GPT with weights scaled up (peaked, varied logits) and heads perturbed off zero-init,
    so that some steps accept drafts and most do not."""
    torch.manual_seed(2024)
    model = MedusaModel(GPT(GPTConfig(vocab_size=40, block_size=96, n_layer=2, n_head=2, n_embd=32)), num_heads=3)
    with torch.no_grad():
        for p in model.base.parameters():
            p.mul_(4.0)
        for head in model.heads:
            head.residual.weight.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("mode", list(PINNED))
def test_outputs_are_token_for_token_those_of_the_commit_before_the_seam(mode):
    kwargs = {} if mode == "greedy" else dict(temperature=0.8, sampling=mode)
    model = pinned_model()
    torch.manual_seed(7)
    out, stats = medusa_generate(model, torch.tensor([PROMPT]), 40, TREE, **kwargs)
    tokens, accepts = PINNED[mode]
    assert out[0, len(PROMPT):].tolist() == tokens, f"{mode}: the tokens changed"
    assert stats.accept_lengths == accepts, f"{mode}: the steps accepted other paths"
