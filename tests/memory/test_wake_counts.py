"""What sleep, wake and a prefix demotion ask of the backend, counted by the strict backend
(the CUDA page rules; it counts creates, releases, maps, unmaps and device-wide syncs): wake
creates each live page once and writes each chunk's bytes as soon as that chunk exists (on a
GPU the copy overlaps the next chunk's cuMemCreate calls), maps the window in runs, and a
demotion into the prefix tiers never waits for the whole device."""

import torch
from caches import SPEC, strict_host

from vmcache import VMKVCache
from vmcache.memory.pagestore import CREATE_CHUNK
from vmcache.prefix.tiers import PrefixTiers
from vmcache.sequences.invariants import check_invariants


class Recording(VMKVCache):
    """The cache as it is, noting how many pages existed at each chunk's fill."""

    def _wake_fill(self, live, saved):
        inner = super()._wake_fill(live, saved)
        self.fills = []

        def fill(pages):
            self.fills.append((len(pages), self._backend.create_calls))
            inner(pages)

        return fill


def test_wake_writes_each_chunk_as_it_is_created():
    be = strict_host()
    c = Recording(SPEC, 4, 4096, page_size=4096, pool_bytes=400 * 4096, backend=be,
                  own_backend=True)  # fmt: skip
    seqs = [c.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):  # 32 tokens a page: 4 tables x 30 pages per sequence
        c.grow(s, 960)
        for layer in range(2):
            k = torch.full((960, 2, 16), float(i + 1))
            c.write(layer, s, 0, k, -k)
    live = c._pool.num_used
    c.elastic.sleep()
    assert be.release_calls >= live and be.live_handles() == 0
    created, maps = be.create_calls, be.map_calls
    c.elastic.wake()
    assert be.create_calls - created == live  # each live page once, none more
    chunks = -(-live // CREATE_CHUNK)
    assert [n for n, _ in c.fills] == [CREATE_CHUNK] * (chunks - 1) + [
        live - CREATE_CHUNK * (chunks - 1)
    ]
    # each chunk's bytes go in right after it exists, before the next chunk is created
    assert [at - created for _, at in c.fills] == [min(live, CREATE_CHUNK * (i + 1))
                                                   for i in range(chunks)]  # fmt: skip
    # the window: at most one map per chunk (consecutive ids); the sequences: one per table
    window_maps = be.map_calls - maps - 3 * 4
    assert 1 <= window_maps <= chunks, window_maps
    for i, s in enumerate(seqs):
        assert torch.equal(c.kv(1, s)[0], torch.full((960, 2, 16), float(i + 1)))
    check_invariants(c)
    c.close()


def test_a_demotion_to_the_tiers_waits_for_no_device(tmp_path):
    be = strict_host()
    c = VMKVCache(SPEC, 4, 1024, page_size=4096, pool_bytes=64 * 4096, backend=be,
                  own_backend=True, prefix_caching=True,
                  prefix_tiers=PrefixTiers(1 << 20))  # fmt: skip
    s = c.new_sequence()
    c.grow(s, 256, token_ids=list(range(256)))
    c.free(s)  # 256 tokens indexed
    syncs, maps, unmaps = be.sync_calls, be.map_calls, be.unmap_calls
    assert c.prefix.index.clear() > 0 and c.prefix.tier_stats().demoted_pages > 0
    assert (be.sync_calls, be.map_calls, be.unmap_calls) == (syncs, maps, unmaps)
    c.close()
