"""One drafter registry (lab/drafters.py): a drafter is its own file and one entry, and nothing else in the
project asks which drafter it holds.

A fourth drafter, defined and registered in this file alone (it drafts a chain repeating the root
token), runs through the report's interleaved comparison and through `sample.py` on a checkpoint this
test writes, greedy-identical to plain decoding: what a contributor adding a drafter would do."""
import ast
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import sample
from lab import checkpoints, data, drafters, report, runs, tree_choice
from lab.checkpoints import BaseInfo, Checkpoint, DrafterInfo
from lab.drafters import DrafterKind
from medusa_mini import GPT, GPTConfig, generate
from tree import gather_paths, tree_cuts
from verify import Draft, Drafter, speculative_generate

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"medusa", "eagle", "eagle3", "mtp"}


# ---------------------------------------------------------------- nothing branches on a name

def name_dispatch(tree, names=NAMES) -> list[str]:
    """Where a parsed file compares a value with one of `names` (a drafter's, by default), keys a dict literal by
    one, or matches one."""
    def names_in(node):
        return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found += [f"line {node.lineno}: {ast.unparse(node)}" for _ in names_in(node)[:1]]
        elif isinstance(node, ast.Dict):
            found += [f"line {node.lineno}: a dict keyed by {k.value!r}" for k in node.keys
                      if isinstance(k, ast.Constant) and k.value in names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith") and any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.split(" ")[0] in names
                    for a in node.args):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.match_case) and names_in(node.pattern):
            found.append(f"line {node.pattern.lineno}: case {ast.unparse(node.pattern)}")
    return found


def test_only_the_registry_branches_on_a_drafters_name():
    """Every tracked Python file outside the registry and the tests: no comparison with "medusa", "eagle"
    or "mtp", no dict literal keyed by them, no startswith on them, no match case."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout: every Python file
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "out" not in p.parts]
    checked, problems = 0, []
    for f in files:
        if f == "lab/drafters.py" or f.startswith(("tests/", "kit/tests/")):
            continue
        checked += 1
        problems += [f"{f}, {where}" for where in name_dispatch(ast.parse((ROOT / f).read_text(encoding="utf-8")))]
    assert checked > 20 and not problems, "\n".join(problems)


def test_the_check_sees_each_kind_of_dispatch():
    code = ('if name == "medusa": pass\nx = {"eagle": 1}\ny = n in ("mtp",)\nz = s.startswith("medusa ")\n'
            'match k:\n    case "eagle": pass\n')
    assert len(name_dispatch(ast.parse(code))) == 5
    assert name_dispatch(ast.parse('load(path, drafter="medusa")\nf"{name}.pt"\n')) == []


def test_the_siblings_read_on_their_own():
    """What EAGLE and MTP share lives in feature_drafter.py; eagle.py does not describe MTP, nor mtp.py EAGLE."""
    assert "mtp" not in (ROOT / "eagle.py").read_text().lower()
    assert "eagle" not in (ROOT / "mtp.py").read_text().lower()


# ---------------------------------------------------------------- a fourth drafter, from this file alone

class RepeatModel(nn.Module):
    """A base and no weights of its own: the drafter guesses that the root token repeats."""

    def __init__(self, base, depth=3):
        super().__init__()
        self.base, self.depth = base, depth
        self.draft_dtype, self.draft_vocab = None, None


def chain(depth):
    return [(0,) * d for d in range(1, depth + 1)]


class RepeatDrafter(Drafter):
    """Drafts the chain root, root, root, ...: a tree of one path, the root's token at every depth."""

    def __init__(self, model, tree, device):
        self.trees = tree_cuts(tree, device)
        self.nodes = len(tree) + 1

    def start(self, state, h):
        pass

    def propose(self, state, root, depth):
        buffers = self.trees[min(depth, max(self.trees))]
        tokens = root.view(1).expand(len(buffers.node_paths)).clone()             # (N,)
        return Draft(tokens, gather_paths(tokens, buffers).masked_fill(buffers.padding, -1), buffers)

    def commit(self, state, kept, h):
        pass


