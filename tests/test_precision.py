"""The decoding dtype: what --dtype auto picks from the machine's features, and what bfloat16 promises.

In float32, greedy speculation equals plain greedy token for token (tests/test_decoding.py). In bf16 no
engine can promise that: a tree pass and a one-token pass round differently. The promise is that
speculation adds no error beyond what bf16 already makes: a tree's logits equal per-path logits within a
few of bf16's spacings, and greedy speculation follows plain bf16 greedy until a near-tie.
"""
import copy

import pytest
import torch

from conftest import random_medusa
from lab import bases, devices, dtypes, packing
from lab.distribution import true_joint
from medusa_mini import generate, medusa_generate
from test_decoding import SEEDS, TREE_2, V_SMALL, skewed_eagle, skewed_model, skewed_mtp
from test_distribution import N_DRAWS, assert_follows
from test_eagle3 import skewed_eagle3
from tree import build_tree_buffers
from kv_cache import KVCache

BF16 = torch.bfloat16
SPACINGS = 4  # the tolerance, in bf16 spacings at the largest logit (the largest difference over 12 prefixes: 1)


def spacing(x):
    """bf16's spacing at |x|: the gap between x and the next bf16 number."""
    return torch.finfo(BF16).eps * 2.0 ** torch.floor(torch.log2(x.abs().clamp(min=1e-30)))


@pytest.mark.parametrize("flags, base, expected", [
    ({"amx_bf16", "avx512_bf16"}, "smollm2", BF16), ({"avx512_bf16"}, "smollm2", BF16),
    (set(), "smollm2", torch.float32), ({"amx_bf16"}, "gpt", torch.float32), (set(), "gpt", torch.float32)])
def test_auto_picks_from_the_cpus_features(monkeypatch, flags, base, expected):
    """--dtype auto on a CPU: bf16 for SmolLM2 where the CPU has bf16 instructions (AMX or AVX512-BF16),
    float32 without them and for the tiny GPT; the feature probe replaced, the reason names what it found."""
    monkeypatch.setattr(devices, "cpu_flags", lambda: flags)
    dtype, why = dtypes.decoding_dtype("auto", "cpu", bases.get(base))
    assert dtype == expected and why.startswith("auto: ")
    if expected == BF16:
        assert ("AMX" if "amx_bf16" in flags else "AVX512-BF16") in why
    assert dtypes.decoding_dtype("bfloat16", "cpu", bases.get(base)) == (BF16, "--dtype bfloat16")  # asked: no probe


@pytest.mark.parametrize("flags, base, expected", [({"amx_bf16"}, "smollm2", BF16), ({"avx512_bf16"}, "smollm2", BF16),
                                                   (set(), "smollm2", None), ({"amx_bf16"}, "gpt", None)])
def test_drafting_follows_the_decoding_rule(monkeypatch, flags, base, expected):
    """draft_cheaply: a drafter drafts in bf16 on a CPU where --dtype auto would decode its base in bf16 (SmolLM2
    with bf16 instructions), in the model's own dtype elsewhere (the tiny GPT; a CPU without them; a GPU)."""
    monkeypatch.setattr(devices, "cpu_flags", lambda: flags)
    assert dtypes.draft_cheaply(random_medusa(), "cpu", bases.get(base)).draft_dtype == expected
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert dtypes.draft_cheaply(random_medusa(), torch.device("meta"), bases.get(base)).draft_dtype is None


