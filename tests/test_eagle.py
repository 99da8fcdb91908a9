"""EAGLE (eagle.py): the draft layer, its tree drafted depth by depth on its own cache, and decoding
through the shared verifier: exact greedy output, the model's distribution when sampling, and
drafts that are accepted when the layer is good."""
import pytest
import torch
import torch.nn.functional as F

from conftest import trained_once, assert_same_tokens, clock_gpt, periodic_batch, tiny_config
from eagle import EagleModel, eagle_loss
from feature_drafter import feature_generate
from feature_drafter import DynamicTree, FeatureDrafter, chain_outputs
from medusa_mini import GPT, generate
from mtp import MTPModel
from tree import dense_tree
from verify import prefill

STATIC = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)]  # two branches go deep
WIDE = dense_tree([3, 3, 2, 1])  # 48 nodes: many entries that must not see each other's branches


def random_eagle(seed=0, scale=4.0, **kw):
    """An untrained base with weights scaled up, so that its logits (and ranks) are far apart, and an
    EAGLE layer as initialised: its outputs stay the size of a feature from depth to depth, so that what
    an entry attends to (its own branch or others) moves its draft's ranks."""
    torch.manual_seed(seed)
    model = EagleModel(GPT(tiny_config(**kw)))
    with torch.no_grad():
        for p in model.base.parameters():
            p.mul_(scale)
    return model.eval()


def random_mtp(depth, seed=0, scale=4.0, **kw):
    """An untrained base with `depth` MTP modules, scaled as random_eagle's."""
    torch.manual_seed(seed)
    model = MTPModel(GPT(tiny_config(**kw)), depth)
    with torch.no_grad():
        for p in model.base.parameters():
            p.mul_(scale)
    return model.eval()


def random_eagle3(**kw):
    from test_eagle3 import random_eagle3
    return random_eagle3(**kw)


MODELS = {"eagle": lambda: random_eagle(block_size=64), "mtp1": lambda: random_mtp(1, block_size=64),
          "mtp2": lambda: random_mtp(2, block_size=64), "eagle3": lambda: random_eagle3(block_size=64)}


