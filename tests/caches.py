"""Factories for both caches over the same small spec, shared by interface-level tests.

Every VMKVCache here runs over the host backend wrapped in :class:`StrictBackend`, which
refuses what the CUDA driver would (a map over a mapped page, an unmap of an unmapped one, a
reservation freed with pages in it, misaligned addresses), at the 4 KiB pages these tests use;
``tests/memory/test_backends_strict.py`` runs the cache at CUDA's own 2 MiB granularity.
"""

import torch

from vmcache import KVSpec, VMKVCache
from vmcache.memory.backends.host import HostBackend
from vmcache.memory.backends.strict import StrictBackend
from vmcache.paged_fallback import PagedKVCache


def long_run() -> bool:
    """Under ``make test-long`` (fresh seeds, more examples)."""
    import os

    return os.environ.get("HYPOTHESIS_PROFILE") == "long"


def examples(n: int, long: int | None = None) -> int:
    """``n`` examples for a randomized test; under ``make test-long`` ``long``, by default ten
    times ``n``."""
    if long_run():
        return 10 * n if long is None else long
    return n


def strict_host(granularity=4096, inner=None):
    """The host backend under the CUDA page rules (owned by the cache it is given to)."""
    return StrictBackend(inner if inner is not None else HostBackend(), granularity)


SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
# the same shape, layer 0 an 8-token sliding window, layer 1 full attention (hybrid)
WINDOWED = KVSpec(2, 2, 16, torch.float32, layer_windows=(8, None))
# the same shape stored as INT8 with per-token scales: 48-byte rows (32 + 16 of scales), which
# no 4 KiB page divides, so tokens straddle VM pages
INT8_TOKEN = KVSpec(2, 2, 16, torch.float32, kv_dtype=torch.int8, kv_granularity="token")


def int8_token_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What an INT8 per-token cache gives back for ``x`` [..., N_KV, d_h], computed here from
    the scale rule (amax / 127 per token and head, round to nearest): the tests' oracle."""
    s = (x.abs().amax(-1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / s.unsqueeze(-1)).clamp(-127.0, 127.0).round().to(torch.int8)
    return q.float() * s.unsqueeze(-1)


def vm(pages=64, layout="layer_major", spec=SPEC, **kw):
    kw.setdefault("max_seqs", 8)
    kw.setdefault("max_seq_len", 256)
    return VMKVCache(spec, page_size=4096, pool_bytes=pages * 4096, layout=layout,
                     backend=strict_host(), own_backend=True, **kw)  # fmt: skip


def paged(blocks=24, block_size=16, spec=SPEC, **kw):
    kw.setdefault("max_seqs", 8)
    kw.setdefault("max_seq_len", 256)
    return PagedKVCache(spec, num_blocks=blocks, block_size=block_size, **kw)


FACTORIES = {
    "vm": vm,
    "vm_token_major": lambda **kw: vm(layout="token_major", **kw),
    "paged": paged,
}


def record_coverage(name, counts):
    """With ``VMCACHE_COVERAGE_OUT=FILE`` (``make coverage``), merge what a fixed-seed run of
    a randomized test reached into FILE (JSON), from which docs/results.md's reliability table is
    rendered. Without it, nothing is written."""
    import json
    import os

    path = os.environ.get("VMCACHE_COVERAGE_OUT")
    if not path:
        return
    doc = json.load(open(path)) if os.path.exists(path) else {}
    doc[name] = {k: int(v) for k, v in sorted(dict(counts).items())}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
