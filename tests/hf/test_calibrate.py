"""calibrate_kv_scales: each head's scale from the model's own K/V, by the rule its defaults
state (INT8: the 99.9th percentile / 127; FP8: only shrink what would overflow), checked against K/V
taken independently from a DynamicCache forward; bad arguments refused."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from vmcache.hf import cache_keyword, calibrate_kv_scales

CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.fixture(scope="module")
def model_ids():
    torch.manual_seed(0)
    m = LlamaForCausalLM(CFG).eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=ids, **{cache_keyword(m): cache}, use_cache=True)
    kvs = [
        x.abs().transpose(0, 1).flatten(1)
        for layer in cache.layers
        for x in (layer.keys, layer.values)
    ]  # fmt: skip  [N_KV, b·T·d_h] each
    amax = torch.cat([x.amax(1) for x in kvs])
    k = round(0.999 * kvs[0].shape[1])
    p999 = torch.cat([x.sort(1).values[:, k - 1] for x in kvs])  # the k-th smallest
    return m, ids, amax, p999


def test_int8_default_is_the_99_9th_percentile(model_ids):
    m, ids, amax, p999 = model_ids
    got = torch.tensor(calibrate_kv_scales(m, ids, torch.int8))
    assert torch.allclose(got, p999 / 127)
    assert (got <= amax / 127).all() and (got < amax / 127).any()
    one = torch.tensor(calibrate_kv_scales(m, ids, torch.int8, percentile=100))
    assert torch.allclose(one, amax / 127)
    wide = torch.tensor(calibrate_kv_scales(m, ids, torch.int8, percentile=100, margin=1.25))
    assert torch.allclose(wide, amax * 1.25 / 127)
    p = torch.tensor(calibrate_kv_scales(m, ids, torch.int8, percentile=50))
    assert (p < got).all()  # a median is below the 99.9th percentile


def test_fp8_default_only_shrinks_what_would_overflow(model_ids):
    m, ids, amax, _ = model_ids
    e4 = torch.float8_e4m3fn
    assert set(calibrate_kv_scales(m, ids, e4)) == {1.0}  # activations far below 448
    fitted = torch.tensor(calibrate_kv_scales(m, ids, e4, range_fit=True))
    assert torch.allclose(fitted, amax / 448)
    # a margin that would overflow 448 shrinks: scale = amax * margin / 448 where above 1
    big = 1000.0 * 448 / float(amax.min())
    over = torch.tensor(calibrate_kv_scales(m, ids, e4, margin=big))
    assert torch.allclose(over, (amax * big / 448).clamp(min=1.0)) and (over > 1).all()


def test_bad_arguments_are_refused(model_ids):
    m, ids, _, _ = model_ids
    for kw in ({"margin": 0}, {"margin": float("inf")}, {"margin": True},
               {"percentile": 0}, {"percentile": 101}, {"percentile": True}):  # fmt: skip
        with pytest.raises(ValueError):
            calibrate_kv_scales(m, ids, torch.int8, **kw)
    with pytest.raises(ValueError, match="kv_dtype"):
        calibrate_kv_scales(m, ids, torch.float16)
