"""The contract between :func:`vmcache.hf.vmcache_attention` and the caches that tag their K/V
(:class:`vmcache.hf.attention.ReadsItself`): every adapter implements it, and ``generate``
runs on both drop-in caches × every ``kv_dtype`` × padded and unpadded batches × both
attention implementations, the vmcache attention giving SDPA's tokens over the same stored
K/V (a left-padded FP8 batch used to raise ``'VMCache' object has no attribute '_gather'``)."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vmcache.engine.runner import StepCache
from vmcache.hf import PagedCache, VMCache, cache_keyword
from vmcache.hf.attention import ReadsItself
from vmcache.sequences.invariants import check_invariants

KW = cache_keyword(LlamaForCausalLM)
CFG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)  # fmt: skip
CACHES = {
    "vm": lambda m, **kw: VMCache(config=m.config, max_cache_len=64, page_size=4096, **kw),
    "paged": lambda m, **kw: PagedCache(config=m.config, max_cache_len=64, **kw),
}
KV_DTYPES = {
    "compute": {},
    "fp8_e4m3": dict(kv_dtype=torch.float8_e4m3fn),
    "fp8_e5m2": dict(kv_dtype=torch.float8_e5m2),
    "int8_token": dict(kv_dtype=torch.int8, kv_granularity="token"),
}
_models: dict = {}


def model(attn):
    if attn not in _models:
        torch.manual_seed(0)
        base = LlamaForCausalLM(copy.deepcopy(CFG)).eval()
        m = LlamaForCausalLM._from_config(copy.deepcopy(CFG), attn_implementation=attn).eval()
        m.load_state_dict(base.state_dict())
        _models[attn] = m
    return _models[attn]


def batch(padded: bool):
    g = torch.Generator().manual_seed(3)
    lengths = [5, 12] if padded else [9, 9]
    ids = torch.zeros(2, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(1, 128, (n,), generator=g)
        mask[i, -n:] = 1
    return dict(input_ids=ids, attention_mask=mask)


def test_every_adapter_implements_the_contract():
    for cls in (VMCache, PagedCache, StepCache):
        for name in ("attend", "real_kv"):
            assert callable(getattr(cls, name, None)), (cls.__name__, name)
    cache = VMCache(config=CFG, max_cache_len=8)
    assert isinstance(cache, ReadsItself)
    assert isinstance(PagedCache(config=CFG, max_cache_len=8), ReadsItself)


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("storage", KV_DTYPES)
@pytest.mark.parametrize("padded", [False, True], ids=["equal", "left_padded"])
def test_generate_on_every_cache_storage_and_batch_shape(kind, storage, padded):
    inputs, out = batch(padded), {}
    for attn in ("sdpa", "vmcache"):
        cache = CACHES[kind](model(attn), **KV_DTYPES[storage])
        out[attn] = model(attn).generate(**inputs, **{KW: cache}, max_new_tokens=8,
                                         do_sample=False, pad_token_id=0)  # fmt: skip
        assert cache.get_seq_length() == out[attn].shape[1] - 1
        check_invariants(cache.kv)
    assert out["vmcache"].shape == (2, inputs["input_ids"].shape[1] + 8)
    assert torch.equal(out["vmcache"], out["sdpa"])


@pytest.mark.parametrize("kind", CACHES)
def test_real_kv_is_the_dequantized_history_in_the_models_dtype(kind):
    m = model("vmcache")
    cache = CACHES[kind](m, kv_dtype=torch.float8_e4m3fn)
    m.generate(**batch(True), **{KW: cache}, max_new_tokens=3, do_sample=False, pad_token_id=0)
    k, v = cache.real_kv(1)
    n = cache.get_seq_length()
    assert k.shape == v.shape == (2, CFG.num_key_value_heads, n, CFG.head_dim)
    assert k.dtype == torch.float32 and k.stride(-1) == 1  # real tensors, not stand-ins
    assert torch.equal(k, cache.layers[1].keys) and torch.equal(v, cache.layers[1].values)
    with pytest.raises(ValueError, match="layer"):
        cache.real_kv(CFG.num_hidden_layers)
