"""Factories for both caches over the same small spec, shared by interface-level tests."""

import torch
from vmcache.paged_fallback import PagedKVCache

from vmcache import KVSpec, VMKVCache

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def vm(pages=64, layout="layer_major", spec=SPEC, **kw):
    kw.setdefault("max_seqs", 8)
    kw.setdefault("max_seq_len", 256)
    return VMKVCache(spec, page_size=4096, pool_bytes=pages * 4096, layout=layout, **kw)


def paged(blocks=24, block_size=16, spec=SPEC, **kw):
    kw.setdefault("max_seqs", 8)
    kw.setdefault("max_seq_len", 256)
    return PagedKVCache(spec, num_blocks=blocks, block_size=block_size, **kw)


FACTORIES = {
    "vm": vm,
    "vm_token_major": lambda **kw: vm(layout="token_major", **kw),
    "paged": paged,
}