@pytest.mark.parametrize("bf16, expected", [(True, BF16), (False, torch.float32)])
def test_auto_on_a_gpu_stand_in(monkeypatch, bf16, expected):
    """A CUDA stand-in: SmolLM2 decodes in bf16 on bf16 tensor cores, in float32 on a GPU without them (a T4);
    the tiny GPT in float32 either way."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    assert dtypes.decoding_dtype("auto", "cuda", bases.get("smollm2"))[0] == expected
    assert dtypes.decoding_dtype("auto", "cuda", bases.get("gpt"))[0] == torch.float32


def test_a_decoding_copy_leaves_the_trained_model_as_it_is():
    model = random_medusa()
    low = dtypes.decoding_copy(model, BF16)
    assert low.base.lm_head.weight.dtype == BF16 and low.heads[0].residual.weight.dtype == BF16
    assert model.base.lm_head.weight.dtype == torch.float32 and dtypes.decoding_copy(model, torch.float32) is model


@pytest.mark.parametrize("drafter", ["medusa", "eagle", "mtp", "eagle3"])
def test_a_packed_decoding_copy_computes_what_an_unpacked_copy_computes(drafter):
    """decoding_copy packs a bf16 copy's linear layers on a CPU with bf16 instructions (PackedLinear): the
    layout changes, not the arithmetic. The base's logits over a tree (mask, cache) and each drafter's
    greedy text equal those of the same copy left unpacked (measured: equal bit for bit)."""
    from feature_drafter import feature_generate
    trained = {"medusa": skewed_model, "eagle": skewed_eagle, "mtp": skewed_mtp, "eagle3": skewed_eagle3}[drafter]()
    packed, plain = dtypes.decoding_copy(trained, BF16), copy.deepcopy(trained).to(BF16)
    if packing.packs_bf16(packed.base.lm_head.weight):
        assert any(isinstance(m, packing.PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, packing.PackedLinear) for m in plain.modules())
    b = build_tree_buffers([(0,), (1,), (0, 0)], "cpu")

    def tree_logits(base):  # a 4-node tree over 3 cached tokens: (N, V)
        cache = KVCache(base.config, extra=len(b.node_paths), dtype=BF16)
        base(torch.tensor([[1, 2, 3]]), cache=cache)
        return base(torch.tensor([[1, 2, 3, 0]]), b.position_ids + 3, b.attn_mask, cache)[0].float()
    expected = tree_logits(plain.base)
    assert (tree_logits(packed.base) - expected).abs().max() <= spacing(expected.abs().max())
    decode = {"medusa": medusa_generate, "eagle": feature_generate, "mtp": feature_generate, "eagle3": feature_generate}[drafter]
    tree = TREE_2 if drafter == "medusa" else [(0,), (1,), (0, 0)]
    assert torch.equal(decode(packed, torch.tensor([[1, 2]]), 5, tree)[0], decode(plain, torch.tensor([[1, 2]]), 5, tree)[0])


def test_packing_happens_only_where_bf16_is_native(monkeypatch):
    """float32 copies, and bf16 copies on a CPU without bf16 instructions (the feature probe replaced), keep
    nn.Linear; a packed layer cast back to float32 (a drafter drafting in another dtype) computes F.linear, and
    one given a new weight packs that one."""
    model = random_medusa()
    native = devices.cpu_has_native_bf16() and torch.backends.mkldnn.is_available()
    assert dtypes.decoding_copy(model, torch.float32) is model
    monkeypatch.setattr(devices, "cpu_flags", lambda: set())
    assert not any(isinstance(m, packing.PackedLinear) for m in dtypes.decoding_copy(model, BF16).modules())
    if not native:
        pytest.skip("packing needs a CPU with bf16 instructions and a torch built with oneDNN")
    monkeypatch.undo()
    low = dtypes.decoding_copy(model, BF16)
    layer = low.base.lm_head
    assert isinstance(layer, packing.PackedLinear) and layer.weight is low.base.wte.weight  # still tied
    x = torch.randn(3, layer.weight.size(1))
    back = copy.deepcopy(layer).float()
    assert torch.equal(back(x), torch.nn.functional.linear(x, back.weight))
    again = copy.deepcopy(layer)
    again(x.to(BF16))                                            # packed
    again.weight.data = again.weight.data * 2                    # a new weight tensor: packed anew, not stale
    assert torch.equal(again(x.to(BF16)), torch.nn.functional.linear(x.to(BF16), again.weight))


@pytest.mark.parametrize("prefix", [0, 5])
def test_bf16_tree_logits_equal_per_path_logits_within_its_spacing(prefix):
    """In bf16, the logits at every tree node equal a plain causal forward of its own path within SPACINGS
    of bf16's spacing at the largest logit (in float32 they are equal to 1e-5: tests/test_model.py)."""
    torch.manual_seed(prefix)
    model = dtypes.decoding_copy(random_medusa(), BF16).base  # as decoding runs it: packed where bf16 is native
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]
    b = build_tree_buffers(choices, "cpu")
    tokens = torch.randint(0, 32, (len(b.node_paths),))
    committed = torch.randint(0, 32, (1, prefix))
    cache = KVCache(model.config, extra=len(tokens), dtype=BF16)
    if prefix:
        model(committed, cache=cache)
    tree_logits = model(tokens.view(1, -1), b.position_ids + prefix, b.attn_mask, cache)[0].float()  # (N, V)
    index = {p: i for i, p in enumerate(b.node_paths)}
    tolerance = SPACINGS * spacing(tree_logits.abs().max())
    for i, path in enumerate(b.node_paths):
        path_tokens = tokens[[index[path[:k]] for k in range(len(path) + 1)]].view(1, -1)
        plain = model(torch.cat([committed, path_tokens], dim=1))[0, -1].float()
        worst = (tree_logits[i] - plain).abs().max()
        assert worst <= tolerance, f"node {i}, path {path}: {worst:.4f} apart, above {SPACINGS} bf16 spacings ({tolerance:.4f})"


