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


# --- per-layer attention types (sliding windows) -----------------------------------------
def _cfg(cls_name, **kw):
    import transformers

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=6)  # fmt: skip
    return getattr(transformers, cls_name)(**{**base, **kw})


@pytest.mark.parametrize(
    "cls_name, kw, want",
    [
        ("LlamaConfig", {}, None),
        ("MistralConfig", {"sliding_window": 32}, (32,) * 6),  # every layer slides
        ("MistralConfig", {"sliding_window": None}, None),
        ("Qwen2Config", {}, None),  # use_sliding_window defaults to False
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 4},
         (None,) * 4 + (32,) * 2),  # layers from max_window_layers on slide
        ("Gemma2Config", {"sliding_window": 32, "head_dim": 16}, (32, None) * 3),  # alternating
        ("Gemma3TextConfig", {"sliding_window": 32, "head_dim": 16}, (32,) * 5 + (None,)),
    ],
)  # fmt: skip
def test_layer_windows_are_read_from_transformers_configs(cls_name, kw, want):
    spec = KVSpec.from_hf_config(_cfg(cls_name, **kw), torch.float32)
    assert spec.layer_windows == want
    assert spec.sliding_layers == tuple(i for i, w in enumerate(want or ()) if w)


def test_window_kv_bytes_is_the_minimum_a_windowed_cache_holds():
    # Gemma-3 style: 5 sliding layers (W = 512) per full one; 8k tokens
    spec = KVSpec(6, 2, 16, torch.float32, layer_windows=(512,) * 5 + (None,))
    per = 2 * spec.bytes_per_token_per_layer  # K and V of one token in one layer
    assert spec.window_kv_bytes(8192) == per * (5 * 512 + 8192)
    assert spec.window_kv_bytes(100) == spec.kv_bytes(100)  # inside the window: everything
    assert KVSpec(6, 2, 16).window_kv_bytes(8192) == KVSpec(6, 2, 16).kv_bytes(8192)
    with pytest.raises(ValueError, match="tuple of num_layers"):
        KVSpec(2, 2, 16, layer_windows=(8,))
    with pytest.raises(ValueError, match="window >= 1"):
        KVSpec(2, 2, 16, layer_windows=(8, 0))
