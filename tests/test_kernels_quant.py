"""FP8 / INT8 K/V in the attention kernels: the Triton decode (dequantizing in registers, under
TRITON_INTERPRET=1 here) and the SDPA path (dequantized views) on every cache against the plain
reference over what the cache stores (quantize, then dequantize, of what the test wrote), over
awkward lengths, GQA ratios and head sizes; and the FlashAttention impls refuse FP8 K/V."""

import pytest
import torch
from test_kernels import KINDS, MIXED, WRITTEN, make
from test_kernels import fill as kernel_fill
from vmcache.kernels.reference import dense_attention

from vmcache import KVSpec, kernels
from vmcache.sequences.quant import Q_MAX, dequantize, quantize

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def quant_spec(kv_dtype, group, head_dim, layers=2, heads=2, dtype=torch.float32):
    scales = None
    if kv_dtype == torch.int8:  # calibrated: amax of a unit normal ≈ 4.5 over these sizes
        scales = tuple(4.5 / 127 * (1 + 0.1 * i) for i in range(2 * layers * heads))
    return KVSpec(layers, heads, head_dim, dtype, num_q_heads=heads * group, kv_dtype=kv_dtype,
                  kv_scales=scales)  # fmt: skip


def fill(cache, lens):
    """test_kernels' sequences of ``lens`` tokens, and the K/V each holds as stored: what
    the test wrote, quantized and dequantized by the test (its own oracle of the scale rule)."""
    seqs = kernel_fill(cache, lens)
    spec, sc = cache.spec, cache.spec.scales()
    held = {(s, layer): tuple(
                dequantize(quantize(x, sc[layer, i], spec.kv_dtype), sc[layer, i], torch.float32)
                for i, x in enumerate(WRITTEN[id(cache), s, layer]))
            for s in seqs for layer in range(spec.num_layers)}  # fmt: skip
    return seqs, held


@pytest.mark.parametrize("impl", ["triton", "sdpa"])
@pytest.mark.parametrize("kv_dtype", [*FP8, torch.int8])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 96)])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_decode_matches_the_reference(kind, group, head_dim, kv_dtype, impl):
    spec = quant_spec(kv_dtype, group, head_dim)
    cache = make(kind, spec)
    assert cache.kv_scales.shape == (2, 2, 2)
    seqs, held = fill(cache, MIXED)
    q = torch.randn(len(seqs), spec.q_heads, head_dim)
    impl = "torch" if kind == "paged" and impl == "sdpa" else impl
    out = kernels.decode(cache, 1, q, seqs, impl=impl)
    want = torch.stack([dense_attention(q[i : i + 1], *held[s, 1])[0]
                        for i, s in enumerate(seqs)])  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    cache.close()


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_prefill_and_reads_dequantize(kind):
    spec = quant_spec(torch.float8_e4m3fn, 2, 64)
    cache = make(kind, spec)
    seqs, held = fill(cache, [5, 40, 17])
    k, v = cache.kv(0, seqs[1])
    assert k.dtype == spec.dtype and torch.equal(k, held[seqs[1], 0][0])
    q_lens = [2, 7, 1]
    q = torch.randn(sum(q_lens), spec.q_heads, 64)
    out = kernels.prefill(cache, 0, q, seqs, q_lens)
    start = 0
    for s, n in zip(seqs, q_lens):
        want = dense_attention(q[start : start + n], *held[s, 0])
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-4, atol=1e-5)
        start += n
    if kind != "paged":  # the contiguous side's FlashAttention impls read no FP8 K/V
        with pytest.raises(ValueError, match="FP8/INT8"):
            kernels.prefill(cache, 0, q, seqs, q_lens, impl="aten_fa2")
        with pytest.raises(ValueError, match="FP8/INT8"):
            kernels.decode(cache, 0, q[:3], seqs, impl="aten_fa2")


def test_the_scale_rule_saturates_and_rounds():
    for dt, q_max in Q_MAX.items():
        x = torch.tensor([[[0.5, -1e9, 1e9, 3.7]]])
        y = quantize(x, torch.tensor([2.0]), dt).float()
        assert y[0, 0, 1] == -q_max and y[0, 0, 2] == q_max
        assert y[0, 0, 0] == 0.25 or dt == torch.int8
    assert quantize(torch.tensor([[[3.7]]]), torch.tensor([1.0]), torch.int8).item() == 4


def test_bad_quantized_specs_are_refused():
    with pytest.raises(ValueError, match="needs kv_scales"):
        KVSpec(2, 2, 64, kv_dtype=torch.int8)
    with pytest.raises(ValueError, match="kv_dtype"):
        KVSpec(2, 2, 64, kv_dtype=torch.int16)
    with pytest.raises(ValueError, match="quantized kv_dtype"):
        KVSpec(2, 2, 64, kv_scales=(1.0,) * 8)
    with pytest.raises(ValueError, match="8 floats"):
        KVSpec(2, 2, 64, kv_dtype=torch.float8_e4m3fn, kv_scales=(1.0,) * 7)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="finite"):
            KVSpec(2, 2, 64, kv_dtype=torch.float8_e4m3fn, kv_scales=(bad,) + (1.0,) * 7)
    spec = KVSpec.preset("llama-3-8b", kv_dtype=torch.float8_e4m3fn)
    assert spec.bytes_per_token * 2 == KVSpec.preset("llama-3-8b").bytes_per_token
    assert spec.quantized and spec.storage_dtype == torch.float8_e4m3fn
