"""The engine on sliding-window and hybrid models (Mistral, Qwen2 with use_sliding_window,
Gemma 3): greedy outputs equal per-request generate() with preemption happening, and the
window gives pages back while sequences run. Gemma 2's attention soft-capping is refused."""

import copy

import pytest
import torch
from caches import strict_host
from test_hf_sliding import FAMILIES
from vmcache.paged_fallback import PagedKVCache

from vmcache import KVSpec, VMKVCache
from vmcache.engine import Engine, Request, SamplingParams

_models: dict = {}


def pair(name):
    """(model for the engine, a twin with transformers' SDPA attention for the reference)."""
    if name not in _models:
        cls, cfg = FAMILIES[name]
        torch.manual_seed(0)
        m = cls(copy.deepcopy(cfg)).eval()
        twin = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
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


LONG = [(20, 50)] * 5  # 70 tokens each, far past the 12-token window


# every family on both caches, both preemption policies on every cache
CASES = [("mistral", "vm", "swap"), ("mistral", "paged", "recompute"),
         ("qwen2", "vm", "recompute"), ("qwen2", "paged", "swap"),
         ("gemma3", "vm", "swap"), ("gemma3", "paged", "swap")]  # fmt: skip
PAGES = {"vm": 3, "paged": 7}  # per table: a few sequences' windows, so preemption happens


@pytest.mark.parametrize("name,kind,policy", CASES)
def test_greedy_equals_generate_with_preemption(name, kind, policy):
    pages = PAGES[kind]
    m, twin = pair(name)
    spec = KVSpec.from_hf_config(m.config)
    per_seq = (
        2 * spec.num_layers
        if kind == "vm"
        else spec.num_layers // (PagedKVCache.layers_per_table(spec))
    )  # tables a sequence has
    g = torch.Generator().manual_seed(1)
    reqs = [Request(f"r{i}", tuple(torch.randint(0, 128, (n,), generator=g).tolist()),
                    SamplingParams(max_new_tokens=k)) for i, (n, k) in enumerate(LONG)]  # fmt: skip
    engine = Engine(m, make(kind, spec, pages * per_seq), preemption=policy, max_batch_tokens=16)
    out = engine.run(reqs)
    want = {r.req_id: [twin.generate(torch.tensor([r.prompt]), do_sample=False,
                                     max_new_tokens=r.params.max_new_tokens)[0, 20:].tolist()]
            for r in reqs}  # fmt: skip
    assert out == want
    st = engine.stats
    assert st.preempt_swap + st.preempt_recompute > 0  # the pool really ran out
    kv = engine.kv
    assert kv.stats().window_released_pages > 0
    kv.check_invariants()
    assert kv.stats().physical_pages == 0 and not kv.sequences


def test_gemma2_soft_capping_is_refused_with_a_clear_error():
    cls, cfg = FAMILIES["gemma2"]
    m = cls(copy.deepcopy(cfg)).eval()
    with pytest.raises(ValueError, match="soft-capping"):
        Engine(m, make("paged", KVSpec.from_hf_config(m.config), 64))
