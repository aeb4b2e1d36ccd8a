"""The CUDA backend and the GPU attention paths; skipped cleanly without a GPU and driver
(and an error, not a skip, where a GPU is visible but the driver binding is not)."""

import os

import pytest
import torch
from cuda_cases import fill_on_gpu
from repo import ROOT

from vmcache import KVSpec, VMKVCache, kernels
from vmcache.kernels import contiguous, triton_decode
from vmcache.kernels.reference import dense_attention
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

pytestmark = pytest.mark.gpu


@pytest.fixture
def backend():
    from vmcache.memory.backends.cuda import CudaBackend

    be = CudaBackend("cuda")
    yield be
    be.close()


def test_triton_is_compiled_not_interpreted():
    assert os.environ.get("TRITON_INTERPRET") == "0"
    assert not isinstance(triton_decode._decode_partial, triton_decode.InterpretedFunction)


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


def test_unknown_handles_are_typed_errors_and_driver_errors_name_the_call(backend):
    from vmcache import DriverError

    P = backend.granularity
    va = backend.reserve(2 * P)
    with pytest.raises(ValueError, match="unknown"):
        backend.map(va, [12345678], P)
    h = backend.create_page(P)
    backend.map(va, [h], P)
    with pytest.raises(DriverError, match="cuMemMap") as info:
        backend.map(va, [h], P)  # the driver refuses a map over a mapped page
    assert info.value.code.startswith("CUDA_ERROR")
    backend.unmap(va, 1, P)


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
        h = c.swap.out(kids[0])
        back = c.swap.restore(h)
        assert torch.equal(c.kv(0, back)[0][:1000], k) and torch.equal(c.kv(1, back)[1][:1000], -k)
        c.beams.truncate(back, 10)
        c.beams.assign([kids[1]], [back])
        check_invariants(c)
        assert "CacheView" in repr(c.views.k_cache(0))  # printing reads no unmapped memory