@pytest.mark.parametrize("drafter", ["medusa", "eagle3"])
def test_bf16_greedy_speculation_follows_plain_bf16_until_a_near_tie(drafter):
    """10 prompts x 64 tokens on a random model (small margins: a hard case) in bf16: the drafter's greedy text
    equals plain bf16 greedy up to its first difference, and there plain's top-2 margin is below the
    tolerance above (a near-tie that rounding may flip); identical to the end on most prompts (measured:
    10 of 10 on this model with Medusa, and with EAGLE-3, whose tree passes also return its layers' features)."""
    from feature_drafter import feature_generate
    from test_eagle3 import random_eagle3
    trained = random_medusa(seed=3, block_size=80) if drafter == "medusa" else random_eagle3(3, block_size=80)
    model = dtypes.decoding_copy(trained, BF16)
    decode = medusa_generate if drafter == "medusa" else feature_generate
    tree = [(0,), (1,), (0, 0), (0, 0, 0)]
    identical = 0
    for seed in range(10):
        prompt = torch.randint(0, 32, (1, 4), generator=torch.Generator().manual_seed(seed))
        plain = generate(model, prompt, 64)[0]
        fast, _ = decode(model, prompt, 64, tree)
        fast = fast[0]
        differ = (fast != plain).nonzero()
        if not len(differ):
            identical += 1
            continue
        first = int(differ[0])
        top2 = model.base(plain[None, :first])[0, -1].float().topk(2).values
        margin = top2[0] - top2[1]
        assert margin <= SPACINGS * spacing(top2[0]), (f"prompt {seed}: speculation left plain bf16 at token {first}, "
                                                       f"where plain's top-2 margin is {margin:.4f}: not a near-tie")
    assert identical >= 8, f"identical to the end on {identical} of 10 prompts"


