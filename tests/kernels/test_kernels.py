"""Attention on both caches against the plain reference (Triton under TRITON_INTERPRET=1)."""

import subprocess
import sys

import pytest
import torch
from kernel_cases import KINDS, MIXED, SHAPES, TOL, WRITTEN, expected_decode, fill, make

from vmcache import KVSpec, kernels
from vmcache.kernels.reference import dense_attention, paged_decode_reference
from vmcache.paged_fallback import block_address


@pytest.mark.parametrize("impl", ["triton", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_reference(kind, group, head_dim, dtype, impl):
    spec = KVSpec(2, 2, head_dim, dtype, num_q_heads=2 * group)
    cache = make(kind, spec)
    seqs = fill(cache, MIXED)
    q = torch.randn(len(seqs), spec.q_heads, head_dim).to(dtype)
    out = kernels.decode(cache, 1, q, seqs, impl=impl)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(
        out.float(), expected_decode(cache, 1, q, seqs).float(), **TOL[dtype]
    )
    cache.close()


def _impls(kind):
    return ["triton", "sdpa"]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_long_sequence(kind):
    """4,097 tokens: five split-K partitions, the last holding one token."""
    spec = KVSpec(1, 2, 64, torch.float32, num_q_heads=8)
    cache = make(kind, spec, max_seq_len=4100, max_seqs=2, block_size=64)
    seqs = fill(cache, [4097, 3])
    q = torch.randn(2, 8, 64)
    for impl in _impls(kind):
        out = kernels.decode(cache, 0, q, seqs, impl=impl)
        torch.testing.assert_close(out, expected_decode(cache, 0, q, seqs), **TOL[torch.float32])


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_default_scale_is_used(kind):
    spec = KVSpec(1, 2, 32, torch.float32, num_q_heads=4)
    cache = make(kind, spec)
    seqs = fill(cache, [7, 40])
    q = torch.randn(2, 4, 32)
    ref = torch.stack([dense_attention(q[i : i + 1], *WRITTEN[id(cache), s, 0], scale=0.37)[0]
                       for i, s in enumerate(seqs)])  # fmt: skip
    for impl in _impls(kind):
        out = kernels.decode(cache, 0, q, seqs, scale=0.37, impl=impl)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(out, kernels.decode(cache, 0, q, seqs, impl=impl))


@pytest.mark.parametrize("kind", KINDS)
def test_the_step_plan_is_built_once_per_step_and_follows_the_cache(kind):
    """Every layer of a step reuses one plan (no upload per layer); a change of the cache
    that moves what the kernels read (lengths; block tables) rebuilds it. Outputs are
    checked against the reference at every step, so a stale plan fails here."""
    spec = KVSpec(3, 2, 32, torch.float32, num_q_heads=4)
    cache = make(kind, spec)
    (s,) = fill(cache, [20])
    (kid,) = cache.fork(s, 1)
    for layer in range(3):
        WRITTEN[id(cache), kid, layer] = WRITTEN[id(cache), s, layer]
    q = torch.randn(2, 4, 32)

    def step():
        before = cache.stats().plans_built
        for layer in range(3):
            out = kernels.decode(cache, layer, q, [s, kid], impl="triton")
            torch.testing.assert_close(out, expected_decode(cache, layer, q, [s, kid]),
                                       rtol=1e-4, atol=1e-5)  # fmt: skip
        return cache.stats().plans_built - before

    assert step() == 1
    assert step() == 0  # nothing changed: the plan stands
    for x in (s, kid):
        cache.grow(x, 1)
    zero = torch.zeros(1, 2, 32)
    for layer in range(3):  # kid's shared tail page splits (a new block on the paged cache)
        k, v = WRITTEN[id(cache), s, layer]
        WRITTEN[id(cache), s, layer] = (torch.cat([k, zero]), torch.cat([v, zero]))  # scrubbed
        k, v = torch.full((21, 2, 32), 3.0), torch.full((21, 2, 32), -1.0)
        cache.write(layer, kid, 0, k, v)
        WRITTEN[id(cache), kid, layer] = (k, v)
    assert step() == 1
    cache.free(kid)
    (again,) = fill(cache, [21], seed=5)  # same slot, same length, other pages
    assert again == kid
    # VMKVCache rows keep their addresses (the plan holds slots and lengths: still right);
    # the paged block table changed, so its plan must be rebuilt
    assert step() == (1 if kind == "paged" else 0)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_causal_over_cached_prefix(kind):
    spec = KVSpec(2, 2, 64, torch.float32, num_q_heads=8)
    cache = make(kind, spec)
    seqs = fill(cache, [5, 40, 100, 17])
    q_lens = [5, 3, 1, 17]  # a fresh prompt, chunked continuations, a decode row
    q = torch.randn(sum(q_lens), 8, 64)
    out = kernels.prefill(cache, 0, q, seqs, q_lens)
    start = 0
    for s, ql in zip(seqs, q_lens):
        ref = dense_attention(q[start : start + ql], *WRITTEN[id(cache), s, 0])
        torch.testing.assert_close(out[start : start + ql], ref, rtol=1e-4, atol=1e-5)
        start += ql


@pytest.mark.parametrize("kind", KINDS)
def test_decode_after_fork_and_swap(kind):
    spec = KVSpec(1, 2, 64, torch.float32, num_q_heads=4)
    cache = make(kind, spec)
    (s,) = fill(cache, [70])
    kids = cache.fork(s, 2)
    cache.grow(kids[0], 1)
    cache.write(0, kids[0], 70, torch.ones(1, 2, 64), torch.ones(1, 2, 64))
    h = cache.swap.out(kids[1])
    back = cache.swap.restore(h)
    seqs = [s, kids[0], back]
    k, v = WRITTEN[id(cache), s, 0]
    WRITTEN[id(cache), back, 0] = (k, v)
    WRITTEN[id(cache), kids[0], 0] = (torch.cat([k, torch.ones(1, 2, 64)]),
                                      torch.cat([v, torch.ones(1, 2, 64)]))  # fmt: skip
    q = torch.randn(3, 4, 64)
    for impl in _impls(kind):
        out = kernels.decode(cache, 0, q, seqs, impl=impl)
        torch.testing.assert_close(out, expected_decode(cache, 0, q, seqs), rtol=1e-4, atol=1e-5)
    assert torch.equal(cache.kv(0, s)[0], cache.kv(0, back)[0])


def test_paged_reference_equals_dense():
    spec = KVSpec(1, 2, 32, torch.float32, num_q_heads=8)
    cache = make("paged", spec)
    seqs = fill(cache, [1, 33, 80])
    q = torch.randn(3, 8, 32)
    lens = torch.tensor([cache.seq_len(s) for s in seqs], dtype=torch.int32)
    views = cache.views
    ref = paged_decode_reference(q, views.k_pool(0), views.v_pool(0), views.block_tables(seqs),
                                 lens)  # fmt: skip
    torch.testing.assert_close(ref, expected_decode(cache, 0, q, seqs), rtol=1e-5, atol=1e-6)


def test_seed_address_arithmetic():
    assert block_address(38, 16) == (2, 6)
    assert block_address(0, 16) == (0, 0)
    assert block_address(15, 16) == (0, 15)
    assert block_address(16, 16) == (1, 0)


def test_contiguous_decode_never_reads_past_length():
    """Pages after each sequence's length are unmapped; touching them would SIGSEGV. Decode
    (Triton tiles of 64 tokens, and SDPA) still succeeds; a direct read past the end faults."""
    spec = KVSpec(1, 1, 32, torch.float32, num_q_heads=1)  # 128 B per token: 32 tokens per page
    cache = make("vm", spec, max_seq_len=512, max_seqs=3)
    seqs = fill(cache, [32, 33, 64])  # lengths ending on and just past page boundaries
    q = torch.randn(3, 1, 32)
    ref = expected_decode(cache, 0, q, seqs)
    for impl in ("triton", "sdpa"):
        torch.testing.assert_close(kernels.decode(cache, 0, q, seqs, impl=impl), ref,
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
    code = (
        "import torch\nfrom vmcache import KVSpec, VMKVCache\n"
        "c = VMKVCache(KVSpec(1, 1, 32, torch.float32), 2, 512, page_size=4096)\n"
        "s = c.new_sequence(); c.grow(s, 32)\n"
        "print(float(c.views.k_cache(0)[s, 31].sum()), flush=True)\n"
        "print(float(c.views.k_cache(0)[s, 32].sum()), flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().splitlines() == ["0.0"] and r.returncode != 0


@pytest.mark.parametrize("bad", ["shape", "tokens", "dupes", "empty_seq", "cache"])
def test_kernel_bad_input(bad):
    spec = KVSpec(1, 2, 16, torch.float32, num_q_heads=4)
    cache = make("vm", spec, max_seq_len=64)
    seqs = fill(cache, [3, 4])
    q = torch.randn(2, 4, 16)
    if bad == "shape":
        q = torch.randn(2, 3, 16)
    elif bad == "tokens":
        q = torch.randn(3, 4, 16)
    elif bad == "dupes":
        seqs = [seqs[0], seqs[0]]
    elif bad == "empty_seq":
        seqs = [seqs[0], cache.new_sequence()]
    exc = TypeError if bad == "cache" else ValueError
    with pytest.raises(exc):
        kernels.decode(object() if bad == "cache" else cache, 0, q, seqs)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_validates_q_lens_and_impl_names(kind):
    spec = KVSpec(1, 2, 16, torch.float32, num_q_heads=4)
    cache = make(kind, spec, max_seq_len=64)
    seqs = fill(cache, [3, 5])
    q = torch.randn(4, 4, 16)
    for bad in ([4, 0], [1, 6], [3], [2, 3]):  # zero, past the length, too few, wrong total
        with pytest.raises(ValueError):
            kernels.prefill(cache, 0, q[: sum(bad)] if sum(bad) != 4 else q, seqs, bad)
    with pytest.raises(ValueError, match="impl"):
        kernels.prefill(cache, 0, q, seqs, [1, 3], impl="no_such_kernel")
    with pytest.raises(ValueError, match="impl"):
        kernels.decode(cache, 0, q[:2], seqs, impl="no_such_kernel")
    assert [cache.seq_len(s) for s in seqs] == [3, 5]  # nothing changed
