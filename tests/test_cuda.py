"""The CUDA backend and the GPU attention paths; skipped cleanly without a GPU and driver."""

import pytest
import torch
from vmcache.kernels import contiguous
from vmcache.kernels.reference import dense_attention
from vmcache.paged_fallback import PagedKVCache

from vmcache import KVSpec, VMKVCache, kernels

pytestmark = pytest.mark.gpu


@pytest.fixture
def backend():
    from vmcache.backends.cuda import CudaBackend

    be = CudaBackend("cuda")
    yield be
    be.close()


def test_granularity_is_queried_and_pages_alias(backend):
    P = backend.granularity
    assert P > 0 and P % 4096 == 0
    va = backend.reserve(4 * P)
    h = backend.create_page(P)
    backend.map(va, [h], P)
    backend.map(va + 2 * P, [h], P)
    a, b = backend.view(va, P), backend.view(va + 2 * P, P)
    a[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device="cuda")
    assert b[:4].tolist() == [1, 2, 3, 4]
    assert a.view(torch.bfloat16).dtype == torch.bfloat16  # zero-copy reinterpretation
    backend.unmap(va, 1, P)
    backend.unmap(va + 2 * P, 1, P)


def test_driver_error_names_the_call(backend):
    from vmcache import DriverError

    with pytest.raises(DriverError, match="cuMemMap"):
        backend.map(backend.reserve(backend.granularity), [12345678], backend.granularity)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_cache_fork_cow_swap_on_gpu(layout):
    spec = KVSpec(2, 8, 128, torch.bfloat16)
    with VMKVCache(spec, 6, 4096, device="cuda", layout=layout) as c:
        s = c.new_sequence()
        c.grow(s, 1000)
        k = torch.randn(1000, 8, 128, device="cuda", dtype=torch.bfloat16)
        for layer in range(2):
            c.write(layer, s, 0, k, -k)
        base = c.stats().physical_pages
        kids = c.fork(s, 4)
        assert c.stats().physical_pages == base
        for i, ch in enumerate(kids):
            c.grow(ch, 1)
            c.write(0, ch, 1000, torch.full((1, 8, 128), i + 1.0, device="cuda",
                                            dtype=torch.bfloat16), k[:1])  # fmt: skip
        assert c.stats().physical_pages <= base + 4 * c._T
        for i, ch in enumerate(kids):
            assert torch.equal(c.kv(0, ch)[0][:1000], k)
            assert (c.kv(0, ch)[0][1000] == i + 1).all()
        h = c.swap_out(kids[0])
        back = c.swap_in(h)
        assert torch.equal(c.kv(0, back)[0][:1000], k) and torch.equal(c.kv(1, back)[1][:1000], -k)
        c.check_invariants()


@pytest.mark.parametrize("kind", ["vm", "vm_token_major", "paged"])
def test_decode_and_prefill_every_gpu_impl(kind):
    spec = KVSpec(1, 8, 128, torch.bfloat16, num_q_heads=32)
    lens = [1, 15, 16, 17, 257, 1000, 4097]
    if kind == "paged":
        cache = PagedKVCache(spec, num_blocks=1000, block_size=16, device="cuda",
                             max_seq_len=4100, max_seqs=8)  # fmt: skip
    else:
        layout = "token_major" if kind == "vm_token_major" else "layer_major"
        cache = VMKVCache(spec, 8, 4100, device="cuda", layout=layout)
    seqs = []
    for n in lens:
        s = cache.new_sequence()
        cache.grow(s, n)
        cache.write(0, s, 0, *(torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
                               for _ in range(2)))  # fmt: skip
        seqs.append(s)
    q = torch.randn(len(seqs), 32, 128, device="cuda", dtype=torch.bfloat16)
    ref = torch.stack([dense_attention(q[i : i + 1].cpu(), *(t.cpu() for t in cache.kv(0, s)))[0]
                       for i, s in enumerate(seqs)]).float()  # fmt: skip
    impls = ["triton"] if kind == "paged" else contiguous.available_impls(q)
    for impl in impls:
        out = kernels.decode(cache, 0, q, seqs, impl=impl).float().cpu()
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2, msg=f"decode {impl}")
    q_lens = [1, 3, 16, 17, 100, 1, 2]
    qp = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    out = kernels.prefill(cache, 0, qp, seqs, q_lens).float().cpu()
    start = 0
    for s, ql in zip(seqs, q_lens):
        ref = dense_attention(qp[start : start + ql].cpu(), *(t.cpu() for t in cache.kv(0, s)))
        torch.testing.assert_close(out[start : start + ql], ref.float(), rtol=2e-2, atol=2e-2)
        start += ql
    cache.close()


def test_soak_on_the_cuda_backend():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import soak

    for name, make in soak.factories("cuda").items():
        r = soak.soak(make, ops=1500, seed=2, check_every=100)
        assert r["violations"] == 0 and r["leaked_pages"] == 0, (name, r["first_violations"])
