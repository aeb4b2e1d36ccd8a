"""The sliding-window tests' models: tiny seeded Mistral (every layer sliding), Qwen2 with
use_sliding_window (layers from max_window_layers on), Gemma 2 (alternating) and Gemma 3
(five sliding per full), windows of W tokens; each built once with an SDPA (Gemma 2: eager)
twin of the same weights, and small caches of each kind for the engine."""

import copy

import torch
from caches import strict_host
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from vmcache import VMKVCache
from vmcache.paged_fallback import PagedKVCache

W = 12
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=W,
            max_position_embeddings=512)  # fmt: skip
FAMILIES = {
    "mistral": (MistralForCausalLM, MistralConfig(num_hidden_layers=2, **TINY)),
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1, **TINY),
    ),  # fmt: skip
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(num_hidden_layers=2, **TINY)),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(num_hidden_layers=6, **TINY)),
}


_models: dict = {}


def pair(name):
    """(model for the engine, a twin with transformers' SDPA attention for the reference)."""
    if name not in _models:
        cls, cfg = FAMILIES[name]
        torch.manual_seed(0)
        m = cls(copy.deepcopy(cfg)).eval()
        attn = "eager" if name == "gemma2" else "sdpa"  # transformers has no SDPA Gemma 2
        twin = cls._from_config(copy.deepcopy(cfg), attn_implementation=attn).eval()
        twin.load_state_dict(m.state_dict())
        for x in (m, twin):
            x.generation_config.eos_token_id = None
        _models[name] = m, twin
    return _models[name]


def make(kind, spec, pages):
    if kind == "vm":  # 4 KiB pages: 32 tokens of one layer's K (or V)
        return VMKVCache(spec, 8, 96, page_size=4096, backend=strict_host(), own_backend=True,
                         pool_bytes=pages * 4096)  # fmt: skip
    return PagedKVCache(spec, num_blocks=pages, block_size=8, max_seq_len=96, max_seqs=8)
