"""The KV cache every base writes to: the keys and values of the committed tokens, layer by layer, and
the attention mask of new tokens written after them. Both bases (medusa_mini.GPT, smollm.Llama) and the
drafters with layers of their own (EAGLE, MTP) keep their entries in one.

Shapes: S committed entries, T new tokens, K the new tokens a mask covers, hs head size.
"""
import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of every committed token, for every layer.

    Preallocated, not concatenated: rejecting draft tokens is then just "do not advance `length`"
    (as in gpt-fast), and keeping the accepted tree path is one indexed copy. During a forward
    each layer writes its T new entries after the `length` committed ones; `advance(T)` then
    counts them. `extra` slots beyond block_size hold the tree nodes being verified.
    `capacity` (default block_size + extra) sizes a cache for a known length, e.g. prompt + new tokens.
    Tree decoding uses batch 1; a batch of B rows (same length) serves plain sampling.
    A drafter with layers of its own (EAGLE, MTP) keeps a cache of this kind for them (n_layer = its layers).
    """

    def __init__(self, config, extra: int = 0, device=None, dtype=torch.float32, batch_size: int = 1,
                 capacity: int | None = None, n_layer: int | None = None):
        capacity = capacity or config.block_size + extra
        n_layer = config.n_layer if n_layer is None else n_layer
        shape = (2, n_layer, batch_size, config.n_kv_head, capacity, config.head_dim)
        # Keys and values in one tensor, so that keep() moves both at once; k and v are its two halves,
        # views of shape (n_layer, B, n_kv, capacity, hs).
        self.kv = torch.zeros(shape, device=device, dtype=dtype)  # (2, n_layer, B, n_kv, capacity, hs)
        self.k, self.v = self.kv[0], self.kv[1]
        self.length = 0  # committed entries

    def append(self, layer: int, k, v):
        """Write new entries after the committed ones; return all keys and values (B, nh, length+T, hs)."""
        end = self.length + k.size(2)
        if end > self.k.size(3):
            raise ValueError(f"KV cache full: {end} entries asked for, capacity {self.k.size(3)}")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int):
        """Count the n entries the last forward appended as committed."""
        self.length += n

    def keep(self, start: int, indices):
        """Keep entries start + indices (ascending) in slots start, start+1, ...; drop every other entry after start.

        indices: a 1-D integer tensor on the cache's device, ascending, offsets counted from `start`
        (so 0 is the entry in slot `start`). Every layer, keys and values alike. Afterwards
        length == start + len(indices); slots from there on are free to be written over."""
        n = len(indices)
        # Keys and values of every layer, (2, n_layer, B, n_kv, n, hs): entries start + indices,
        # gathered, into slots start .. start+n-1
        self.kv[..., start:start + n, :] = self.kv[..., start:, :][..., indices, :]
        self.length = start + len(indices)

    def rollback(self, length: int):
        """Forget every entry after the first `length` (the slots are simply overwritten later).

        Afterwards self.length == length; nothing is erased or copied."""
        self.length = length


def cache_mask(attn_mask, T: int, cache, dtype, device):
    """The attention mask of T new tokens after the cache's S entries, as attention takes it: (T, S+T)
    additive (0 = may attend, -inf = may not), or None where the kernel needs none.

    attn_mask (T, T) among the new tokens, bool (True = may attend) or additive; every new token also
    sees all S cached ones. A wider one, (T, K) with K <= S+T, covers the last K entries: the cached
    ones before them are visible (a drafter's cache holds its tree's entries of other branches after
    its committed ones). None: causal. None comes back for one new token after a cache (it sees
    everything) and for a causal pass without a cache (the fused causal kernel)."""
    if attn_mask is None and (cache is None or T == 1):
        return None
    if attn_mask is None:
        attn_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if attn_mask.dtype == torch.bool:  # additive: attention would convert a bool mask in every layer
        attn_mask = torch.zeros(attn_mask.shape, device=device).masked_fill(~attn_mask, float("-inf"))
    S = cache.length if cache is not None else 0
    return F.pad(attn_mask.to(dtype), (S + T - attn_mask.size(-1), 0), value=0.0)  # (T, K) -> (T, S+T): the rest visible
