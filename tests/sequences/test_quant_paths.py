"""FP8 / INT8 K/V through every path that moves pages: fork and copy-on-write, swap, export /
load (the hand-off's payload), sleep / wake, prefix hits and the prefix tiers (host and disk).
Head scales are the spec's; per-token scales sit in each token's row, so they travel with
the page. Each path must give back exactly the K/V read before (dequantized), and a cache or
tier of another layout (other head scales, or the other granularity) must not take them."""

import pytest
import torch

from vmcache import KVSpec, VMKVCache
from vmcache.memory.backends.host import HostBackend
from vmcache.paged_fallback import PagedKVCache
from vmcache.prefix.tiers import PrefixTiers
from vmcache.sequences.invariants import check_invariants

KINDS = ["vm", "vm_token_major", "paged"]


def spec(shift=0.0, kv_dtype=torch.float8_e4m3fn, granularity="head"):
    if granularity == "token":
        return KVSpec(2, 2, 64, torch.bfloat16, kv_dtype=kv_dtype, kv_granularity="token")
    return KVSpec(2, 2, 64, torch.bfloat16, kv_dtype=kv_dtype,
                  kv_scales=tuple(0.05 + 0.01 * i + shift for i in range(8)))  # fmt: skip


def build(kind, sp=None, max_len=256, **kw):
    sp = sp or spec()
    if kind == "paged":
        return PagedKVCache(sp, num_blocks=64, block_size=16, max_seq_len=max_len, max_seqs=8,
                            **kw)  # fmt: skip
    layout = "token_major" if kind == "vm_token_major" else "layer_major"
    kw.setdefault("page_size", 4096)
    return VMKVCache(sp, 8, max_len, pool_bytes=128 * 4096, backend=HostBackend(), layout=layout,
                     **kw)  # fmt: skip


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


@pytest.mark.parametrize("granularity", ["head", "token"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("kind", KINDS)
def test_fork_swap_export_and_sleep_keep_quantized_kv(kind, kv_dtype, granularity):
    c = build(kind, spec(kv_dtype=kv_dtype, granularity=granularity))
    s = c.new_sequence()
    fill(c, s, 40)
    want = read(c, s)
    scale_bytes = 16 if granularity == "token" else 0  # 2 heads' fp32 scales, padded to 16
    assert c.stats().used_bytes == 40 * 2 * 2 * (2 * 64 + scale_bytes)
    assert want[0][0].dtype == torch.bfloat16
    (kid,) = c.fork(s)
    assert same(read(c, kid), want)
    c.write(0, kid, 39, torch.ones(1, 2, 64, dtype=torch.bfloat16),
            torch.ones(1, 2, 64, dtype=torch.bfloat16))  # fmt: skip
    assert same(read(c, s), want) and c.stats().cow_copies >= 1  # the shared tail page(s) copied
    assert not torch.equal(read(c, kid)[0][0], want[0][0])
    s = c.swap.restore(c.swap.out(s))
    assert same(read(c, s), want)
    other = build(kind, spec(kv_dtype=kv_dtype, granularity=granularity))
    assert same(read(other, other.handoff.load(c.handoff.export(s))), want)
    c.elastic.sleep()
    c.elastic.wake()
    assert same(read(c, s), want)
    check_invariants(c)
    # other head scales, or the other granularity: the bytes mean other K/V
    stranger = build(kind, spec(0.5, kv_dtype))  # head scales: other ones, or not per token
    with pytest.raises(ValueError, match="not of this cache"):
        stranger.handoff.load(c.handoff.export(s))
    assert not stranger.sequences


@pytest.mark.parametrize("granularity", ["head", "token"])
@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hits_and_tiers_keep_quantized_kv_and_their_scales(kind, granularity, tmp_path):
    tokens = list(range(100, 164)) + [1]
    tiers = dict(disk_dir=tmp_path / "t", disk_bytes=1 << 22)
    sp = spec(granularity=granularity)
    kw = dict(prefix_caching=True)
    if granularity == "token" and kind != "paged":  # 144-byte rows divide no 4 KiB page:
        kw.update(max_len=512)  # blocks of 9 pages, 256 tokens (128 in token_major)
        tokens = list(range(100, 400)) + [1]
    c = build(kind, sp, prefix_tiers=PrefixTiers(**tiers), **kw)
    if granularity == "token" and kind != "paged":
        assert c.prefix.index.pages_per_table == 9  # blocks through the tiers: 9 pages an entry
    s = c.new_sequence(prefix_tokens=tokens)
    fill(c, s, len(tokens), token_ids=tokens)
    want = read(c, s)
    c.free(s)
    s = c.new_sequence(prefix_tokens=tokens)  # a hit on the device
    hit = c.seq_len(s)
    assert hit >= 48 and same(read(c, s), [(k[:hit], v[:hit]) for k, v in want])
    assert hit < len(tokens)  # the last token is recomputed, never served
    c.free(s)
    c.prefix.index.clear()  # demoted to disk: whole blocks (a partial block's tail is not)
    hit = hit // c.prefix.tokens_per_entry * c.prefix.tokens_per_entry
    s = c.new_sequence(prefix_tokens=tokens)  # promoted back
    assert c.seq_len(s) == hit and same(read(c, s), [(k[:hit], v[:hit]) for k, v in want])
    c.free(s)
    c.close()
    again = build(kind, sp, prefix_tiers=PrefixTiers(**tiers), **kw)
    assert again.prefix.cached_tokens(tokens) == hit  # the same layout: served
    s = again.new_sequence(prefix_tokens=tokens)  # from disk into a new process's cache
    assert same(read(again, s), [(k[:hit], v[:hit]) for k, v in want])
    again.close()
    other_sp = spec(0.5) if granularity == "head" else spec()  # other scales / granularity
    other = build(kind, other_sp, prefix_tiers=PrefixTiers(**tiers), **kw)
    assert other.prefix.cached_tokens(tokens) == 0  # another layout's files
    other.close()
