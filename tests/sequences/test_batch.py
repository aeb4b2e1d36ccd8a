"""StepBatch (vmcache/sequences/batch.py) and the batched attention (vmcache/kernels/batched.py): a
step's writes in one indexed copy land where per-sequence writes land, on every cache and
storage, copy-on-write included; a stale or wrong batch is refused with nothing changed; and
the one-call attention equals the plain reference over awkward mixes of decodes and
prefills, windows, GQA ratios and soft-capping."""

import math

import pytest
import torch
from caches import FACTORIES, INT8_TOKEN, SPEC, WINDOWED, int8_token_roundtrip, paged, vm

from vmcache import KVSpec, kernels
from vmcache.kernels import cpu_decode
from vmcache.kernels.batched import attend_batch
from vmcache.kernels.common import _softcapped, causal_lower_right
from vmcache.kernels.reference import dense_attention
from vmcache.sequences.invariants import check_invariants

FP8 = KVSpec(2, 2, 16, torch.float32, kv_dtype=torch.float8_e4m3fn, kv_scales=(1.0,) * 8)


def rand_kv(n, spec=SPEC, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def prefill_apart(cache, lens, seed=0):
    """Sequences of ``lens`` tokens written one sequence and layer at a time (the reference
    path); returns {seq: {layer: (k, v)}}."""
    written = {}
    for i, n in enumerate(lens):
        s = cache.new_sequence()
        cache.grow(s, n)
        written[s] = {}
        for layer in range(cache.spec.num_layers):
            k, v = rand_kv(n, cache.spec, seed + 10 * i + layer)
            cache.write(layer, s, 0, k, v)
            written[s][layer] = (k, v)
    return written


STORAGES = {"fp32": SPEC, "window": WINDOWED, "int8": INT8_TOKEN, "fp8": FP8}


@pytest.mark.parametrize("spec", STORAGES.values(), ids=STORAGES.keys())
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_batch_write_stores_what_per_sequence_writes_store(kind, spec):
    a, b = FACTORIES[kind](spec=spec), FACTORIES[kind](spec=spec)
    lens, q_lens = [5, 17, 1, 40], [2, 17, 1, 3]  # decodes, a whole prompt, a chunk
    for c in (a, b):
        for n in lens:
            s = c.new_sequence()
            c.grow(s, n)
    seqs = a.sequences
    batch = a.batch(seqs, q_lens)
    assert batch.starts == tuple(n - q for n, q in zip(lens, q_lens))
    for layer in range(spec.num_layers):
        k, v = rand_kv(sum(q_lens), spec, layer)
        batch.write(layer, k, v)
        at = 0
        for s, n, q in zip(seqs, lens, q_lens):
            b.write(layer, s, n - q, k[at : at + q], v[at : at + q])
            at += q
    for layer in range(spec.num_layers):
        for s, n, q in zip(seqs, lens, q_lens):
            ka, va = a.kv(layer, s)
            kb, vb = b.kv(layer, s)
            w = n - ka.shape[0]  # a window's first mapped token
            lo = max(n - q, w) - w
            assert torch.equal(ka[lo:], kb[lo:]) and torch.equal(va[lo:], vb[lo:])
    check_invariants(a)
    a.close()
    b.close()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_batch_copies_shared_pages_before_writing(kind):
    cache = FACTORIES[kind]()
    written = prefill_apart(cache, [20])
    (parent,) = written
    (child,) = cache.fork(parent)
    cache.grow(child, 1)
    before = [cache.kv(layer, parent) for layer in range(2)]
    before = [(k.clone(), v.clone()) for k, v in before]
    batch = cache.batch([child], [1])
    for layer in range(2):
        k, v = rand_kv(1, seed=99 + layer)
        batch.write(layer, k, v)
        kc, vc = cache.kv(layer, child)
        assert torch.equal(kc[-1], k[0]) and torch.equal(vc[:20], before[layer][1])
        kp, vp = cache.kv(layer, parent)
        assert torch.equal(kp, before[layer][0]) and torch.equal(vp, before[layer][1])
    assert cache.stats().cow_copies >= 1
    check_invariants(cache)
    cache.close()


def test_a_stale_or_wrong_batch_is_refused_and_changes_nothing():
    cache = vm()
    prefill_apart(cache, [8, 8])
    s0, s1 = cache.sequences
    with pytest.raises(ValueError, match="q_len"):
        cache.batch([s0], [9])  # more new tokens than the sequence holds
    with pytest.raises(ValueError, match="distinct"):
        cache.batch([s0, s0], [1, 1])
    with pytest.raises(KeyError):
        cache.batch([7], [1])
    batch = cache.batch([s0, s1], [1, 1])
    with pytest.raises(ValueError, match="tokens"):
        batch.write(0, *rand_kv(3))
    before = cache.kv(0, s0)[0].clone()
    cache.grow(s0, 1)
    assert not batch.fresh
    with pytest.raises(ValueError, match="changed"):
        batch.write(0, *rand_kv(2))
    assert torch.equal(cache.kv(0, s0)[0][:8], before)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="other sequences"):
        kernels.attend(cache, 0, q, [s1, s0], [1, 1], batch=cache.batch([s0, s1], [1, 1]))
    check_invariants(cache)
    cache.close()


