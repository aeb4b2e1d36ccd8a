"""The speculative-decoding tests' helpers: prompts that quote themselves (drafts can
match), an engine run that checks every page came back, and a smaller random draft Llama of
the target's vocabulary with a cache of its own."""

import copy

import torch
from caches import strict_host
from engine_cases import CFG
from transformers import LlamaForCausalLM

from vmcache import KVSpec, VMKVCache
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.sequences.invariants import check_invariants


def repeating(seed=0, n=4, new=40):
    """Prompts that quote themselves (a phrase, then again): drafts can match."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        phrase = torch.randint(0, 128, (8,), generator=g).tolist()
        reqs.append(Request(f"q{i}", tuple(phrase * 3), SamplingParams(max_new_tokens=new)))
    return reqs


def run(m, cache, reqs, **kw):
    engine = Engine(m, cache, **kw)
    out = engine.run(reqs)
    check_invariants(engine.kv)
    if engine.kv.prefix.index is not None:
        engine.kv.prefix.index.clear()  # what the index still caches: nothing else may hold pages
    assert engine.kv.stats().physical_pages == 0 and not engine.kv.sequences
    return out, engine.stats


def draft_llama(layers=1, seed=1):
    """A smaller random Llama of the target's vocabulary (its drafts are often wrong)."""
    cfg = copy.deepcopy(CFG)
    cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def draft_cache(m, pages=64):
    spec = KVSpec.from_hf_config(m.config)
    return VMKVCache(spec, 8, 128, page_size=4096, backend=strict_host(), own_backend=True,
                     pool_bytes=pages * 4096)  # fmt: skip
