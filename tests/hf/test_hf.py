"""VMCache / PagedCache inside transformers' generate: token-identical to DynamicCache, memory
mapped as tokens arrive, prompts shared across beams and samples, beams reordered by remapping."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from hf_cases import CACHES, KW, gen, model, prompts
from repo import ROOT
from transformers import PretrainedConfig

from vmcache import CacheFull
from vmcache.hf import PagedCache, VMCache
from vmcache.sequences.invariants import check_invariants

MODES = {
    "greedy_1": lambda: dict(input_ids=prompts([11])[0], max_new_tokens=20, do_sample=False),
    "greedy_padded_3": lambda: dict(
        zip(("input_ids", "attention_mask"), prompts([5, 17, 9])),
        max_new_tokens=16,
        do_sample=False,
    ),  # fmt: skip
    "beam_4": lambda: dict(
        input_ids=prompts([13])[0], max_new_tokens=12, num_beams=4, do_sample=False
    ),  # fmt: skip
    "sample_3": lambda: dict(
        input_ids=prompts([10])[0],
        max_new_tokens=14,
        do_sample=True,
        num_return_sequences=3,
        seed=7,
    ),  # fmt: skip
}
CASES = [("llama_gqa", mode, c, attn) for mode in MODES for c in CACHES
         for attn in ("sdpa", "vmcache")]  # fmt: skip
CASES += [(m, mode, "vm", attn) for m in ("llama_mha", "qwen2")
          for mode in ("greedy_padded_3", "beam_4") for attn in ("sdpa", "vmcache")]  # fmt: skip


@pytest.mark.parametrize("name,mode,kind,attn", CASES)
def test_token_identical_to_dynamic_cache(name, mode, kind, attn):
    kw = MODES[mode]()
    want = gen(model(name), **kw)  # DynamicCache, SDPA
    cache = CACHES[kind](model(name, attn), 64)
    got = gen(model(name, attn), cache=cache, **kw)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == want.shape[1] - 1  # the last token is never fed back
    check_invariants(cache.kv)


@pytest.mark.parametrize("kind", CACHES)
def test_past_key_values_crop_continue_and_reset(kind):
    m = model("llama_gqa")
    ids = prompts([12])[0]
    cache = CACHES[kind](m, 128)
    if KW == "cache":  # 5.24+: the old name still works, with a deprecation warning
        with pytest.warns(FutureWarning):
            out = m.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    else:
        out = m.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    more = m.generate(out, **{KW: cache}, max_new_tokens=8, do_sample=False)  # continue
    assert torch.equal(more, gen(m, input_ids=ids, max_new_tokens=16, do_sample=False))
    # prompt-lookup decoding crops rejected drafts with negative counts every step
    want = gen(m, input_ids=ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stats().physical_pages == 0
    got = gen(m, cache, input_ids=ids, max_new_tokens=20, do_sample=False,
              prompt_lookup_num_tokens=3)  # fmt: skip
    assert torch.equal(got, want)
    check_invariants(cache.kv)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_mapped_memory_follows_tokens():
    m = model("llama_gqa")
    ids, mask = prompts([100, 60, 80])
    cache = VMCache(config=m.config, max_cache_len=1024, page_size=4096)
    gen(m, cache, input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    st, spec = cache.stats(), cache.spec
    slack = 2 * spec.num_layers * 3 * 4096  # one page per (layer, K/V, row)
    assert st.used_bytes == spec.kv_bytes(3 * 139) and st.mapped_bytes <= st.used_bytes + slack
    assert st.mapped_bytes < spec.kv_bytes(3 * 1024) / 5  # not reserved for max_cache_len


@pytest.mark.parametrize("mode", ["num_return_sequences", "num_beams"])
@pytest.mark.parametrize("kind", CACHES)
def test_prompt_stored_once_for_four_rows(kind, mode):
    m = model("llama_gqa")
    ids = prompts([300])[0]
    cache = CACHES[kind](m, 512)
    kw = dict(do_sample=True, num_return_sequences=4) if mode == "num_return_sequences" else {
        "num_beams": 4, "do_sample": False}  # fmt: skip
    gen(m, cache, seed=3, input_ids=ids, max_new_tokens=8, **kw)
    kv = cache.kv
    st = kv.stats()
    # four private copies would need 4 × the prompt's pages; the prompt's full pages are shared
    four_copies = kv.capacity.pages_for_tokens(300) * 4
    saved = 1 - st.physical_pages / four_copies
    print(f"{kind} {mode}: {st.physical_pages} physical pages vs {four_copies} for four copies "
          f"({saved:.0%} saved), {st.shared_pages} shared")  # fmt: skip
    assert st.physical_pages <= 0.5 * four_copies
    check_invariants(kv)


@pytest.mark.parametrize("kind", CACHES)
def test_beam_reorder_copies_a_fraction_of_a_gather(kind):
    m = model("llama_gqa")
    ids = prompts([200])[0]
    cache = CACHES[kind](m, 512)
    new, beams = 16, 4
    gen(m, cache, input_ids=ids, max_new_tokens=new, num_beams=beams, do_sample=False)
    kv, spec = cache.kv, cache.spec
    moved = kv.stats().cow_bytes_copied
    # DynamicCache/StaticCache gather every beam's whole K/V at each reorder
    gathered = sum(beams * spec.kv_bytes(200 + t) for t in range(new - 1))
    tails = (new - 1) * beams * kv._T * kv.config.page_bytes  # a tail page per table and beam
    print(f"{kind}: reorders moved {moved} B vs {gathered} B for a full gather "
          f"({moved / gathered:.2%})")  # fmt: skip
    if kv._copies_moves:  # VMKVCache also copies the pages a remap would only move
        assert 0 < moved < 0.25 * gathered
    else:  # the paged cache copies tails only
        assert moved <= tails and moved < 0.1 * gathered
    check_invariants(kv)


def test_bad_use_raises_clear_errors():
    m = model("llama_gqa")
    ids = prompts([5, 6, 7])[0]
    with pytest.raises(ValueError, match="max_batch_size"):
        gen(m, VMCache(config=m.config, max_cache_len=64, max_batch_size=2), input_ids=ids,
            max_new_tokens=3)  # fmt: skip
    with pytest.raises(ValueError, match="max_cache_len"):
        gen(m, VMCache(config=m.config, max_cache_len=10), input_ids=ids, max_new_tokens=8)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        VMCache(config=PretrainedConfig(), max_cache_len=64)
    with pytest.raises(ValueError, match="positive"):
        PagedCache(config=m.config, max_cache_len=0)
    cache = VMCache(config=m.config, max_cache_len=64)
    gen(m, cache, input_ids=ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="reset"):
        gen(m, cache, input_ids=ids[:2], max_new_tokens=2)


def test_no_folder_of_the_checkout_shadows_a_top_level_package():
    """Run from the repository root (``python -m ...``, ``python -c``) the root is on sys.path:
    a top-level folder there would shadow an installed package of the same name (a ``kernels/``
    folder once shadowed Hugging Face's ``kernels``, which transformers 5.25 imports). Only
    ``vmcache`` may resolve into the checkout, and transformers builds a model from there."""
    code = (
        "import importlib.util, pkgutil, sys\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,"
        " num_hidden_layers=1, num_attention_heads=2))\n"
        "mine = [m.name for m in pkgutil.iter_modules(['.'])]\n"
        "print(sorted(mine), importlib.util.find_spec('vmcache.kernels').origin)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    packages, origin = out.strip().splitlines()[-1].rsplit(" ", 1)
    assert packages == "['vmcache']", packages
    assert origin == os.path.join(os.path.realpath(ROOT), "vmcache", "kernels", "__init__.py")
    import vmcache.kernels

    assert vmcache.kernels.__name__ == "vmcache.kernels" and hasattr(vmcache.kernels, "decode")


@pytest.mark.parametrize("kind", CACHES)
def test_deepcopy_is_a_real_copy(kind):
    m = model("llama_gqa")
    ids = prompts([12])[0]
    cache = CACHES[kind](m, 128)
    out = gen(m, cache, input_ids=ids, max_new_tokens=6, do_sample=False)
    twin = copy.deepcopy(cache)
    assert twin.kv is not cache.kv and twin.get_seq_length() == cache.get_seq_length()
    for layer in range(2):
        for a, b in zip(twin.kv.kv(layer, 0), cache.kv.kv(layer, 0)):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    more = gen(m, cache, input_ids=out, max_new_tokens=5, do_sample=False)
    again = gen(m, twin, input_ids=out, max_new_tokens=5, do_sample=False)
    assert torch.equal(more, again)  # the original moved on; the copy did not share its pages
    check_invariants(twin.kv)
    check_invariants(cache.kv)


@pytest.mark.parametrize("kind", CACHES)
def test_reset_accepts_a_larger_batch_up_to_max_batch_size(kind):
    m = model("llama_gqa")
    cache = CACHES[kind](m, 64)
    gen(m, cache, input_ids=prompts([5])[0], max_new_tokens=3, do_sample=False)
    cache.reset()
    ids, mask = prompts([5, 7, 9])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(gen(m, cache, **kw), gen(m, **kw))
    capped = CACHES[kind](m, 64, max_batch_size=2)
    with pytest.raises(ValueError, match="max_batch_size"):
        gen(m, capped, **kw)


@pytest.mark.parametrize("kind", CACHES)
def test_batch_repeat_and_select_match_dynamic_cache(kind):
    """Both are remaps here (no K/V copied); DynamicCache's tensor ops are the oracle."""
    from transformers import DynamicCache

    m = model("llama_gqa")
    ids, mask = prompts([6, 9, 4])
    ours, dyn = CACHES[kind](m, 64, max_batch_size=8), DynamicCache(config=m.config)
    for c in (ours, dyn):
        gen(m, c, input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    copies = ours.stats().cow_bytes_copied
    for c in (ours, dyn):
        c.batch_repeat_interleave(2)
        c.batch_select_indices(torch.tensor([5, 0, 2, 3]))
    assert len(ours.rows) == 4 and ours.stats().cow_bytes_copied == copies
    for layer in range(2):
        for r in range(4):
            k, v = ours.kv.kv(layer, r)
            assert torch.equal(k, dyn.layers[layer].keys[r].transpose(0, 1))
            assert torch.equal(v, dyn.layers[layer].values[r].transpose(0, 1))
    check_invariants(ours.kv)
    with pytest.raises(ValueError):
        ours.batch_select_indices(torch.tensor([7]))


def test_the_vmcache_attention_path_is_taken_in_generate():
    """Unpadded steps attend straight from the cache (a silent fallback to SDPA would give
    the same tokens); padded steps go through SDPA over the views."""
    m = model("llama_gqa", "vmcache")
    cache = VMCache(config=m.config, max_cache_len=64, page_size=4096)
    calls = []
    real = cache.attend
    cache.attend = lambda layer, q, scale, cap=None: (
        calls.append(layer) or real(layer, q, scale, cap)
    )
    kw = dict(input_ids=prompts([9])[0], max_new_tokens=5, do_sample=False)
    assert torch.equal(gen(m, cache, **kw), gen(model("llama_gqa"), **kw))
    assert calls == [0, 1] * 5  # every layer of the prefill and of the 4 decode steps
    padded = VMCache(config=m.config, max_cache_len=64, page_size=4096)
    padded.attend = lambda *a: pytest.fail("a padded step must not use the kernels")
    ids, mask = prompts([5, 9])
    gen(m, padded, input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)


def test_beam_reorder_moves_no_kv_bytes_counted_where_bytes_move():
    """Count the bytes the cache physically copies and stores (its copy and store hooks),
    not its own counters: reorders copy only tail pages, and K/V are stored once per token
    (the prompt once for all beams)."""
    m = model("llama_gqa")
    cache = VMCache(config=m.config, max_cache_len=512, page_size=4096)
    ids = prompts([200])[0]
    new, beams = 16, 4
    moved, stored = [0], [0]
    orig_make = cache._make

    def make(*a):
        kv = orig_make(*a)
        real_copy, real_store, real_flat = kv._copy_page, kv._store, kv._store_flat
        kv._store_flat = lambda layer, idx, k, v: (  # a step's rows written at once
            stored.__setitem__(
                0, stored[0] + k.numel() * k.element_size() + v.numel() * v.element_size()
            )
            or real_flat(layer, idx, k, v)
        )
        kv._copy_page = lambda src, dst, used: (
            moved.__setitem__(0, moved[0] + used) or real_copy(src, dst, used)
        )
        kv._store = lambda layer, s, start, k, v: (
            stored.__setitem__(
                0, stored[0] + k.numel() * k.element_size() + v.numel() * v.element_size()
            )
            or real_store(layer, s, start, k, v)
        )
        core = kv._core  # the coordinator's own calls go through kv, its core's through core
        core.store_flat, core.copy_page, core.store = kv._store_flat, kv._copy_page, kv._store
        return kv

    cache._make = make
    gen(m, cache, input_ids=ids, max_new_tokens=new, num_beams=beams, do_sample=False)
    spec = cache.spec
    per_token = 2 * spec.bytes_per_token_per_layer * spec.num_layers
    assert stored[0] == per_token * (200 + beams * (new - 1))
    assert 0 < moved[0] <= (new - 1) * beams * cache.kv._T * cache.kv.config.page_bytes
    # a reorder copies whole tail pages (beams.assign), still a tenth of what a gather moves
    assert moved[0] < 0.1 * sum(beams * spec.kv_bytes(200 + t) for t in range(new - 1))


def test_dtype_and_token_major_layout():
    m = model("llama_gqa")
    kw = dict(input_ids=prompts([20])[0], max_new_tokens=6, do_sample=False)
    tm = VMCache(config=m.config, max_cache_len=64, page_size=4096, layout="token_major")
    assert torch.equal(gen(m, tm, **kw), gen(m, **kw))
    assert tm.kv.config.layout == "token_major"
    half = VMCache(config=m.config, max_cache_len=64, page_size=4096, dtype=torch.bfloat16)
    out = gen(m, half, **kw)
    assert out.shape == (1, 26) and half.kv.kv(0, 0)[0].dtype == torch.bfloat16
    check_invariants(half.kv)


@pytest.mark.parametrize("kind", CACHES)
def test_a_pool_that_runs_out_mid_generate_is_a_clear_error(kind):
    m = model("llama_gqa")
    small = {"pool_bytes": 8 * 4096} if kind == "vm" else {"num_blocks": 3}  # 64 / 48 tokens
    cache = CACHES[kind](m, 256, **small)
    kw = dict(input_ids=prompts([30])[0], max_new_tokens=60, min_new_tokens=60, do_sample=False)
    with pytest.raises(CacheFull):
        gen(m, cache, **kw)
    check_invariants(cache.kv)  # nothing half-done
    cache.reset()
    short = dict(input_ids=prompts([10])[0], max_new_tokens=4, do_sample=False)
    assert torch.equal(gen(m, cache, **short), gen(m, **short))  # still usable, and right