def big(kind, spec=SPEC):
    return vm(spec=spec, pages=96) if kind == "vm" else paged(spec=spec, blocks=48)


def reference(q, written, seqs, q_lens, layer, window=None, softcap=None):
    out, at = [], 0
    for s, n in zip(seqs, q_lens):
        k, v = written[s][layer]
        qi = q[at : at + n]
        if softcap is None:
            out.append(dense_attention(qi, k, v, window=window))
        else:
            mask = causal_lower_right(n, k.shape[0], q.device, window)
            o = _softcapped(
                qi.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                mask,
                1 / math.sqrt(q.shape[-1]),
                softcap,
            )
            out.append(o[0].transpose(0, 1))  # fmt: skip
        at += n
    return torch.cat(out)


MIXES = {  # (lengths, new tokens each): decodes only, prefills only, mixed, lopsided
    "decodes": ([1, 7, 16, 17, 33], [1, 1, 1, 1, 1]),
    "prefills": ([9, 16, 30], [9, 5, 30]),
    "mixed": ([1, 40, 17, 3, 64], [1, 40, 1, 2, 1]),
    "lopsided": ([100, 2, 5], [100, 2, 1]),  # padding would double: one call per prefill
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("heads", [2, 4, 8])  # GQA 1, 2, 4
@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_batched_attention_equals_the_reference(kind, heads, mix):
    lens, q_lens = MIXES[mix]
    cache = big(kind)
    written = prefill_apart(cache, lens)
    seqs = list(written)
    batch = cache.batch(seqs, q_lens)
    q = torch.randn(sum(q_lens), heads, 16, generator=torch.Generator().manual_seed(3))
    for layer in range(2):
        got = kernels.attend(cache, layer, q, seqs, q_lens, batch=batch)
        want = reference(q, written, seqs, q_lens, layer)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        per_seq = kernels.attend(cache, layer, q, seqs, q_lens)  # the per-sequence path
        torch.testing.assert_close(got, per_seq, atol=2e-5, rtol=1e-4)
    # decodes only: the CPU kernel reads the rows in place (its checks planned once for both
    # layers), no SDPA plan; else one SDPA plan for both layers
    in_place = max(q_lens) == 1 and cpu_decode.available()[0]
    assert sum(1 for k in batch.memo if k[0] == "decode") == (1 if in_place else 0)
    assert sum(1 for k in batch.memo if k[0] == "attend") == (0 if in_place else 1)
    cache.close()


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_batched_attention_keeps_sliding_windows_and_soft_caps(kind):
    cache = big(kind, WINDOWED)
    lens, q_lens = [30, 5, 12, 40], [1, 5, 4, 1]
    written = {}
    for i, n in enumerate(lens):  # grown a token at a time: the window releases pages
        s = cache.new_sequence()
        written[s] = {layer: rand_kv(n, WINDOWED, 7 * i + layer) for layer in range(2)}
        for t in range(n):
            cache.grow(s, 1)
            for layer in range(2):
                k, v = written[s][layer]
                cache.write(layer, s, t, k[t : t + 1], v[t : t + 1])
    seqs = list(written)
    assert cache.views.window_start(0, seqs[3]) > 0  # its window gave pages back
    batch = cache.batch(seqs, q_lens)
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(5))
    for layer, window in ((0, 8), (1, None)):
        got = attend_batch(cache, layer, q, batch)
        torch.testing.assert_close(got, reference(q, written, seqs, q_lens, layer, window),
                                   atol=2e-5, rtol=1e-4)  # fmt: skip
        capped = kernels.attend(cache, layer, q, seqs, q_lens, softcap=5.0, batch=batch)
        want = reference(q, written, seqs, q_lens, layer, window, softcap=5.0)
        torch.testing.assert_close(capped, want, atol=2e-5, rtol=1e-4)
    cache.close()


