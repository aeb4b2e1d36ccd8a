"""The drop-in tests' models and helpers: small random Llama (GQA, MHA) and Qwen2 models
built once each (a twin per attention implementation, the same weights), both caches by
name, left-padded random prompts, and generate with the cache under transformers' keyword."""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from vmcache.hf import PagedCache, VMCache, cache_keyword

KW = cache_keyword(LlamaForCausalLM)  # past_key_values (5.17-5.23) or cache (5.24+)

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             max_position_embeddings=1024)  # fmt: skip
MODELS = {
    "llama_gqa": (
        LlamaForCausalLM,
        LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **SMALL),
    ),  # fmt: skip
    "llama_mha": (
        LlamaForCausalLM,
        LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **SMALL),
    ),  # fmt: skip
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **SMALL),
    ),  # fmt: skip
}
CACHES = {
    "vm": lambda m, n, **kw: VMCache(config=m.config, max_cache_len=n, page_size=4096, **kw),
    "paged": lambda m, n, **kw: PagedCache(config=m.config, max_cache_len=n, **kw),
}
_models: dict = {}


def model(name, attn="sdpa"):
    if (name, attn) not in _models:
        cls, cfg = MODELS[name]
        cfg = copy.deepcopy(cfg)  # each model owns its config (attn_implementation lives there)
        torch.manual_seed(0)
        base = cls(cfg).eval()
        if attn == "sdpa":
            _models[name, attn] = base
        else:
            m = cls._from_config(copy.deepcopy(cfg), attn_implementation=attn).eval()
            m.load_state_dict(base.state_dict())
            _models[name, attn] = m
            assert base.config._attn_implementation == "sdpa"
    return _models[name, attn]


def prompts(lengths, seed=1):
    """Left-padded batch of random prompts of the given lengths: (ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(1, 128, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


def gen(m, cache=None, seed=None, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    return (
        m.generate(**{KW: cache}, pad_token_id=0, **kw)
        if cache
        else m.generate(pad_token_id=0, **kw)
    )
