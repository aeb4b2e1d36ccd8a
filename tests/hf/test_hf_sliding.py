"""Sliding-window and hybrid models in the drop-in: token-identical to transformers' own cache
(whose sliding layers keep W − 1 tokens), with the pages that left the window given back.

Families (seeded tiny random models): Mistral (every layer sliding), Qwen2 with
``use_sliding_window`` (layers from ``max_window_layers`` on), Gemma 2 (alternating), Gemma 3
(five sliding per full). Windows of 12 tokens and sequences of ~70, so every run crosses
several page and window boundaries (VMCache: 32 tokens per 4 KiB page at fp32; PagedCache:
blocks of 4 tokens)."""

import copy

import pytest
import torch
from sliding_cases import FAMILIES, W

from vmcache.hf import PagedCache, VMCache, cache_keyword
from vmcache.sequences.invariants import check_invariants
from vmcache.sequences.spec import KVSpec

CACHES = {
    "vm": lambda m, n, **kw: VMCache(config=m.config, max_cache_len=n, page_size=4096, **kw),
    "vm_token_major": lambda m, n, **kw: VMCache(
        config=m.config, max_cache_len=n, page_size=4096, layout="token_major", **kw
    ),
    "paged": lambda m, n, **kw: PagedCache(config=m.config, max_cache_len=n, block_size=4, **kw),
}
_models: dict = {}


def family(name):
    if name not in _models:
        cls, cfg = FAMILIES[name]
        torch.manual_seed(0)
        _models[name] = cls(copy.deepcopy(cfg)).eval()
    return _models[name]


def test_the_families_read_as_intended():
    windows = {n: KVSpec.from_hf_config(c).layer_windows for n, (_, c) in FAMILIES.items()}
    assert windows == {"mistral": (W, W), "qwen2": (None, W, W), "gemma2": (W, None),
                       "gemma3": (W,) * 5 + (None,)}  # fmt: skip


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_and_beam_are_token_identical_and_the_window_gives_pages_back(name, kind):
    m = family(name)
    kw = {"cache" if cache_keyword(m) == "cache" else "past_key_values": None}
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 21))
    for gen in (
        dict(max_new_tokens=48, min_new_tokens=48, do_sample=False),
        dict(
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
            num_beams=3,
            num_return_sequences=2,
        ),
    ):
        want = m.generate(ids, **gen)
        cache = CACHES[kind](m, 80)
        kw[next(iter(kw))] = cache
        got = m.generate(ids, **gen, **kw)
        assert torch.equal(got, want), (name, kind, gen)
        st = cache.stats()
        assert st.window_released_pages > 0  # the sliding layers gave pages back
        check_invariants(cache.kv)
        n = cache.kv.seq_len(cache.rows[0])
        spec = cache.kv.spec
        # live K/V held per row: the full layers' whole length, the sliding ones ~ their window
        held = st.used_bytes / len(cache.rows)
        assert held < spec.kv_bytes(n)
        assert held <= spec.window_kv_bytes(n) + _slack(cache)


def _slack(cache) -> int:
    """Bytes a row may hold past the minimum: per sliding table, the page the window starts
    in (the part of it before the window) plus the page-granular release."""
    kv = cache.kv
    return sum(len(g.ids) * 2 * kv.config.page_bytes for g in kv._groups if g.sliding)


@pytest.mark.parametrize("kind", CACHES)
def test_crop_within_the_rollback_margin_and_a_clear_error_past_it(kind):
    m = family("mistral")
    key = "cache" if cache_keyword(m) == "cache" else "past_key_values"
    ids = torch.randint(0, 128, (1, 60))
    strict = CACHES[kind](m, 80)
    m(ids, **{key: strict})
    m(ids[:, :1], **{key: strict})  # the grow that releases what the window left
    assert strict.stats().window_released_pages > 0
    with pytest.raises(ValueError, match="rollback_tokens"):
        strict.crop(-40)
    assert strict.get_seq_length() == 61  # nothing changed
    roomy = CACHES[kind](m, 80, rollback_tokens=8)
    m(ids, **{key: roomy})
    m(ids[:, :1], **{key: roomy})
    roomy.crop(-8)  # speculative decoding's rejected drafts
    assert roomy.get_seq_length() == 53
    check_invariants(roomy.kv)
    # decoding on from the cropped cache equals a forward over the same 53 tokens + one
    base = torch.cat([ids, ids[:, :1]], 1)[:, :53]
    nxt = torch.tensor([[7]])
    got = m(nxt, **{key: roomy}).logits[:, -1]
    want = m(torch.cat([base, nxt], 1)).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind", ["vm", "paged"])
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_attn_vmcache_on_sliding_models_equals_transformers(name, kind):
    """attn "vmcache": full layers read the cache through vmcache.kernels; a sliding layer's
    step with a window mask attends through SDPA over the window's views (PagedCache:
    gathered from the window start), never over released pages. Gemma 2 soft-caps its
    logits: the kernels' torch path, and its own eager function for masked steps."""
    base = family(name)
    cls, cfg = FAMILIES[name]
    m = cls._from_config(copy.deepcopy(cfg), attn_implementation="vmcache").eval()
    m.load_state_dict(base.state_dict())
    key = "cache" if cache_keyword(m) == "cache" else "past_key_values"
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (2, 21))
    gen = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    want = base.generate(ids, **gen)
    cache = CACHES[kind](m, 80)
    assert torch.equal(m.generate(ids, **gen, **{key: cache}), want)
    assert cache.stats().window_released_pages > 0