@torch.no_grad()
def repeat_generate(model, idx, max_new_tokens, tree, temperature=0.0, sampling="typical", posterior_threshold=0.09,
                    posterior_alpha=0.3, stop_tokens=None, stream=None):
    return speculative_generate(model.base, RepeatDrafter(model, tree, idx.device), idx, max_new_tokens,
                                temperature, sampling, posterior_threshold, posterior_alpha, stop_tokens, stream)


def repeat_hits(model, seq, start, depth, ranks, features=None, vocab=None):
    """How often the token d + 1 ahead equals the token after the root, at rank 0 (the chain's only rank)."""
    found = []
    for d in range(1, depth + 1):
        n = seq.size(1) - d - 1
        hits = (seq[:, start + 1 + d:n + 1 + d] == seq[:, start + 1:n + 1]).float()   # (B, n - start)
        found.append((torch.tensor([float(hits.sum())] + [0.0] * (ranks - 1)), hits.numel()))
    return found


REPEAT = DrafterKind(name="repeat", model=RepeatModel, drafter=RepeatDrafter, generate=repeat_generate, settings=(),
                     config=lambda run: {}, hits=repeat_hits, depth=lambda model, run: model.depth,
                     extra_trees=lambda model, order, chosen, run: {}, proposals=None, conditional=True)


@pytest.fixture
def registered():
    drafters.register(REPEAT)
    try:
        yield REPEAT
    finally:
        drafters.REGISTRY.pop(REPEAT.name)


@pytest.fixture
def repeat_run(tmp_path):
    """A run folder the test writes: a tiny random GPT, a BPE beside it, and repeat.pt with its trees."""
    text = " ".join(f"to be or not to be, that is question {i};" for i in range(400))
    ranks = data.train_bpe(text, 300)
    data.save_bpe(ranks, str(tmp_path / "bpe300.tiktoken"))
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=300, block_size=64, n_layer=2, n_head=2, n_embd=32)
    model = RepeatModel(GPT(config)).eval()
    order = chain(3)
    chosen = tree_choice.Trees(order, 1, order, [[0.5]] * 3, {1: {"plain_step_ms": 1.0, "step_ms": {3: 1.0},
                                                                  "relative": {3: 1.0}}})
    checkpoints.save(tmp_path / "repeat.pt", Checkpoint(
        base=BaseInfo("gpt", config.__dict__.copy()), drafter=DrafterInfo("repeat"), done=True, model=model.state_dict(),
        tokenizer=checkpoints.tokenizer_entry(tmp_path / "bpe300.tiktoken"), trees={"float32": chosen.to_json()}))
    return tmp_path, model, chosen


def test_a_fourth_drafter_runs_through_the_report(registered, repeat_run):
    """The report's comparison (lab/report.py) times it beside plain decoding and checks its greedy text."""
    _, model, chosen = repeat_run
    prompts = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])]
    result = report.run_report([report.Drafted(registered, model, chosen)], prompts, 12, [1], ops=False,
                               sweep=False, repeats=1)
    mode = result["modes"]["repeat greedy, chosen tree (3 nodes)"]
    assert mode["greedy_identical"] == 1.0 and mode["drafter"] == "repeat"
    assert set(result["drafters"]) == {"repeat"} and result["drafters"]["repeat"]["exact"]["tokens_per_step"] >= 1


def test_a_fourth_drafter_runs_through_sample(registered, repeat_run, capsys):
    """sample.py loads its checkpoint through the registry and decodes with it, as plain greedy does."""
    folder, model, _ = repeat_run
    sample.main(["--out", str(folder), "--drafter", "repeat", "--prompt", "to be", "--tokens", "16", "--compare"])
    printed = capsys.readouterr().out
    assert "repeat: 16 tokens in" in printed and "(identical output)" in printed, printed
    loaded, _ = runs.load_model(folder / "repeat.pt", drafter="repeat")
    idx = torch.tensor([[5, 6, 7]])
    out, _ = repeat_generate(loaded, idx, 20, chain(3))
    assert torch.equal(out, generate(model.base, idx, 20))
