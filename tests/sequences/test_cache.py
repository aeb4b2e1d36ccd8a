import pytest
import torch

from vmcache import CacheFull, KVSpec, VMKVCache
from vmcache.memory.backends.host import process_map_count
from vmcache.sequences.invariants import check_invariants


def rand_kv(spec, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec.num_kv_heads, spec.head_dim)
    return (
        torch.randn(shape, generator=g).to(spec.dtype),
        torch.randn(shape, generator=g).to(spec.dtype),
    )


def fill(cache, s, n, seed=0):
    """Grow ``s`` by n tokens and write random K/V into every layer; returns what was written."""
    start = cache.seq_len(s)
    cache.grow(s, n)
    out = []
    for layer in range(cache.spec.num_layers):
        k, v = rand_kv(cache.spec, n, seed * 1000 + layer)
        cache.write(layer, s, start, k, v)
        out.append((k, v))
    return out


def snapshot(cache):
    content = {
        s: [tuple(t.clone() for t in cache.kv(layer, s)) for layer in range(cache.spec.num_layers)]
        for s in cache.sequences
    }
    return cache.stats(), {s: cache.views.page_table(s) for s in cache.sequences}, content


def assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    for s in a[2]:
        for (k1, v1), (k2, v2) in zip(a[2][s], b[2][s]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


LLAMA8B_2L = KVSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_fork_shares_prompt_and_splits_only_tail(make_cache, layout):
    """The issue's acceptance case: Llama-3-8B shape, 2 layers, 64 KiB pages."""
    c = make_cache(LLAMA8B_2L, max_seqs=5, max_seq_len=2048, page_size=65536, layout=layout)
    s = c.new_sequence()
    prompt = fill(c, s, 1000)
    prompt_pages = c.stats().physical_pages
    per_tensor = -(-1000 * c._token_row_bytes // 65536)
    assert prompt_pages == c._T * per_tensor
    children = c.fork(s, 4)
    st = c.stats()
    assert st.physical_pages == prompt_pages  # held once
    assert st.shared_pages == prompt_pages
    for i, ch in enumerate(children):
        c.grow(ch, 1)
        for layer in range(2):
            tok = torch.full((1, 8, 128), float(i + 1), dtype=torch.bfloat16)
            c.write(layer, ch, 1000, tok, -tok)
    st = c.stats()
    assert st.physical_pages <= prompt_pages + 4 * c._T  # at most 4 splits per K/V tensor
    assert st.cow_saving > 0.5
    for i, ch in enumerate(children):
        for layer in range(2):
            k, v = c.kv(layer, ch)
            assert torch.equal(k[:1000], prompt[layer][0]) and torch.equal(
                v[:1000], prompt[layer][1]
            )
            assert (k[1000] == i + 1).all() and (v[1000] == -(i + 1)).all()
    assert c.seq_len(s) == 1000
    check_invariants(c)


def test_grow_maps_exactly_the_pages_needed(make_cache, small_spec):
    c = make_cache(small_spec)
    s = c.new_sequence()
    tb = small_spec.bytes_per_token_per_layer  # 128 B per token row, 32 tokens per 4 KiB page
    for n, total in [(1, 1), (31, 32), (1, 33), (100, 133)]:
        c.grow(s, n)
        pages = -(-total * tb // 4096)
        assert c.stats().mapped_bytes == 2 * small_spec.num_layers * pages * 4096
        assert c.stats().used_bytes == small_spec.kv_bytes(total)
    check_invariants(c)


def test_cow_is_total_both_directions(make_cache, small_spec):
    c = make_cache(small_spec)
    s = c.new_sequence()
    fill(c, s, 40)
    a, b = c.fork(s, 2)
    before = {x: [t.clone() for t in c.kv(0, x)] for x in (s, a, b)}
    k, v = rand_kv(small_spec, 3, seed=9)
    c.write(0, a, 5, k, v)  # overwrite shared positions in the child
    assert torch.equal(c.kv(0, a)[0][5:8], k)
    for x in (s, b):
        assert torch.equal(c.kv(0, x)[0], before[x][0]) and torch.equal(c.kv(0, x)[1], before[x][1])
    c.write(1, s, 0, k, v)  # the parent writes; children keep the old bytes
    assert torch.equal(c.kv(1, b)[0], c.kv(1, a)[0])
    assert not torch.equal(c.kv(1, b)[0][:3], k)
    check_invariants(c)


def test_free_returns_every_page(make_cache, small_spec):
    c = make_cache(small_spec)
    seqs = [c.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        fill(c, s, 17 * (i + 1), seed=i)
    kids = c.fork(seqs[1], 3)
    c.write(0, kids[0], 0, *rand_kv(small_spec, 1))
    for s in seqs + kids:
        c.free(s)
    st = c.stats()
    assert st.physical_pages == 0 and st.free_pages == st.total_pages
    check_invariants(c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_round_trip_is_byte_identical(make_cache, dtype):
    spec = KVSpec(2, 2, 16, dtype)
    c = make_cache(spec)
    s = c.new_sequence()
    written = fill(c, s, 77)
    other = c.new_sequence()
    h = c.swap.out(s)
    assert h.nbytes == spec.kv_bytes(77)
    assert c.stats().num_sequences == 1
    fill(c, other, 50, seed=3)  # the freed pages are reused meanwhile
    s2 = c.swap.restore(h)
    for layer, (k, v) in enumerate(written):
        k2, v2 = c.kv(layer, s2)
        assert k2.view(torch.uint8).equal(k.view(torch.uint8)) and torch.equal(v2, v)
    with pytest.raises(ValueError, match="already"):
        c.swap.restore(h)
    check_invariants(c)


def test_swap_tier_limit_is_cachefull(make_cache, small_spec):
    c = make_cache(small_spec, swap_bytes=small_spec.kv_bytes(10))
    s = c.new_sequence()
    fill(c, s, 11)
    before = snapshot(c)
    with pytest.raises(CacheFull, match="swap tier"):
        c.swap.out(s)
    assert_same(before, snapshot(c))


def test_scrub_hides_previous_owner(make_cache, small_spec):
    c = make_cache(small_spec, pool_bytes=8 * 4096)
    s = c.new_sequence()
    c.grow(s, 64)
    secret = torch.full((64, 2, 16), 1234.0)
    for layer in range(2):
        c.write(layer, s, 0, secret, secret)
    c.free(s)
    t = c.new_sequence()
    c.grow(t, 64)  # mapped, never written: must read zeros, not the secret
    for layer in range(2):
        k, v = c.kv(layer, t)
        assert not (k == 1234).any() and not (v == 1234).any()
        assert (k == 0).all()


def test_cachefull_leaves_state_untouched(make_cache, small_spec):
    c = make_cache(small_spec, pool_bytes=10 * 4096)  # 10 pages, 4 tensors
    s = c.new_sequence()
    fill(c, s, 40)  # 2 pages per tensor = 8 pages
    child = c.fork(s, 1)[0]
    before = snapshot(c)
    assert not c.can_grow(s, 64)
    with pytest.raises(CacheFull, match="wanted"):
        c.grow(s, 64)
    assert_same(before, snapshot(c))
    assert not c.can_grow(child, 1)
    with pytest.raises(CacheFull, match="4 pages wanted, 2 free"):
        c.grow(child, 1)  # the shared tail splits in all 4 tensors: 4 pages, 2 free
    assert_same(before, snapshot(c))
    c.free(s)
    c.grow(child, 1)  # now the tail is private: no split, no new page
    assert c.stats().physical_pages == 8
    check_invariants(c)


def test_cachefull_on_write_split(make_cache, small_spec):
    c = make_cache(small_spec, pool_bytes=5 * 4096)
    s = c.new_sequence()
    fill(c, s, 20)  # 4 pages
    child = c.fork(s, 1)[0]
    before = snapshot(c)
    with pytest.raises(CacheFull):
        c.write(0, child, 0, *rand_kv(small_spec, 1))  # needs 2 splits (K and V), 1 free
    assert_same(before, snapshot(c))


def test_slots_exhausted_is_cachefull(make_cache, small_spec):
    c = make_cache(small_spec, max_seqs=2)
    s = c.new_sequence()
    c.new_sequence()
    with pytest.raises(CacheFull, match="slots"):
        c.new_sequence()
    with pytest.raises(CacheFull, match="slots"):
        c.fork(s, 1)


def test_lengths_follow_grow_and_free(make_cache, small_spec):
    c = make_cache(small_spec, max_seqs=3)
    a, b = c.new_sequence(), c.new_sequence()
    c.grow(a, 5)
    c.grow(b, 9)
    assert [c.seq_len(a), c.seq_len(b)] == [5, 9] and c.sequences == [a, b]
    c.free(a)
    assert c.sequences == [b] and c.seq_len(b) == 9 and c.capacity.free_slots == 2
    with pytest.raises(KeyError):
        c.seq_len(a)


def test_token_major_layer_view_is_strided(make_cache, small_spec):
    c = make_cache(small_spec, layout="token_major")
    s = c.new_sequence()
    written = fill(c, s, 33)
    k0 = c.views.k_cache(0)
    assert k0.shape == (8, 256, 2, 16) and not k0.is_contiguous()
    for layer, (k, v) in enumerate(written):
        assert torch.equal(c.kv(layer, s)[0], k) and torch.equal(c.kv(layer, s)[1], v)
    assert c._pages_per_row == -(-256 * 2 * 128 // 4096)


def test_kv_views_are_zero_copy(make_cache, small_spec):
    c = make_cache(small_spec)
    s = c.new_sequence()
    fill(c, s, 10)
    k, _ = c.kv(1, s)
    assert k.data_ptr() == c.views.k_cache(1)[s].data_ptr()
    k[0].fill_(5.0)  # writes land in the cache's memory
    assert (c.kv(1, s)[0][0] == 5.0).all()


def test_many_caches_release_all_mappings(small_spec):
    import gc
    import os

    gc.collect()  # earlier tests' garbage closing its files mid-loop would move the baseline
    base_maps, base_fds = process_map_count(), len(os.listdir("/proc/self/fd"))
    for i in range(15):
        with VMKVCache(small_spec, max_seqs=4, max_seq_len=128, page_size=4096) as c:
            s = c.new_sequence()
            fill(c, s, 50 + i)
            c.fork(s, 2)
    gc.collect()
    assert process_map_count() <= base_maps + 4
    assert len(os.listdir("/proc/self/fd")) <= base_fds  # no descriptor left behind


def test_constructor_rejects_bad_arguments(small_spec):
    with pytest.raises(ValueError, match="page_size"):
        VMKVCache(small_spec, 4, 64, page_size=1000)
    with pytest.raises(ValueError, match="layout"):
        VMKVCache(small_spec, 4, 64, layout="diagonal")
    with pytest.raises(ValueError, match="max_seqs"):
        VMKVCache(small_spec, 0, 64)
    with pytest.raises(TypeError, match="KVSpec"):
        VMKVCache("llama", 4, 64)
    with pytest.raises(ValueError, match="device"):
        VMKVCache(small_spec, 4, 64, device="mps")


def test_a_live_view_keeps_memory_mapped_after_the_cache_is_dropped(small_spec):
    import gc

    c = VMKVCache(small_spec, max_seqs=2, max_seq_len=64, page_size=4096)
    s = c.new_sequence()
    fill(c, s, 10)
    k, _ = c.kv(0, s)
    expected = k.clone()
    del c
    gc.collect()
    assert torch.equal(k, expected)  # no SIGSEGV: the view holds the backend alive
