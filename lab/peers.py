"""Peers: Hugging Face `transformers` decoding SmolLM2 from the same GGUF file, beside our decoders.

Two rows a user would try first: transformers' greedy `generate`, and its prompt-lookup decoding
(`prompt_lookup_num_tokens`, a training-free drafter: the draft is the tokens that followed the
last n-gram's earlier occurrence in the text). Both follow the call and return contract of our
plain decoding (medusa_mini.generate), so measure.compare times them in the same interleaved run.

transformers is optional, not a requirement of the project: `pip install transformers accelerate`.
Where it is missing, available() is False and the loader raises one line saying so.
Shapes: S prompt tokens, n new tokens, V vocabulary.
"""
import importlib.util
import os

import torch

import smollm

INSTALL = "pip install transformers accelerate"
LOOKUP = 10  # draft tokens per prompt-lookup step: transformers' suggested value


def available() -> bool:
    """Whether transformers and gguf (which it reads GGUF files with) are installed; imports neither."""
    return all(importlib.util.find_spec(name) is not None for name in ("transformers", "gguf"))


def load_transformers_smollm2(device="cpu"):
    """transformers' LlamaForCausalLM from the GGUF file smollm.load_smollm2 reads, dequantized to
    fp32, in eval mode on `device`. Local files only: nothing is downloaded (works with HF_HUB_OFFLINE=1).
    transformers undoes llama.cpp's q/k permutation itself (rotate-half RoPE) and ties lm_head to the
    embedding; it still calls the model quantized (a GGUF "quantizer"), though every weight is fp32."""
    if not available():
        raise ValueError(f"transformers is not installed (it is optional): {INSTALL}")
    from transformers import AutoModelForCausalLM
    path = smollm.gguf_path()
    # dtype= (torch_dtype= before transformers 4.56, deprecated since); .to() below makes sure of fp32.
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, local_files_only=True)
    # Set once, so that no call warns: greedy, and no stop token unless a call names some (the
    # GGUF's eos, <|im_end|>, would otherwise end every answer); pad_token_id stays the GGUF's.
    config = model.generation_config
    config.do_sample, config.use_cache, config.eos_token_id = False, True, None
    return model.to(torch.float32).to(device).eval()


def _generate(model, idx, n_new, stop_tokens, temperature, **kwargs):
    """model.generate, greedy, cut to our contract: (1, S) -> (1, S + n), n <= n_new, ending right
    after the first stop token (included) if one came."""
    if temperature != 0:
        raise ValueError(f"the transformers peers decode greedily: temperature must be 0, got {temperature}")
    S, stops = idx.size(1), list(stop_tokens or [])
    out = model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n_new,
                         do_sample=False, use_cache=True, eos_token_id=stops or None,
                         pad_token_id=stops[0] if stops else None, **kwargs)  # (1, S + m), m <= n_new
    new = out[0, S:S + n_new]                                                 # (m,)
    if stops:
        hits = torch.isin(new, torch.tensor(stops, device=new.device)).nonzero()
        new = new[:int(hits[0]) + 1] if len(hits) else new
    return out[:, :S + new.numel()]                                           # (1, S + n)


def transformers_greedy(model, idx, n_new, stop_tokens=None, temperature=0.0):
    """transformers' greedy generate: idx (1, S) -> (1, S + n), n <= n_new."""
    return _generate(model, idx, n_new, stop_tokens, temperature)


def transformers_prompt_lookup(model, idx, n_new, stop_tokens=None, temperature=0.0, lookup=LOOKUP):
    """transformers' prompt-lookup decoding, `lookup` draft tokens per step: idx (1, S) -> (1, S + n).
    Greedy, so its output is transformers' greedy output."""
    return _generate(model, idx, n_new, stop_tokens, temperature, prompt_lookup_num_tokens=lookup)