def test_batched_attention_reads_dequantized_int8():
    cache = vm(spec=INT8_TOKEN)
    written = prefill_apart(cache, [12, 3])
    seqs = list(written)
    oracle = {s: {layer: tuple(int8_token_roundtrip(x) for x in kv) for layer, kv in d.items()}
              for s, d in written.items()}  # fmt: skip
    q = torch.randn(2, 4, 16)
    got = kernels.attend(cache, 1, q, seqs, [1, 1], batch=cache.batch(seqs, [1, 1]))
    torch.testing.assert_close(got, reference(q, oracle, seqs, [1, 1], 1), atol=1e-5, rtol=1e-4)
    cache.close()


def test_vm_reads_a_batch_in_place_where_its_pages_cover_the_span():
    """Consecutive slots whose mapped pages all reach the longest history: K/V are one view
    of the cache's rows (no copy), and rows past a shorter sequence's length (zeros, or K/V
    a truncate left behind) stay out of the attention. Anything else gathers: another
    order, a sequence whose pages end before the span, the paged cache."""
    cache = big("vm")  # 32 tokens a 4 KiB page here
    written = prefill_apart(cache, [30, 12, 25])
    a, b, c = seqs = list(written)
    junk = torch.full((18, SPEC.num_kv_heads, SPEC.head_dim), 1e4)
    cache.grow(b, 18)  # b: 12 tokens, then junk at 12..29 left behind by a truncate
    for layer in range(SPEC.num_layers):
        cache.write(layer, b, 12, junk, junk)
    cache.beams.truncate(b, 12)
    batch = cache.batch(seqs, [1, 1, 1])
    assert batch.in_place(0) == a
    k, _ = batch.kv(0)
    assert k.shape == (3, 30, SPEC.num_kv_heads, SPEC.head_dim)
    assert k.data_ptr() == cache._seq_rows(0, 0)[a].data_ptr()  # read where it lies
    assert k[1, 12:].abs().max() == 1e4  # the junk is there; the attention keeps it out
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(4))
    got = kernels.attend(cache, 0, q, seqs, [1, 1, 1], batch=batch)
    torch.testing.assert_close(got, reference(q, written, seqs, [1, 1, 1], 0),
                               atol=2e-5, rtol=1e-4)  # fmt: skip
    apart = cache.batch([c, a, b], [1, 1, 1])  # not in slot order: gathered
    assert apart.in_place(0) is None
    got2 = kernels.attend(cache, 0, q[[2, 0, 1]], [c, a, b], [1, 1, 1], batch=apart)
    torch.testing.assert_close(got2, got[[2, 0, 1]], atol=2e-5, rtol=1e-4)
    cache.grow(a, 3)  # a reaches 33 tokens, a second page; b's and c's end at 32
    for layer in range(SPEC.num_layers):
        cache.write(layer, a, 30, *rand_kv(3, SPEC, 9))
    assert cache.batch(seqs, [1, 1, 1]).in_place(0) is None
    cache.close()
    other = big("paged")
    prefill_apart(other, [5, 6])
    assert other.batch(other.sequences, [1, 1]).in_place(0) is None
    other.close()
