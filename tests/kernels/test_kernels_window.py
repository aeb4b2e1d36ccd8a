"""Sliding-window attention on both caches against the plain reference: decode (Triton
split-K, SDPA / gather) and prefill (Triton, SDPA / gather), after the window gave pages back,
so a kernel that read a released page or a key outside the window fails here (the host
backend faults on unmapped reads; the reference is computed from what the test wrote, not
from the cache).

Sizes: head_dim 64 at fp32 is 512 B a token row, 8 tokens a 4 KiB VM page; paged blocks of 8.
Windows: 5 (its boundary falls inside a page), 8 (exactly one page), 300 (longer than every
sequence: nothing is released and the result is full attention)."""

import pytest
import torch

from vmcache import KVSpec, VMKVCache, kernels
from vmcache.kernels.reference import dense_attention
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

KINDS = ["vm", "vm_token_major", "paged"]
LENS = [1, 15, 17, 40, 130]
TOL = dict(rtol=1e-4, atol=1e-5)


def make(kind, spec, rollback=0):
    if kind == "paged":
        return PagedKVCache(spec, num_blocks=4 * 8 * 20, block_size=8, max_seq_len=160,
                            max_seqs=8, rollback_tokens=rollback)  # fmt: skip
    layout = "token_major" if kind == "vm_token_major" else "layer_major"
    return VMKVCache(spec, 8, 160, page_size=4096, layout=layout, rollback_tokens=rollback)


def fill(cache, lens, last, seed=0):
    """Grow each sequence in steps of 7 (the window releases pages as it goes), the final
    step ``last`` tokens; returns seqs and what was written, per (seq, layer)."""
    g = torch.Generator().manual_seed(seed)
    spec, seqs, written = cache.spec, [], {}
    for n in lens:
        s = cache.new_sequence()
        steps = [7] * ((n - last) // 7) + [(n - last) % 7, last]
        for step in (x for x in steps if x):
            start = cache.seq_len(s)
            cache.grow(s, step)
            for layer in range(spec.num_layers):
                k, v = (torch.randn(step, spec.num_kv_heads, spec.head_dim, generator=g)
                        for _ in range(2))  # fmt: skip
                cache.write(layer, s, start, k, v)
                old = written.get((s, layer), (k[:0], v[:0]))
                written[s, layer] = (torch.cat([old[0], k]), torch.cat([old[1], v]))
        seqs.append(s)
    return seqs, written


@pytest.mark.parametrize("window", [5, 8, 300])
@pytest.mark.parametrize("kind", KINDS)
def test_windowed_decode_and_prefill_match_the_reference(kind, window):
    spec = KVSpec(2, 2, 64, torch.float32, num_q_heads=8, layer_windows=(window, None))
    cache = make(kind, spec)
    seqs, written = fill(cache, LENS, last=3)
    if window < 100:  # the window really released pages of the long sequences
        assert cache.views.window_start(0, seqs[-1]) > 0 and cache.stats().window_released_pages > 0
    else:
        assert cache.stats().window_released_pages == 0
    assert all(cache.views.window_start(1, s) == 0 for s in seqs)  # the full layer keeps everything
    q = torch.randn(len(seqs), 8, 64)
    for layer, w in ((0, window), (1, None)):
        want = torch.stack([dense_attention(q[i : i + 1], *written[s, layer], window=w)[0]
                            for i, s in enumerate(seqs)])  # fmt: skip
        for impl in ("triton", "sdpa"):
            got = kernels.decode(cache, layer, q, seqs, impl=impl)
            torch.testing.assert_close(got, want, **TOL, msg=f"{impl} layer {layer}")
    # prefill: each sequence's last 3 tokens (the final grow) attend causally in the window
    q_lens = [min(3, n) for n in LENS]
    qp = torch.randn(sum(q_lens), 8, 64)
    for layer, w in ((0, window), (1, None)):
        want, at = [], 0
        for s, ql in zip(seqs, q_lens):
            want.append(dense_attention(qp[at : at + ql], *written[s, layer], window=w))
            at += ql
        for impl in ("triton", "sdpa"):
            got = kernels.prefill(cache, layer, qp, seqs, q_lens, impl=impl)
            torch.testing.assert_close(got, torch.cat(want), **TOL, msg=f"prefill {impl}")
    check_invariants(cache)
    cache.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_window_larger_than_the_page_and_rollback_margin_keep_what_a_rollback_reads(kind):
    """rollback_tokens = 6: a truncate back by 6 after the release still decodes exactly."""
    spec = KVSpec(1, 2, 64, torch.float32, num_q_heads=4, layer_windows=(12,))
    cache = make(kind, spec, rollback=6)
    (s,), written = fill(cache, [90], last=1)
    assert cache.views.window_start(0, s) > 0
    cache.beams.truncate(s, 84)
    k, v = (x[:84] for x in written[s, 0])
    q = torch.randn(1, 4, 64)
    want = dense_attention(q, k, v, window=12)
    for impl in ("triton", "sdpa"):
        torch.testing.assert_close(kernels.decode(cache, 0, q, [s], impl=impl), want, **TOL)
    with pytest.raises(ValueError, match="rollback_tokens"):
        cache.beams.truncate(s, 60)
    cache.close()


@pytest.mark.parametrize("kind", KINDS)
def test_soft_capped_attention_matches_the_formula_and_refuses_fused_impls(kind):
    """Gemma 2's logit soft-capping: scores c·tanh(s / c), then the window mask and softmax."""
    spec = KVSpec(1, 2, 64, torch.float32, num_q_heads=4, layer_windows=(9,))
    cache = make(kind, spec)
    seqs, written = fill(cache, [5, 40], last=2)
    q = torch.randn(4, 4, 64) * 4  # large scores: the cap matters
    got = kernels.attend(cache, 0, q, seqs, [2, 2], softcap=2.0)
    for i, s in enumerate(seqs):
        k, v = (x.repeat_interleave(2, dim=1) for x in written[s, 0])
        w = torch.einsum("qhd,khd->hqk", q[2 * i : 2 * i + 2], k) / 8.0
        w = torch.tanh(w / 2.0) * 2.0
        pos = torch.arange(len(k) - 2, len(k))[:, None]
        keep = (torch.arange(len(k))[None] <= pos) & (torch.arange(len(k))[None] > pos - 9)
        want = torch.einsum("hqk,khd->qhd", w.masked_fill(~keep, float("-inf")).softmax(-1), v)
        torch.testing.assert_close(got[2 * i : 2 * i + 2], want, **TOL)
    assert not torch.allclose(got, kernels.attend(cache, 0, q, seqs, [2, 2]))
    with pytest.raises(ValueError, match="soft-capping"):
        kernels.attend(cache, 0, q, seqs, [2, 2], softcap=2.0, impl="triton")
    cache.close()
