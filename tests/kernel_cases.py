"""The kernel tests' caches and oracle: a cache of each kind (VM layer- or token-major,
paged), K/V written at random and kept as the oracle the references read (not what the cache
returns), tolerances per dtype, the GQA shapes, and token-tree ancestry."""

import torch

from vmcache import VMKVCache
from vmcache.kernels.reference import dense_attention
from vmcache.paged_fallback import PagedKVCache

MIXED = [1, 15, 16, 17, 257, 1000]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make(kind, spec, max_seq_len=1024, max_seqs=8, block_size=16):
    if kind == "paged":
        blocks = max_seqs * -(-max_seq_len // block_size)
        return PagedKVCache(spec, num_blocks=blocks, block_size=block_size,
                            max_seq_len=max_seq_len, max_seqs=max_seqs)  # fmt: skip
    layout = "token_major" if kind == "vm_token_major" else "layer_major"
    return VMKVCache(spec, max_seqs, max_seq_len, page_size=4096, layout=layout)


WRITTEN: dict = {}  # (id(cache), seq, layer) -> (k, v) as the test wrote them: the oracle


def fill(cache, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = cache.spec
    seqs = []
    for n in lens:
        s = cache.new_sequence()
        cache.grow(s, n)
        for layer in range(spec.num_layers):
            k, v = (torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g).to(spec.dtype)
                    for _ in range(2))  # fmt: skip
            cache.write(layer, s, 0, k, v)
            WRITTEN[id(cache), s, layer] = (k.clone(), v.clone())
        seqs.append(s)
    return seqs


def expected_decode(cache, layer, q, seqs):
    """The reference over what the test wrote (not over what the cache returns)."""
    return torch.stack([dense_attention(q[i : i + 1], *WRITTEN[id(cache), s, layer])[0]
                        for i, s in enumerate(seqs)])  # fmt: skip


KINDS = ["vm", "vm_token_major", "paged"]
SHAPES = [(1, 64), (4, 96), (8, 64)]  # (GQA ratio, head_dim)


def ancestors(parents):
    """bool [n, n]: row i true at i and its ancestors (parents[i] < i, −1 for a root)."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
    return anc
