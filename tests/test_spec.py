import pytest
import torch
from transformers import LlamaConfig

from vmcache import KVSpec


@pytest.mark.parametrize(
    "name,bpt", [("llama-3-8b", 131_072), ("llama-3-70b", 327_680), ("llama-2-70b", 2_621_440)]
)
def test_presets_match_design_arithmetic(name, bpt):
    assert KVSpec.preset(name).bytes_per_token == bpt


def test_derived_properties():
    s = KVSpec.preset("llama-3-8b")
    assert s.bytes_per_token_per_layer == 8 * 128 * 2
    assert s.kv_bytes(500) == 500 * 131_072
    assert s.block_bytes(16) == 65_536
    assert s.block_bytes(16, per_layer=False) == 16 * 131_072
    assert s.gqa_group == 4


def test_from_hf_config_gqa_mha_and_explicit_head_dim():
    gqa = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      num_hidden_layers=3)  # fmt: skip
    s = KVSpec.from_hf_config(gqa, dtype=torch.float16)
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.q_heads) == (3, 2, 32, 8)
    mha = LlamaConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=2)
    del mha.num_key_value_heads
    assert KVSpec.from_hf_config(mha).num_kv_heads == 4
    explicit = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                           head_dim=96, num_hidden_layers=2)  # fmt: skip
    assert KVSpec.from_hf_config(explicit).head_dim == 96


def test_from_hf_config_rejects_unreadable_config():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVSpec.from_hf_config(object())


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_layers=0, num_kv_heads=1, head_dim=8), "num_layers"),
        (dict(num_layers=1, num_kv_heads=-2, head_dim=8), "num_kv_heads"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=0), "head_dim"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.int32), "dtype"),
        (dict(num_layers=1, num_kv_heads=2, head_dim=8, num_q_heads=3), "num_q_heads"),
        (dict(num_layers=1.5, num_kv_heads=1, head_dim=8), "num_layers"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVSpec(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown KVSpec preset"):
        KVSpec.preset("gpt-5")


def test_frozen():
    s = KVSpec.preset("llama-3-8b")
    with pytest.raises(AttributeError):
        s.num_layers = 3
