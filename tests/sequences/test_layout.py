"""Rows start at whole tokens for every shape, so the flat varlen view (aten FA2's
``cu_seq_k = slot · L_row``) addresses exactly the row the 4-D view does."""

import pytest
import torch
from repo import ROOT

from vmcache import KVSpec, VMKVCache
from vmcache.kernels.contiguous import flat_rows
from vmcache.memory.backends.sizing import SizingBackend

P = 2 << 20


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
@pytest.mark.parametrize("layers", [28, 32, 80])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_every_row_starts_at_a_whole_token(head_dim, layers, layout):
    spec = KVSpec(layers, 8, head_dim, torch.bfloat16)
    c = VMKVCache(spec, 16, 4100, backend=SizingBackend(P), layout=layout, pool_bytes=8 * P)
    assert c._row_bytes % P == 0 and c._row_bytes % c._token_row_bytes == 0
    l_row = c.views.layer_row_tokens(0)
    assert l_row >= 4100
    for layer in (0, layers - 1):
        k = c.views.k_cache(layer)
        flat = flat_rows(k, l_row)
        for s, t in ((0, 0), (3, 17), (15, 4099)):
            want = k.storage_offset() + s * k.stride(0) + t * k.stride(1)
            got = flat.storage_offset() + (s * l_row + t) * flat.stride(0)
            assert got == want, (s, t)
    assert c._pages_per_row * P == c._row_bytes


def test_a_cache_of_one_sequence_flattens_whatever_its_row_stride():
    """One sequence of 2049 tokens on 2 MiB pages (the GPU attention benchmark's batch 1): the
    K view's size-1 row dimension comes back from ``unflatten`` with a dense stride (2049
    tokens) rather than the padded row's (2560); the flat view must still address it."""
    spec = KVSpec(1, 8, 128, torch.float32)
    c = VMKVCache(spec, 1, 2049, backend=SizingBackend(P), pool_bytes=8 * P)
    k, l_row = c.views.k_cache(0), c.views.layer_row_tokens(0)
    assert l_row > 2049 and k.stride(0) != l_row * k.stride(1)  # the case being tested
    flat = flat_rows(k, l_row)
    for t in (0, 17, 2048):
        assert flat[t].data_ptr() == k[0, t].data_ptr()


def test_a_row_that_is_not_whole_tokens_is_refused():
    x = torch.empty(400, dtype=torch.float32).as_strided((3, 10, 2, 5), (107, 10, 5, 1))
    with pytest.raises(ValueError, match="row stride"):
        flat_rows(x, 10)


def test_the_library_never_uses_assert():
    """``python -O`` strips asserts: nothing in the library may depend on one."""
    import ast

    root = ROOT
    found = []
    for folder in ("vmcache", "kernels", "paged_fallback"):
        for path in (root / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            found += [
                f"{path.name}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Assert)
            ]
    assert not found, found