@pytest.mark.parametrize("drafter", ["medusa", "eagle", "mtp", "eagle3"])
def test_exact_sampling_in_bf16_draws_what_plain_bf16_sampling_draws(drafter):
    """The same identity in bfloat16 (lab/dtypes.decoding_copy): the walk's conditionals are the bf16 model's,
    softmax on float32 logits, so with the same seed it writes plain bf16 sampling's text."""
    from feature_drafter import feature_generate
    from feature_drafter import DynamicTree
    from lab.dtypes import decoding_copy
    model = decoding_copy({"medusa": skewed_model, "eagle": skewed_eagle, "mtp": skewed_mtp, "eagle3": skewed_eagle3}[drafter](), torch.bfloat16)
    prompt = torch.tensor([[1, 2]])
    decode = {"medusa": medusa_generate, "eagle": feature_generate, "mtp": feature_generate, "eagle3": feature_generate}[drafter]
    tree = TREE_2 if drafter == "medusa" else DynamicTree(topk=2, nodes=4, depth=2)
    for seed in range(SEEDS // 4):
        torch.manual_seed(seed)
        out, _ = decode(model, prompt, 6, tree, temperature=0.7, sampling="exact")
        torch.manual_seed(seed)
        plain = generate(model.base, prompt, 6, temperature=0.7)
        assert torch.equal(out, plain), f"seed {seed}: exact {out[0, 2:].tolist()}, plain {plain[0, 2:].tolist()}"


def test_exact_sampling_in_bf16_matches_the_bf16_models_joint_distribution():
    """The chi-square family of the float32 test, in bfloat16, against the bf16 model's own joint."""
    from lab.dtypes import decoding_copy
    torch.manual_seed(1)
    model = decoding_copy(skewed_model(), torch.bfloat16)
    prompt = torch.tensor([[1, 2]])
    joint = true_joint(model, prompt, 0.7, 3, V_SMALL)
    counts = torch.zeros(V_SMALL, V_SMALL, V_SMALL)
    for _ in range(N_DRAWS):
        out, _ = medusa_generate(model, prompt, 3, TREE_2, temperature=0.7, sampling="exact")
        counts[tuple(out[0, 2:].tolist())] += 1
    assert_follows(counts, joint, "exact sampling in bf16")


def test_the_agreement_with_float32_counts_tokens_to_the_first_difference():
    """report.precision_agreement on hand-made runs: the tokens before each mode's first difference from the
    float32 text, the prompts identical to the end, the float32 margin where a mode leaves, and speeds
    against the fastest plain decoding at either precision."""
    from lab import report
    from lab.timing import Mode
    model = random_medusa()
    low = dtypes.decoding_copy(model, BF16)
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    ref = [[7, 8, 9, 10], [11, 12, 13, 14]]
    outputs = {report.REFERENCE: ref, "plain greedy": [[7, 8, 0, 0], [11, 12, 13, 14]],
               "medusa greedy": [[7, 0, 0, 0], [11, 12, 13, 14]]}
    modes = {report.REFERENCE: Mode(generate, model=model.base), "plain greedy": Mode(generate),
             "medusa greedy": Mode(medusa_generate, model=low, tree=[(0,)], drafter="medusa")}
    runs = {(name, 1): {"outputs": out} for name, out in outputs.items()}
    table = {report.REFERENCE: {"tokens_per_s": 100.0}, "plain greedy": {"tokens_per_s": 80.0},
             "medusa greedy": {"tokens_per_s": 150.0}}
    got = report.precision_agreement(runs, modes, table, model.base, prompts, [1])
    plain, medusa = got["modes"]["plain greedy"], got["modes"]["medusa greedy"]
    assert plain["agreed"] == [2, 4] and medusa["agreed"] == [1, 4] and medusa["identical"] == 1
    assert medusa["agreed_vs_plain"] == pytest.approx(2.5 / 3) and medusa["vs_fastest_plain"] == pytest.approx(1.5)
    with torch.no_grad():
        logits = model.base(torch.tensor([[1, 2, 3, 7]]))[0, -1].topk(2).values
    assert medusa["margin_at_divergence"][0] == pytest.approx(float(logits[0] - logits[1]), abs=1e-5)
    assert medusa["margin_at_divergence"][1] is None and got["dtype"] == "bfloat16"
    assert got["fastest_plain"] == report.REFERENCE
