"""Memory of a sliding-window model at 8k tokens: what a sequence maps stays within one page
per sliding table of the minimum (full layers × length + sliding layers × W), on both caches
and both layouts, while the same sequence without windows maps every token."""

import pytest
import torch

from vmcache import KVSpec, VMKVCache
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

W, LENGTH = 512, 8192
# Gemma-3-style: five sliding layers per full one; 64 B token rows (64 tokens a 4 KiB page)
GEMMA3 = KVSpec(6, 1, 16, torch.float32, layer_windows=(W,) * 5 + (None,))
FULL = KVSpec(6, 1, 16, torch.float32)


def make(kind, spec):
    if kind == "paged":
        return PagedKVCache(spec, num_blocks=6 * LENGTH // 16 + 8, block_size=16,
                            max_seq_len=LENGTH, max_seqs=1)  # fmt: skip
    layout = "token_major" if kind == "vm_token_major" else "layer_major"
    return VMKVCache(spec, 1, LENGTH, page_size=4096, layout=layout)


def minimum_pages(cache, length):
    """Pages of whole-token minimum per table: ⌈L·u/P⌉ (full) or ⌈min(L, W)·u/P⌉ (sliding)."""
    return sum(len(g.ids) * g.pages_for(length if g.window is None else min(length, g.window))
               for g in cache._groups)  # fmt: skip


@pytest.mark.parametrize("kind", ["vm", "vm_token_major", "paged"])
def test_pages_held_at_8k_tokens_are_within_one_page_per_sliding_table_of_the_minimum(kind):
    cache = make(kind, GEMMA3)
    s = cache.new_sequence()
    cache.grow(s, 100)  # a prompt, then decode steps
    sliding_tables = sum(len(g.ids) for g in cache._groups if g.sliding)
    worst = 0
    while cache.seq_len(s) < LENGTH:
        cache.grow(s, 1)
        n = cache.seq_len(s)
        over = cache.capacity.mapped_pages(s) - minimum_pages(cache, n)
        assert 0 <= over <= sliding_tables, (n, over)
        worst = max(worst, over)
    st = cache.stats()
    assert st.window_released_pages > 0 and st.physical_pages == cache.capacity.mapped_pages(s)
    # the bytes: within one page per sliding table of window_kv_bytes, far below full attention
    assert GEMMA3.window_kv_bytes(LENGTH) <= st.physical_bytes
    assert st.physical_bytes <= GEMMA3.window_kv_bytes(LENGTH) + sliding_tables * st.page_bytes
    assert st.physical_bytes < GEMMA3.kv_bytes(LENGTH) / 4
    full = make(kind, FULL)
    t = full.new_sequence()
    full.grow(t, LENGTH)
    assert full.stats().physical_bytes == FULL.kv_bytes(LENGTH)  # no window: every token
    cache.close()
    full.close()


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_prefix_caching_is_refused_for_sliding_window_models(kind):
    with pytest.raises(ValueError, match="prefix caching is not supported"):
        if kind == "paged":
            PagedKVCache(GEMMA3, num_blocks=64, max_seq_len=1024, max_seqs=2,
                         prefix_caching=True)  # fmt: skip
        else:
            VMKVCache(GEMMA3, 2, 1024, page_size=4096, prefix_caching=True)


def test_can_grow_counts_the_pages_the_window_gives_back():
    """A pool with no free page: the grow that crosses into a new page still succeeds when
    the window releases a page first, and can_grow says so (a scheduler can trust it)."""
    spec = KVSpec(1, 1, 16, torch.float32, layer_windows=(64,))  # 64 tokens = one 4 KiB page
    cache = VMKVCache(spec, 1, 1024, page_size=4096, pool_bytes=4 * 4096)
    s = cache.new_sequence()
    cache.grow(s, 128)  # two pages per table (K and V): the pool is full
    assert cache._pool.num_free == 0 and not cache._pool.can_allocate(2)
    assert cache.can_grow(s, 1)  # page 0 of each table leaves the window first
    cache.grow(s, 1)
    assert cache.views.window_start(0, s) == 64 and cache.stats().window_released_pages == 2
    check_invariants(cache)
    cache.close()
