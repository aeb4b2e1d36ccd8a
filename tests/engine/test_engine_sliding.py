"""The engine on sliding-window and hybrid models (Mistral, Qwen2 with use_sliding_window,
Gemma 2 with its logit soft-capping, Gemma 3 with a rotary embedding per layer type): greedy
outputs equal per-request generate() with preemption happening, and the window gives pages
back while sequences run."""

import pytest
import torch
from sliding_cases import make, pair
from transformers import DynamicCache

from vmcache import KVSpec
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.hf import cache_keyword
from vmcache.paged_fallback.cache import layers_per_table
from vmcache.sequences.invariants import check_invariants


def reference(name, twin, prompt, n):
    """transformers' greedy tokens: generate(), or for Gemma 2 a step-by-step decode through
    its own DynamicCache. (transformers 5.24's generate() on this Gemma 2 takes 125 where its
    forward over the same tokens, with or without DynamicCache, ranks 106 first by 8e-4: the
    forward is the reference the engine must equal.)"""
    ids = torch.tensor([prompt])
    if name != "gemma2":
        return twin.generate(ids, do_sample=False, max_new_tokens=n)[0, len(prompt) :].tolist()
    cache, out = DynamicCache(config=twin.config), []
    with torch.inference_mode():
        for _ in range(n):
            t = twin(ids, **{cache_keyword(twin): cache}).logits[0, -1].argmax()
            out.append(int(t))
            ids = t.view(1, 1)
    return out


LONG = [(20, 50)] * 5  # 70 tokens each, far past the 12-token window


# every family on both caches, both preemption policies on every cache
CASES = [("mistral", "vm", "swap"), ("mistral", "paged", "recompute"),
         ("qwen2", "vm", "recompute"), ("qwen2", "paged", "swap"),
         ("gemma2", "vm", "recompute"), ("gemma2", "paged", "swap"),
         ("gemma3", "vm", "swap"), ("gemma3", "paged", "swap")]  # fmt: skip
PAGES = {"vm": 3, "paged": 7}  # per table: a few sequences' windows, so preemption happens


@pytest.mark.parametrize("name,kind,policy", CASES)
def test_greedy_equals_generate_with_preemption(name, kind, policy):
    pages = PAGES[kind]
    m, twin = pair(name)
    spec = KVSpec.from_hf_config(m.config)
    per_seq = (
        2 * spec.num_layers if kind == "vm" else spec.num_layers // (layers_per_table(spec))
    )  # tables a sequence has
    g = torch.Generator().manual_seed(1)
    reqs = [Request(f"r{i}", tuple(torch.randint(0, 128, (n,), generator=g).tolist()),
                    SamplingParams(max_new_tokens=k)) for i, (n, k) in enumerate(LONG)]  # fmt: skip
    engine = Engine(m, make(kind, spec, pages * per_seq), preemption=policy, max_batch_tokens=16)
    out = engine.run(reqs)
    want = {r.req_id: [reference(name, twin, r.prompt, r.params.max_new_tokens)] for r in reqs}
    assert out == want
    st = engine.stats
    assert st.preempt_swap + st.preempt_recompute > 0  # the pool really ran out
    kv = engine.kv
    assert kv.stats().window_released_pages > 0
    check_invariants(kv)
    assert kv.stats().physical_pages == 0 and not kv.sequences