TOL = {torch.float32: dict(rtol=2e-4, atol=2e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


def _every_impl(cache, kind, seqs, written, q_lens, dtype, windows=(None, None)) -> set:
    """Decode and prefill (``q_lens`` queries each) with every impl available here on layers
    0 and 1 (sliding ``windows[layer]``, None = full) against the reference over what the
    test wrote; returns the impls that ran (prefill's as "prefill/<impl>")."""
    hq, hd = cache.spec.q_heads, cache.spec.head_dim
    q = torch.randn(len(seqs), hq, hd, device="cuda").to(dtype)
    qp = torch.randn(sum(q_lens), hq, hd, device="cuda").to(dtype)
    ran = set()
    for layer, w in enumerate(windows):
        ref = torch.stack([dense_attention(q[i : i + 1].cpu().float(),
                                           *(t.float() for t in written[s, layer]), window=w)[0]
                           for i, s in enumerate(seqs)])  # fmt: skip
        impls = ["triton", "sdpa"] if kind == "paged" else contiguous.available_impls(q)
        for impl in impls:
            out = kernels.decode(cache, layer, q, seqs, impl=impl).float().cpu()
            torch.testing.assert_close(out, ref, **TOL[dtype], msg=f"decode {impl} L{layer}")
            ran.add(impl)
        pre = (
            ["triton", "sdpa"]
            if kind == "paged"
            else [
                i
                for i in contiguous.PREFILL_IMPLS
                if i in (*contiguous.available_impls(qp), "sdpa")
            ]
        )
        for impl in pre:
            out = kernels.prefill(cache, layer, qp, seqs, q_lens, impl=impl).float().cpu()
            start = 0
            for s, ql in zip(seqs, q_lens):
                ref_p = dense_attention(
                    qp[start : start + ql].cpu().float(),
                    *(t.float() for t in written[s, layer]),
                    window=w,
                )
                torch.testing.assert_close(out[start : start + ql], ref_p, **TOL[dtype],
                                           msg=f"prefill {impl} L{layer}")  # fmt: skip
                start += ql
            ran.add(f"prefill/{impl}")
    return ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["vm", "vm_token_major", "paged"])
def test_decode_and_prefill_every_gpu_impl(kind, dtype):
    spec = KVSpec(2, 8, 128, dtype, num_q_heads=32)
    cache, seqs, written = fill_on_gpu(kind, spec)
    ran = _every_impl(cache, kind, seqs, written, [1, 3, 16, 17, 100, 1, 2, 5, 64, 1, 200], dtype)
    if torch.cuda.get_device_capability()[0] >= 8:
        assert {"triton", "prefill/triton"} <= ran
        if kind != "paged" and dtype != torch.float32:
            assert {"aten_fa2", "prefill/aten_fa2"} <= ran  # the primary contiguous path
    cache.close()


def test_soak_on_the_cuda_backend():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import soak

    for name, make in soak.factories("cuda").items():
        r = soak.soak(make, ops=1500, seed=2, check_every=100)
        assert r["violations"] == 0 and r["leaked_pages"] == 0, (name, r["first_violations"])


@pytest.mark.parametrize("shape", [(8, 128, 700), (32, 96, 2047)], ids=["8x128", "32x96"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["vm", "vm_token_major", "paged"])
def test_windowed_decode_and_prefill_after_pages_were_unmapped(kind, dtype, shape):
    """A hybrid spec (layer 0: a 700-token window; layer 1: full): every sequence grows in two
    steps, so the second grow unmaps (cuMemUnmap) the 2 MiB pages wholly before the window;
    every impl (aten FA2 with window_size_left, Triton with its start offset, flash-attn's
    window_size where installed, SDPA with a window mask) must match the reference and read
    nothing unmapped (an illegal address would be sticky and fail every later test). 32 × 96
    heads put 341.3 tokens in a 2 MiB bf16 page: FA2's first K tile starts before the window,
    in a page the unaligned rule released (test_window_tiles.py)."""
    heads, hd, w = shape
    spec = KVSpec(2, heads, hd, dtype, num_q_heads=heads * 4 if heads == 8 else heads,
                  layer_windows=(w, None))  # fmt: skip
    lens, q_lens = [1, 700, 1500, 2049, 4097], [1, 5, 64, 1, 200]
    if kind == "paged":
        cache = PagedKVCache(spec, num_blocks=3000, block_size=16, device="cuda",
                             max_seq_len=4200, max_seqs=5)  # fmt: skip
    else:
        layout = "token_major" if kind == "vm_token_major" else "layer_major"
        cache = VMKVCache(spec, 5, 4200, device="cuda", layout=layout)
    g = torch.Generator(device="cuda").manual_seed(0)
    seqs, written = [], {}
    for n, ql in zip(lens, q_lens):
        s = cache.new_sequence()
        for start, step in ((0, n - ql), (n - ql, ql)):
            if not step:
                continue
            cache.grow(s, step)
            for layer in range(2):
                k, v = (torch.randn(step, heads, hd, device="cuda", generator=g).to(dtype)
                        for _ in range(2))  # fmt: skip
                cache.write(layer, s, start, k, v)
                old = written.get((s, layer))
                new = (k.cpu(), v.cpu())
                written[s, layer] = new if old is None else tuple(
                    torch.cat([a, b]) for a, b in zip(old, new))  # fmt: skip
        seqs.append(s)
    assert cache.views.window_start(0, seqs[-1]) > 0 and cache.stats().window_released_pages > 0
    _every_impl(cache, kind, seqs, written, q_lens, dtype, windows=(w, None))
    torch.cuda.synchronize()
    cache.close()


@pytest.mark.parametrize("layout", ["layer_major", "token_major", "paged"])
def test_handoff_wires_read_and_fill_gpu_pages_in_place(layout):
    """What send_sequence / recv_sequence move, within one process: the sender's wires (one
    view per table over its CUDA virtual range), copied into the wires of a sequence adopted
    by a second cache (NCCL needs a GPU per rank; this checks the views themselves)."""
    from vmcache.distributed import plan_handoff

    spec = KVSpec(4, 2, 64, torch.bfloat16)
    make = (lambda: PagedKVCache(spec, num_blocks=200, max_seq_len=3000, max_seqs=2,
                                 device="cuda")) if layout == "paged" else (
        lambda: VMKVCache(spec, 2, 3000, "cuda", layout=layout))  # fmt: skip
    a, b = make(), make()
    s = a.new_sequence()
    a.grow(s, 2500, token_ids=list(range(2500)))
    for layer in range(4):
        k = torch.randn(2500, 2, 64, device="cuda", dtype=torch.bfloat16)
        a.write(layer, s, 0, k, -k)
    msgs, _ = plan_handoff(a, s)
    assert msgs == (2 * 4 * 157 if layout == "paged" else 8 if layout == "layer_major" else 2)

    def fill(t):
        for src, dst in zip(a.handoff.runs(s), b.handoff.runs(t)):
            dst.unpack(src.packed().clone())

    t = b.handoff.adopt(a.handoff.manifest(s), fill)
    for layer in range(4):
        for x, y in zip(a.kv(layer, s), b.kv(layer, t)):
            assert torch.equal(x, y)
    check_invariants(b)


@pytest.mark.parametrize("keep", ["host", "none"])
def test_sleep_releases_device_memory_and_wake_maps_the_same_addresses(keep):
    spec = KVSpec(2, 8, 128, torch.bfloat16)
    with VMKVCache(spec, 2, 4096, device="cuda") as c:
        s = c.new_sequence()
        c.grow(s, 3000)
        k = torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16)
        for layer in range(2):
            c.write(layer, s, 0, k, -k)
        view, ptr = c.views.k_cache(1), c.views.k_cache(1).data_ptr()
        held = c.elastic.resident_bytes
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        reserved = torch.cuda.memory_reserved()
        assert c.elastic.sleep(keep=keep) == held and c.elastic.resident_bytes == 0
        # no empty_cache(): the copy out allocated nothing on the device (per-run copies into
        # an exact host tensor), and cuMemRelease gave every page back to the device
        assert torch.cuda.memory_reserved() == reserved
        assert torch.cuda.mem_get_info()[0] >= free_before + held
        c.elastic.wake()
        assert c.views.k_cache(1).data_ptr() == ptr  # same virtual addresses
        want = k if keep == "host" else torch.zeros_like(k)
        assert torch.equal(view[s, :3000], want)  # a view from before sleep reads the bytes
        check_invariants(c)


def test_a_paged_sleep_returns_its_block_tensor_to_the_device():
    """PagedKVCache's blocks are torch's memory: sleep frees the storage and hands it back to
    the device (not only to torch's cache of blocks), gathering in bounded chunks."""
    spec = KVSpec(2, 8, 128, torch.bfloat16)
    c = PagedKVCache(spec, num_blocks=4096, block_size=16, device="cuda", max_seqs=2,
                     max_seq_len=4096)  # fmt: skip
    s = c.new_sequence()
    c.grow(s, 3000)
    k = torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    for layer in range(2):
        c.write(layer, s, 0, k, -k)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    pool_bytes = c._kv_pool.untyped_storage().nbytes()
    c.elastic.sleep(keep="host")
    assert torch.cuda.mem_get_info()[0] >= free_before + pool_bytes - (64 << 20)
    c.elastic.wake()
    kk, vv = c.kv(1, s)  # written as K = k, V = -k
    assert torch.equal(kk, k) and torch.equal(vv, -k)
    c.close()


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_prefix_tiers_round_trip_gpu_pages(kind, tmp_path):
    from vmcache.prefix.tiers import PrefixTiers

    spec = KVSpec(2, 8, 128, torch.bfloat16)
    tiers = PrefixTiers(1, disk_dir=tmp_path, disk_bytes=1 << 30)  # everything to disk
    if kind == "vm":
        c = VMKVCache(spec, 4, 4096, device="cuda", layout="token_major", prefix_caching=True,
                      prefix_tiers=tiers)  # fmt: skip
    else:
        c = PagedKVCache(spec, num_blocks=128, device="cuda", max_seq_len=4096, max_seqs=4,
                         prefix_caching=True, prefix_tiers=tiers)  # fmt: skip
    ids = list(range(1100))
    s = c.new_sequence(prefix_tokens=ids)
    c.grow(s, len(ids), token_ids=ids)
    k = torch.randn(len(ids), 8, 128, device="cuda", dtype=torch.bfloat16)
    for layer in range(2):
        c.write(layer, s, 0, k, -k)
    c.free(s)
    c.prefix.index.clear()  # to disk, one device copy
    s = c.new_sequence(prefix_tokens=ids)
    n = c.seq_len(s)
    assert n > 0 and c.prefix.index.stats().tier_hit_tokens == n
    for layer in range(2):
        kk, vv = c.kv(layer, s)
        assert torch.equal(kk, k[:n]) and torch.equal(vv, -k[:n])
    assert c.prefix.tier_stats().device_copies == 2
    c.free(s)
    check_invariants(c)
    c.close()


@pytest.mark.parametrize("kind", ["vm", "vm_token_major", "paged"])
def test_token_trees_run_in_the_triton_prefill_and_match_sdpa(kind):
    """A step mixing a token tree (three chains), a causal chunk and a decode row: the CUDA
    default (one Triton prefill reading the tree's ancestor bits) against SDPA with the
    explicit mask, per sequence."""
    spec = KVSpec(2, 8, 128, torch.bfloat16, num_q_heads=32)
    cache, seqs, _ = fill_on_gpu(kind, spec)
    from kernel_cases import ancestors

    anc = ancestors([-1, 0, 1, 0, 3, 0, 5])  # three chains
    picked = seqs[3:7]  # lengths 64, 65, 511, 512
    q_lens = [3, 7, 1, 7]
    masks = [None, anc.cuda(), None, anc.cuda()]
    q = torch.randn(sum(q_lens), 32, 128, device="cuda").to(torch.bfloat16)
    fast = kernels.attend(cache, 0, q, picked, q_lens, masks=masks).float()
    slow = kernels.attend(cache, 0, q, picked, q_lens, masks=masks,
                          impl="sdpa").float()  # fmt: skip
    torch.testing.assert_close(fast, slow, **TOL[torch.bfloat16])
    cache.close()
