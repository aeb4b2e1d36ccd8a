"""A sliding layer keeps every page FlashAttention reads: FA2 loads a window's K in whole tiles
of kBlockN tokens (64 or 128 on sm_90) from a tile-aligned start, up to kBlockN − 1 tokens
before the window. With 2 MiB pages whose token count is not a multiple of the tile, keeping
pages from the window's first token leaves that tile's start in a released page (an illegal
address on the GPU). The rule is the window manager's (PageTables.keep_page with
``align_tokens``), checked here over head sizes, layouts and windows around page edges, and
for the unaligned rule shown to fail."""

import pytest
import torch

from vmcache import KVSpec, VMKVCache
from vmcache.memory.backends.sizing import SizingBackend
from vmcache.sequences.cache import default_window_align
from vmcache.sequences.tables import FA_TILE_TOKENS

P = 2 << 20
TILES = (64, 128)  # FA2's kBlockN on sm_90 (forward, by head_dim)
STEPS = 6000


def groups(head_dim, layout, window, align):
    spec = KVSpec(6, 32 if head_dim <= 128 else 8, head_dim, torch.bfloat16,
                  layer_windows=(window,) * 5 + (None,))  # fmt: skip
    c = VMKVCache(spec, 1, window + STEPS + 1024, backend=SizingBackend(P), layout=layout,
                  pool_bytes=4 * P, window_align_tokens=align)  # fmt: skip
    return [g for g in c._groups if g.sliding]


def unread_released(g, margin=0):
    """Decode steps (length L) where a tile FA2 reads starts in a page the window released."""
    bad = 0
    for length in range(g.window, g.window + STEPS):
        first_page = g.keep_page(length, margin)
        needed = max(0, length - g.window + 1 - margin)  # the window's first key
        for tile in TILES:
            start = needed - needed % tile  # FA2's first K tile for this query
            if start * g.u // g.P < first_page:  # its first byte lies in a released page
                bad += 1
                break
    return bad


def page_edge_windows(head_dim, layout):
    """Windows whose first key crosses a page edge at several phases (tokens per page not a
    multiple of the tile: 341.3, 682.7, ... tokens)."""
    (g,) = groups(head_dim, layout, 4096, 1)
    per_page = g.P / g.u
    return sorted({max(64, int(k * per_page) + d) for k in (3, 7) for d in (-1, 0, 1, 37)})


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_every_tile_flash_attention_reads_stays_mapped(head_dim, layout):
    for window in page_edge_windows(head_dim, layout):
        for g in groups(head_dim, layout, window, FA_TILE_TOKENS):
            assert unread_released(g) == 0, (head_dim, layout, window)
            assert unread_released(g, margin=g.rollback_tokens) == 0
            # the price: at most ⌈A·u / P⌉ pages more than keeping from the window's start
            more = -(-FA_TILE_TOKENS * g.u // g.P)
            for length in range(window, window + 400):
                unaligned = max(0, length - window + 1) * g.u // g.P
                assert 0 <= unaligned - g.keep_page(length, 0) <= more


def test_the_unaligned_rule_releases_pages_flash_attention_reads():
    """The fault as found: 32 × 96 bf16 layer_major (341.3 tokens per 2 MiB page) and a
    Gemma-3-like token_major cache keep pages from the window's first token, and a tile
    starts in a released page on hundreds of 6,000 decode steps."""
    g = groups(96, "layer_major", 2047, 1)[0]
    assert unread_released(g) > 100
    gemma = KVSpec(6, 16, 256, torch.bfloat16, layer_windows=(1024,) * 5 + (None,))
    c = VMKVCache(gemma, 1, 8192, backend=SizingBackend(P), layout="token_major",
                  pool_bytes=4 * P, window_align_tokens=1)  # fmt: skip
    (sliding,) = [x for x in c._groups if x.sliding]
    assert unread_released(sliding) > 50


def test_the_alignment_follows_the_device_and_is_checked():
    assert default_window_align(torch.device("cuda", 0)) == FA_TILE_TOKENS
    assert default_window_align(torch.device("cpu")) == 1
    for g in groups(96, "layer_major", 999, None):  # the host backend: nothing reads before
        assert g.align_tokens == 1
    for bad in (0, -256):
        with pytest.raises(ValueError, match="window_align_tokens"):
            groups(96, "layer_major", 999, bad)
    with pytest.raises(TypeError):
        groups(96, "layer_major", 999, 2.5)
