"""transformers parity of the drop-in's layers: ``cache.layers[i].keys`` / ``.values`` hold
what transformers' own layers hold after a forward (``[batch, heads, length, head_dim]``;
DynamicCache as the reference), views of the cache on VMCache (no copy), the real K/V on
PagedCache under either attention; ``None`` before the first update and after reset; they
follow crop; they cannot be assigned."""

import pytest
import torch
from hf_cases import CACHES, KW, model, prompts
from transformers import DynamicCache


def forward(m, cache, ids, mask=None):
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=mask, **{KW: cache}, use_cache=True)


def same_layers(ours, ref):
    assert len(ours.layers) == len(ref.layers)
    for a, b in zip(ours.layers, ref.layers):
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "vmcache"])
@pytest.mark.parametrize("kind", sorted(CACHES))
def test_layer_keys_and_values_match_dynamic_cache(kind, attn):
    m = model("llama_gqa", attn)
    ours, ref = CACHES[kind](m, 64), DynamicCache(config=m.config)
    assert all(layer.keys is None and layer.values is None for layer in ours.layers)
    ids = prompts([9, 9])[0]
    forward(m, ours, ids)
    forward(model("llama_gqa"), ref, ids)
    same_layers(ours, ref)
    assert all(layer.batch_size == 2 for layer in ours.layers)
    if kind == "vm":  # views of the cache's own storage, not copies
        k = ours.layers[1].keys
        row = ours.kv.views.k_cache(1)[ours.rows[0]]
        assert k.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()
    step = torch.tensor([[5], [7]])
    forward(m, ours, step)
    forward(model("llama_gqa"), ref, step)
    same_layers(ours, ref)
    assert ours.layers[0].keys.shape[2] == 10
    ours.crop(-3)
    ref.crop(-3)
    same_layers(ours, ref)
    with pytest.raises(AttributeError, match="views"):
        ours.layers[0].keys = torch.zeros(1)
    ours.reset()
    assert ours.layers[0].keys is None and ours.layers[0].values is None