@pytest.mark.parametrize("tree", [WIDE, DynamicTree(topk=4, nodes=24, depth=4)], ids=["static", "dynamic"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_drafted_node_equals_its_own_paths_draft(tree, kind):
    """Node (r1, ..., rd) of a drafted tree carries rank rd of the distribution its layers give when run
    along that node's own path with no tree: eagle.chain_outputs, a teacher-forced batch pass with the
    path as the text. So the tree mask on the draft caches, the entries' positions, which layer drafts
    which depth (MTP's modules), and the committed entries (catch-up) are right. Checked after a first
    step too, once entries were committed."""
    from verify import tree_decoding
    model = MODELS[kind]()
    drafter = FeatureDrafter(model, tree, "cpu")
    head, ids = model.token_head()
    state, h = prefill(model.base, torch.tensor([[3, 9, 27, 1, 14]]), extra=drafter.nodes, taps=drafter.taps)
    drafter.start(state, h)
    for step in range(2):
        root = state.logits.argmax()
        draft = drafter.propose(state, root, 4)
        tokens = torch.cat([state.tokens[0], root.view(1)])                      # (L + 1,)
        index = {p: i for i, p in enumerate(draft.buffers.node_paths)}
        for i, path in enumerate(draft.buffers.node_paths[1:], start=1):
            along = draft.tokens[[index[path[:k]] for k in range(1, len(path))]]  # its ancestors' tokens
            seq = torch.cat([tokens, along, tokens.new_zeros(1)])[None]           # (1, L + 1 + depth)
            layer, out = list(chain_outputs(model, seq, len(path)))[-1]           # the entries drafting its depth
            ranked = F.linear(layer.norm_out(out[0, -1]), head).topk(path[-1] + 1).indices
            ranked = ranked if ids is None else ids[ranked]
            assert draft.tokens[i] == ranked[-1], (f"{kind}, step {step}, node {path}: drafted "
                                                   f"{int(draft.tokens[i])}, its own path gives {ranked.tolist()}")
        # commit the root and the first child, as a step would, and go on from there
        hs, logits = tree_decoding(model.base, draft.tokens, draft.buffers, state.cache, drafter.taps)
        state.cache.keep(state.tokens.size(1), torch.tensor([0, 1]))
        state.tokens = torch.cat([state.tokens, draft.tokens[:2].view(1, -1)], 1)
        state.logits = logits[1]
        drafter.commit(state, [0, 1], hs)


def perfect_clock_layer(reads):
    """A perfect draft layer on tests/conftest.py's clock GPT, whose token at position t is t mod V, with
    the block's output projections zero (it passes its input through), in one of two ways:
    - reads="token": fc = [I, 0]. The base's input for the token at t + 1, wte[x] + wpe[t + 1], is already
      what lm_head reads as t + 2's token: it drafts right if each token is embedded where it sits.
    - reads="feature": fc = [0, P], P = e^T R e shifting each e_v to e_{v+1}: it turns a feature that
      reads as token v into one that reads as v + 1, so it drafts right if each entry is fed its own
      parent's predicted feature (the root's: the base's at the last committed position)."""
    base, e = clock_gpt()
    eagle = EagleModel(base)
    C = base.config.n_embd
    shift = e.T @ e.roll(1, dims=0)                                     # (C, C): P e_v = e_{v+1}, for v < V
    with torch.no_grad():
        blocks = {"token": [torch.eye(C), torch.zeros(C, C)], "feature": [torch.zeros(C, C), shift]}
        eagle.eagle.fc.weight.copy_(torch.cat(blocks[reads], 1))
        eagle.eagle.fc.bias.zero_()
        for layer in (eagle.eagle.block.attn.c_proj, eagle.eagle.block.mlp[-1]):
            layer.weight.zero_()
            layer.bias.zero_()
    return eagle.eval()


@pytest.mark.parametrize("reads", ["token", "feature"])
@pytest.mark.parametrize("tree", [[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], STATIC,
                                  DynamicTree(topk=2, nodes=6, depth=4)], ids=["chain", "static", "dynamic"])
def test_a_perfect_draft_layer_commits_depth_plus_one_tokens_every_step(tree, reads):
    """With drafts that are always right, every step commits a whole 4-deep path: 5 tokens. A draft whose
    token is embedded at the wrong position (the layer that reads the token), or that is fed another
    entry's feature than its parent's (the layer that reads the feature), is rejected."""
    eagle = perfect_clock_layer(reads)
    V = eagle.base.config.vocab_size
    for S in (1, 6):
        idx = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(S))
        out, stats = feature_generate(eagle, idx, 40, tree)
        assert out[0, S:].tolist() == [(S + i) % V for i in range(40)]
        why = ("is each token embedded where it sits?" if reads == "token" else
               "is each entry fed its own parent's predicted feature?")
        assert stats.tokens_per_step == 5.0, (
            f"{stats.tokens_per_step:.2f} tokens/step, expected exactly 5.0 with drafts that are always right; "
            f"accept lengths per step {stats.accept_lengths}: {why}")


@pytest.mark.parametrize("tree", [STATIC, DynamicTree(topk=3, nodes=10, depth=4)], ids=["static", "dynamic"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_eagle_equals_plain_greedy_on_a_random_model(tree, seed, device):
    """An untrained layer drafts mostly wrong tokens: the output is plain greedy's all the same."""
    model = random_eagle(seed, block_size=64).to(device)
    idx = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(seed)).to(device)
    fast, stats = feature_generate(model, idx, 50, tree)
    assert_same_tokens(fast, generate(model.base, idx, 50), model.base, stats, 5)


@trained_once
def periodic_eagle():
    """A base trained on tests/conftest.py's periodic sequence, then an EAGLE layer trained on its
    features (EAGLE-1's loss): a few seconds."""
    torch.manual_seed(0)
    base = GPT(tiny_config())
    opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        xy = periodic_batch(16, 32, g)
        loss = F.cross_entropy(base(xy[:, :-1]).flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model = EagleModel(base.eval().requires_grad_(False))
    opt = torch.optim.AdamW(model.eagle.parameters(), lr=3e-3)
    for _ in range(100):
        xy = periodic_batch(16, 32, g)                                  # (16, 33)
        with torch.no_grad():
            f = base.hidden(xy[:, :-1])                                 # (16, 32, C)
        loss = eagle_loss(model.eagle, base, f, xy[:, 1:], torch.arange(32))[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("tree", [STATIC, DynamicTree(topk=2, nodes=8, depth=4)], ids=["static", "dynamic"])
def test_a_trained_layer_is_accepted_and_exact(tree, device):
    """On the periodic model a trained layer drafts right: well over 2 tokens a step; greedy output still
    equals plain greedy, and with a stop token too."""
    model = periodic_eagle().to(device)
    idx = torch.tensor([[3, 17]], device=device)
    plain = generate(model.base, idx, 40)
    fast, stats = feature_generate(model, idx, 40, tree)
    assert_same_tokens(fast, plain, model.base, stats, 2)
    assert stats.tokens_per_step > 2.5, stats.accept_lengths
    stop = plain[0, 20].item()
    fast, stats = feature_generate(model, idx, 40, tree, stop_tokens=[stop])
    assert_same_tokens(fast, generate(model.base, idx, 40, stop_tokens=[stop]), model.base, stats, 2)
    assert fast[0, -1] == stop


def test_bad_trees_are_refused():
    model = random_eagle()
    with pytest.raises(ValueError, match="rank 40"):
        feature_generate(model, torch.tensor([[1, 2]]), 5, [(0,), (40,)])
    with pytest.raises(ValueError, match="at least 1"):
        feature_generate(model, torch.tensor([[1, 2]]), 5, DynamicTree(topk=0))
    with pytest.raises(ValueError, match="prefix-closed"):
        feature_generate(model, torch.tensor([[1, 2]]), 5, [(0,), (1, 0)])
