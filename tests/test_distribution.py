"""Exact sampling draws from the model's own distribution: the chi-square family (lab/distribution.py) on the
first three tokens, against the joint computed from the model's logits, with the power it claims.

Each test draws 8,000 times (seconds, not milliseconds), so they live in a file of their own; the same-seed
tests of tests/test_decoding.py check exact sampling more strictly, and in milliseconds (the same text as plain
sampling, token for token). The same family runs in bfloat16 (tests/test_precision.py) and with EAGLE-3's layer
(tests/test_eagle3.py).
"""
import torch

from lab.distribution import chi_square_family, draws_from, shifted_marginal, true_joint
from medusa_mini import generate, medusa_generate
from test_decoding import TREE_2, V_SMALL, skewed_model


N_DRAWS = 8000  # enough to reject a sampler whose x1 is off by 0.03, at the family's false-alarm rate 1e-3


def assert_follows(counts, joint, what):
    """chi_square_family at 1e-3 passes, saying which test failed and its p-value if it does not."""
    family = chi_square_family(counts, joint, 1e-3)
    assert family["passed"], (f"{what}: the {family['worst']} test gives p = {family['p'][family['worst']]:.1e} < "
                              f"{family['level']:.1e} (Bonferroni over {len(family['p'])} tests): "
                              f"{ {k: f'{v:.2g}' for k, v in family['p'].items()} }")


def test_the_distribution_test_has_the_power_it_claims():
    """Against the skewed model's own joint, N_DRAWS draws from a sampler whose x1 is off by 0.03 (moved
    between its two likeliest values, where it is hardest to see) fail chi_square_family in at least 97
    of 100 runs, and draws from the joint itself fail it in at most 2."""
    model = skewed_model()
    joint = true_joint(model, torch.tensor([[1, 2]]), 0.7, 3, V_SMALL)                # (V, V, V)
    g = torch.Generator().manual_seed(0)
    wrong = shifted_marginal(joint, 0.03)
    caught = sum(not chi_square_family(draws_from(wrong, N_DRAWS, g), joint)["passed"] for _ in range(100))
    alarms = sum(not chi_square_family(draws_from(joint, N_DRAWS, g), joint)["passed"] for _ in range(100))
    assert caught >= 97 and alarms <= 2, f"power {caught}/100, false alarms {alarms}/100 at {N_DRAWS} draws"


def test_plain_sampling_follows_the_models_joint_distribution(device):
    """generate at T = 0.7, N_DRAWS rows at once: the first three tokens follow the model's own
    p(x1) p(x2 | x1) p(x3 | x1, x2), in the joint and in every marginal and conditional."""
    model = skewed_model().to(device)
    prompt = torch.tensor([[1, 2]], device=device)
    joint = true_joint(model, prompt, 0.7, 3, V_SMALL)
    torch.manual_seed(3)
    out = generate(model.base, prompt.expand(N_DRAWS, -1), 3, temperature=0.7)[:, 2:].cpu()   # (N, 3)
    counts = (out[:, 0] * V_SMALL**2 + out[:, 1] * V_SMALL + out[:, 2]).bincount(minlength=V_SMALL**3)
    assert_follows(counts.view(V_SMALL, V_SMALL, V_SMALL), joint, "plain sampling")


def test_exact_sampling_matches_the_models_joint_distribution(device):
    """The first three tokens of exact tree sampling at T = 0.7 with Medusa's heads follow the model's own
    p(x1) p(x2 | x1) p(x3 | x1, x2): the joint, each marginal and each conditional (chi_square_family,
    whose power test_the_distribution_test_has_the_power_it_claims checks). Three tokens with a depth-2
    tree use everything: nodes past depth 1, and the next root drawn where a walk stops."""
    torch.manual_seed(1)
    model = skewed_model().to(device)
    prompt = torch.tensor([[1, 2]], device=device)
    joint = true_joint(model, prompt, 0.7, 3, V_SMALL)                               # (V, V, V)
    assert 0.5 * (joint - 1 / V_SMALL**3).abs().sum() > 0.2, "the test's model must be far from uniform"
    counts, accepted = torch.zeros(V_SMALL, V_SMALL, V_SMALL), 0
    for _ in range(N_DRAWS):
        out, stats = medusa_generate(model, prompt, 3, TREE_2, temperature=0.7, sampling="exact")
        counts[tuple(out[0, 2:].tolist())] += 1
        accepted += stats.accept_lengths[0]
    assert accepted > N_DRAWS / 10, f"the walk accepted {accepted} drafted tokens in {N_DRAWS} first steps"
    assert_follows(counts, joint, "exact sampling with Medusa's heads")
