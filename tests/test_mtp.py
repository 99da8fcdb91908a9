"""Multi-token prediction (mtp.py): module k is trained on the token k + 1 ahead, sequentially, with
the base; as a drafter (through feature_drafter.FeatureDrafter) its output is plain greedy decoding's."""
import pytest
import torch
import torch.nn.functional as F

from conftest import trained_once, assert_same_tokens, periodic_batch, tiny_config
from feature_drafter import DynamicTree
from medusa_mini import GPT, generate
from feature_drafter import feature_generate
from mtp import MTPModel, mtp_losses, mtp_weight


@trained_once
def periodic_mtp():
    """A base and 2 MTP modules trained together on tests/conftest.py's periodic sequence (a few seconds)."""
    torch.manual_seed(0)
    model = MTPModel(GPT(tiny_config()), depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(120):
        xy = periodic_batch(16, 32, g)                                     # (16, 33)
        h = model.base.hidden(xy[:, :-1])
        loss = F.cross_entropy(model.base.lm_head(h).flatten(0, 1), xy[:, 1:].flatten())
        loss = loss + mtp_weight(step, 120) / 2 * mtp_losses(model, h, xy).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_module_k_predicts_the_token_k_plus_1_ahead():
    """On the periodic sequence, module k's guess at position i is the token at i + k + 1 (and not the one
    at i + k): the sequential chain reads module k-1's state and the token k ahead, as section 2.2 has it."""
    model = periodic_mtp()
    with torch.no_grad():
        xy = periodic_batch(8, 24, torch.Generator().manual_seed(5))       # (8, 25)
        h = model.base.hidden(xy[:, :-1])                                  # (8, 24, C)
        positions = torch.arange(24)
        for k, module in enumerate(model.mtp, start=1):
            n = 24 - k
            h = module(model.base, h[:, :n], xy[:, k:k + n], positions[:n])
            guess = model.base.lm_head(module.norm_out(h)).argmax(-1)      # (8, n)
            right = (guess == xy[:, k + 1:k + 1 + n]).float().mean()
            early = (guess == xy[:, k:k + n]).float().mean()
            assert right > 0.95 and early < 0.2, f"module {k}: token i+{k + 1} {right:.0%}, token i+{k} {early:.0%}"
        assert mtp_losses(model, model.base.hidden(xy[:, :-1]), xy).max() < 0.2


def test_the_loss_weight_follows_deepseek_v3s_schedule():
    """0.3 for the first two thirds of the run (10T of DeepSeek-V3's 14.8T tokens), then 0.1; a weight given stays."""
    assert [mtp_weight(s, 90) for s in (0, 59, 60, 89)] == [0.3, 0.3, 0.1, 0.1]
    assert mtp_weight(80, 90, 0.5) == 0.5


@pytest.mark.parametrize("tree", [[(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], DynamicTree(topk=2, nodes=6, depth=4)],
                         ids=["static", "dynamic"])
def test_mtp_drafts_are_accepted_and_exact(tree, device):
    """The trained modules draft the periodic sequence right, depth 3 and 4 by the last module again
    (vLLM's reuse): well over 2 tokens a step, and the output is plain greedy's."""
    model = periodic_mtp().to(device)
    idx = torch.tensor([[3, 17]], device=device)
    fast, stats = feature_generate(model, idx, 40, tree)
    assert_same_tokens(fast, generate(model.base, idx, 40), model.base, stats, 2)
    assert stats.tokens_per_step > 2.5, stats.accept_lengths


def test_an_untrained_mtp_drafter_is_exact_all_the_same():
    torch.manual_seed(3)
    model = MTPModel(GPT(tiny_config()), depth=2).eval()
    idx = torch.tensor([[1, 2, 3]])
    fast, stats = feature_generate(model, idx, 30, DynamicTree(topk=3, nodes=8, depth=3))
    assert_same_tokens(fast, generate(model.base, idx, 30), model.base, stats, 3)
