"""FP8 / INT8 K/V in the attention kernels: the Triton decode and prefill (dequantizing in
registers, under TRITON_INTERPRET=1 here) and the SDPA path (dequantized views) on every cache,
with head and per-token scales, against the plain reference over what the cache stores
(quantize, then dequantize, of what the test wrote by its own scale rule), over awkward lengths,
GQA ratios and head sizes; and the FlashAttention impls refuse FP8 K/V."""

import pytest
import torch
from kernel_cases import KINDS, MIXED, WRITTEN, make
from kernel_cases import fill as kernel_fill

from vmcache import KVSpec, kernels
from vmcache.kernels.reference import dense_attention
from vmcache.sequences.quant import (
    Q_MAX,
    decode_rows,
    dequantize,
    encode_rows,
    quantize,
    split_rows,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# the interpreter copies a cache's whole storage and multiplies masked lanes too: the fp32
# scale views then read int8/FP8 bytes past a sequence's length as NaNs (discarded lanes)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def quant_spec(kv_dtype, group, head_dim, layers=2, heads=2, dtype=torch.float32,
               granularity="head"):  # fmt: skip
    scales = None
    if kv_dtype == torch.int8 and granularity == "head":  # calibrated: amax of a unit normal
        scales = tuple(4.5 / 127 * (1 + 0.1 * i) for i in range(2 * layers * heads))  # ≈ 4.5
    return KVSpec(layers, heads, head_dim, dtype, num_q_heads=heads * group, kv_dtype=kv_dtype,
                  kv_scales=scales, kv_granularity=granularity)  # fmt: skip


def fill(cache, lens):
    """test_kernels' sequences of ``lens`` tokens, and the K/V each holds as stored: what
    the test wrote, quantized and dequantized by the test (its own oracle of the scale rule:
    the spec's head scales, or amax / q_max of each token and head)."""
    seqs = kernel_fill(cache, lens)
    spec = cache.spec
    dt = spec.kv_dtype

    def held_of(x, layer, i):
        if spec.kv_granularity == "token":
            sc = x.abs().amax(-1) / Q_MAX[dt]
        else:
            sc = spec.scales()[layer, i]
        return dequantize(quantize(x, sc, dt), sc, torch.float32)

    held = {(s, layer): tuple(held_of(x, layer, i)
                              for i, x in enumerate(WRITTEN[id(cache), s, layer]))
            for s in seqs for layer in range(spec.num_layers)}  # fmt: skip
    return seqs, held


@pytest.mark.parametrize("impl", ["triton", "sdpa"])
@pytest.mark.parametrize("kv_dtype,granularity", [(FP8[0], "head"), (FP8[1], "head"),
                                                  (torch.int8, "head"), (FP8[0], "token"),
                                                  (torch.int8, "token")])  # fmt: skip
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 96)])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_decode_matches_the_reference(kind, group, head_dim, kv_dtype, granularity,
                                                impl):  # fmt: skip
    spec = quant_spec(kv_dtype, group, head_dim, granularity=granularity)
    cache = make(kind, spec)
    if granularity == "head":
        assert cache._kv_scales.shape == (2, 2, 2)
    else:  # the scales are views into each token's row, where the kernel reads them
        ks, vs = cache.views.kv_scales_for(1)
        assert cache._kv_scales is None and ks.dtype == torch.float32 and ks.shape[-1] == 2
    seqs, held = fill(cache, MIXED)
    q = torch.randn(len(seqs), spec.q_heads, head_dim)
    out = kernels.decode(cache, 1, q, seqs, impl=impl)
    want = torch.stack([dense_attention(q[i : i + 1], *held[s, 1])[0]
                        for i, s in enumerate(seqs)])  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    cache.close()


@pytest.mark.parametrize(
    "kv_dtype,granularity",
    [(FP8[0], "head"), (torch.int8, "head"), (FP8[0], "token"), (torch.int8, "token")],
)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_prefill_and_reads_dequantize(kind, kv_dtype, granularity):
    spec = quant_spec(kv_dtype, 2, 64, granularity=granularity)
    cache = make(kind, spec)
    seqs, held = fill(cache, [5, 40, 17])
    k, v = cache.kv(0, seqs[1])
    assert k.dtype == spec.dtype and torch.equal(k, held[seqs[1], 0][0])
    q_lens = [2, 7, 1]
    q = torch.randn(sum(q_lens), spec.q_heads, 64)
    for impl in ("triton", "sdpa"):
        out = kernels.prefill(cache, 0, q, seqs, q_lens, impl=impl)
        start = 0
        for s, n in zip(seqs, q_lens):
            want = dense_attention(q[start : start + n], *held[s, 0])
            torch.testing.assert_close(out[start : start + n], want, rtol=1e-4, atol=1e-5,
                                       msg=impl)  # fmt: skip
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
    with pytest.raises(ValueError, match="kv_granularity must be one of"):
        KVSpec(2, 2, 64, kv_dtype=torch.int8, kv_granularity="channel")
    with pytest.raises(ValueError, match="needs a quantized kv_dtype"):
        KVSpec(2, 2, 64, kv_granularity="token")
    with pytest.raises(ValueError, match="kv_scales must be None"):
        KVSpec(2, 2, 64, kv_dtype=torch.int8, kv_scales=(1.0,) * 8, kv_granularity="token")
    # per token: the row carries 8 fp32 scales (32 bytes, already 16-aligned) after 8 heads
    tok = KVSpec.preset("llama-3-8b", kv_dtype=torch.int8, kv_granularity="token")
    assert tok.bytes_per_token_per_layer == 8 * 128 + 32 and tok.row_elems == 1056
    assert tok.bytes_per_token == 2 * 32 * 1056  # 67,584: 1.94× fewer bytes than BF16's
    mqa = KVSpec(2, 1, 64, kv_dtype=torch.int8, kv_granularity="token")
    assert mqa.scale_bytes_per_token_per_layer == 16  # 4 bytes padded to 16


def test_token_scales_follow_each_token_and_zero_heads_stay_zero():
    spec = KVSpec(1, 2, 4, torch.float32, kv_dtype=torch.int8, kv_granularity="token")
    x = torch.tensor([[[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]],
                      [[100.0, 50.0, -25.0, 1.0], [1e-3, 0.0, 0.0, 0.0]]])  # fmt: skip
    rows = encode_rows(x, None, torch.int8, spec.row_elems)
    data, scale = split_rows(rows, 2, 4)
    assert rows.shape == (2, 8 + 16) and scale.shape == (2, 2)
    assert scale[0, 0] == 2.0 / 127 and scale[1, 0] == 100.0 / 127  # amax / q_max per token
    assert data[0, 0].tolist() == [64, -127, 32, 0] and data[1, 0, 0] == 127
    y = decode_rows(rows, None, 2, 4, torch.float32)
    assert torch.equal(y[:, 1][0], torch.zeros(4))  # an all-zero head decodes to zeros
    torch.testing.assert_close(y, x, atol=100.0 / 127 / 2, rtol=0)  # half a step at most
    assert (y - x).abs()[0].max() <= 2.0 / 127 / 2  # the small token keeps its own precision
