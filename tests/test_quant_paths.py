"""FP8 K/V through every path that moves pages: fork and copy-on-write, swap, export / load
(the hand-off's payload), sleep / wake, prefix hits and the prefix tiers (host and disk). The
pages stay plain arrays and the scales are the spec's, so each path must give back exactly the
K/V read before (dequantized), and a cache or tier of other scales must not take them."""

import pytest
import torch
from vmcache.paged_fallback import PagedKVCache

from vmcache import KVSpec, VMKVCache
from vmcache.memory.backends.host import HostBackend
from vmcache.prefix.tiers import PrefixTiers

KINDS = ["vm", "vm_token_major", "paged"]


def spec(shift=0.0, kv_dtype=torch.float8_e4m3fn):
    return KVSpec(2, 2, 64, torch.bfloat16, kv_dtype=kv_dtype,
                  kv_scales=tuple(0.05 + 0.01 * i + shift for i in range(8)))  # fmt: skip


def build(kind, sp=None, **kw):
    sp = sp or spec()
    if kind == "paged":
        return PagedKVCache(sp, num_blocks=64, block_size=16, max_seq_len=256, max_seqs=8, **kw)
    layout = "token_major" if kind == "vm_token_major" else "layer_major"
    return VMKVCache(sp, 8, 256, page_size=4096, pool_bytes=128 * 4096, backend=HostBackend(),
                     layout=layout, **kw)  # fmt: skip


def fill(c, s, n, seed=0, token_ids=None):
    g = torch.Generator().manual_seed(seed)
    start = c.seq_len(s)
    c.grow(s, n, token_ids=token_ids)
    for layer in range(2):
        k, v = (torch.randn(n, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
        c.write(layer, s, start, k, v)


def read(c, s):
    return [tuple(x.clone() for x in c.kv(layer, s)) for layer in range(2)]


def same(a, b):
    return all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("kind", KINDS)
def test_fork_swap_export_and_sleep_keep_quantized_kv(kind, kv_dtype):
    c = build(kind, spec(kv_dtype=kv_dtype))
    s = c.new_sequence()
    fill(c, s, 40)
    want = read(c, s)
    assert want[0][0].dtype == torch.bfloat16 and c.stats().used_bytes == 40 * 2 * 2 * 2 * 64
    (kid,) = c.fork(s)
    assert same(read(c, kid), want)
    c.write(0, kid, 39, torch.ones(1, 2, 64, dtype=torch.bfloat16),
            torch.ones(1, 2, 64, dtype=torch.bfloat16))  # fmt: skip
    assert same(read(c, s), want) and c.cow_copies >= 1  # the shared tail page(s) copied
    assert not torch.equal(read(c, kid)[0][0], want[0][0])
    s = c.swap.restore(c.swap.out(s))
    assert same(read(c, s), want)
    other = build(kind, spec(kv_dtype=kv_dtype))
    assert same(read(other, other.transfer.load(c.transfer.export(s))), want)
    c.memory.sleep()
    c.memory.wake()
    assert same(read(c, s), want)
    c.check_invariants()
    stranger = build(kind, spec(0.5, kv_dtype))  # other scales: the bytes mean other K/V
    with pytest.raises(ValueError, match="not of this cache"):
        stranger.transfer.load(c.transfer.export(s))
    assert not stranger.sequences


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hits_and_tiers_keep_quantized_kv_and_their_scales(kind, tmp_path):
    tokens = list(range(100, 164)) + [1]
    tiers = dict(disk_dir=tmp_path / "t", disk_bytes=1 << 22)
    c = build(kind, prefix_caching=True, prefix_tiers=PrefixTiers(**tiers))
    s = c.new_sequence(prefix_tokens=tokens)
    fill(c, s, len(tokens), token_ids=tokens)
    want = read(c, s)
    c.free(s)
    s = c.new_sequence(prefix_tokens=tokens)  # a hit on the device
    hit = c.seq_len(s)
    assert hit >= 48 and same(read(c, s), [(k[:hit], v[:hit]) for k, v in want])
    c.free(s)
    c.prefix.clear()  # demoted to disk
    s = c.new_sequence(prefix_tokens=tokens)  # promoted back
    assert c.seq_len(s) == hit and same(read(c, s), [(k[:hit], v[:hit]) for k, v in want])
    c.free(s)
    c.close()
    again = build(kind, prefix_caching=True, prefix_tiers=PrefixTiers(**tiers))
    assert again.cached_prefix_tokens(tokens) == hit  # the same scales: served
    again.close()
    other = build(kind, spec(0.5), prefix_caching=True, prefix_tiers=PrefixTiers(**tiers))
    assert other.cached_prefix_tokens(tokens) == 0  # other scales: another layout's files
    other.close()
