"""Compute mode: the engine runs a real (small, randomly initialised) Llama model over
VMKVCache and PagedKVCache on the same scaled-down trace, at several KV budgets: tokens/s,
step time, map time per step, preemptions. Host backend on the CPU, CUDA backend on a GPU."""

from __future__ import annotations

import torch

from ..cache import VMKVCache
from ..engine import Engine, Request, SamplingParams
from ..paged_fallback import PagedKVCache
from ..spec import KVSpec


def small_model(device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    big = device.type == "cuda"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024 if big else 256,
                      intermediate_size=2816 if big else 688, num_hidden_layers=8 if big else 4,
                      num_attention_heads=16 if big else 8, num_key_value_heads=4 if big else 2,
                      max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if big else torch.float32
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def requests(num: int, seed: int = 0) -> list[Request]:
    """The enterprise shape scaled down 10×: prompts U[50, 100], completions ~20."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        p = int(torch.randint(50, 101, (1,), generator=g))
        o = int(torch.randint(12, 29, (1,), generator=g))
        ids = torch.randint(0, 32000, (p,), generator=g).tolist()
        out.append(Request(f"r{i}", tuple(ids), SamplingParams(max_new_tokens=o)))
    return out


def shared_requests(num: int, system_len: int = 192, seed: int = 1) -> list[Request]:
    """A system prompt every request starts with, then U[16, 48] tokens of its own."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 32000, (system_len,), generator=g).tolist()
    out = []
    for i in range(num):
        own = torch.randint(0, 32000, (int(torch.randint(16, 49, (1,), generator=g)),),
                            generator=g).tolist()  # fmt: skip
        out.append(Request(f"s{i}", tuple(system + own), SamplingParams(max_new_tokens=16)))
    return out


def make_cache(kind: str, spec: KVSpec, budget: int, device: torch.device, max_seqs: int,
               prefix: bool = False):  # fmt: skip
    if kind == "vmcache":
        page = None if device.type == "cuda" else 4096  # the driver granularity; OS pages
        return VMKVCache(spec, max_seqs, 512, device, page_size=page, pool_bytes=budget,
                         prefix_caching=prefix)  # fmt: skip
    return PagedKVCache(spec, pool_bytes=budget, block_size=16, device=device, max_seq_len=512,
                        max_seqs=max_seqs, prefix_caching=prefix)  # fmt: skip


def run(device: torch.device, num_requests: int, budgets_tokens: list[int], progress=None):
    model = small_model(device)
    model.generation_config.eos_token_id = None
    spec = KVSpec.from_hf_config(model.config, next(model.parameters()).dtype)
    reqs = requests(num_requests)
    rows = []
    for budget_tokens in budgets_tokens:
        budget = budget_tokens * spec.bytes_per_token
        for kind in ("vmcache", "paged"):
            engine = Engine(model, make_cache(kind, spec, budget, device, 64), preemption="swap")
            engine.run(reqs[:2])  # warm up (first-call costs)
            engine = Engine(model, make_cache(kind, spec, budget, device, 64), preemption="swap")
            engine.run(reqs)
            d = engine.stats.as_dict()
            keys = ("tok_per_s", "step_ms", "map_ms_per_step", "premap_ms_per_step", "steps",
                    "max_running", "preempt_swap", "swap_bytes")  # fmt: skip
            rows.append({"cache": kind, "budget_tokens": budget_tokens, **{k: d[k] for k in keys}})
            if progress is not None:
                progress(len(rows), 2 * len(budgets_tokens))
    return rows


def run_prefix(device: torch.device, num_requests: int, budget_tokens: int, progress=None):
    """The radix rows in compute mode: the same shared-prompt requests with and without
    prefix caching, on both caches: prompt tokens computed, tokens/s."""
    model = small_model(device)
    model.generation_config.eos_token_id = None
    spec = KVSpec.from_hf_config(model.config, next(model.parameters()).dtype)
    reqs = shared_requests(num_requests)
    rows = []
    for kind in ("vmcache", "paged"):
        for prefix in (False, True):
            kv = make_cache(kind, spec, budget_tokens * spec.bytes_per_token, device, 64, prefix)
            engine = Engine(model, kv)
            out = engine.run(reqs)
            d = engine.stats.as_dict()
            rows.append({"cache": kind, "prefix_caching": prefix, "requests": len(out), **{
                k: d[k] for k in ("prefill_tokens", "prefix_hit_tokens", "tok_per_s",
                                  "elapsed_s", "max_running")}})  # fmt: skip
            if progress is not None:
                progress(len(rows), 4)
    return rows
