"""StrictBackend enforces the CUDA driver's page rules on the host backend, so code that
would be refused on the GPU fails here first; and VMKVCache keeps them."""

import subprocess
import sys

import pytest
import torch

from vmcache import DriverError, KVSpec, VMKVCache
from vmcache.memory.backends.host import HostBackend
from vmcache.memory.backends.strict import CUDA_GRANULARITY, PageRuleError, StrictBackend
from vmcache.sequences.invariants import check_invariants

G = CUDA_GRANULARITY


@pytest.fixture
def be():
    b = StrictBackend(HostBackend())
    yield b
    b.close()


def test_sizes_and_addresses_at_the_granularity(be):
    with pytest.raises(PageRuleError, match="cuMemCreate"):
        be.create_page(4096)
    with pytest.raises(PageRuleError, match="cuMemAddressReserve"):
        be.reserve(G + 4096)
    va = be.reserve(4 * G)
    assert va % G == 0
    h = be.create_page(G)
    with pytest.raises(PageRuleError, match="cuMemMap"):
        be.map(va + 4096, [h], G)
    with pytest.raises(PageRuleError, match="inside one reservation"):
        be.map(va + 4 * G, [h], G)
    be.map(va, [h], G)
    be.unmap(va, 1, G)
    be.release_page(h)
    be.release_reservation(va, 4 * G)


def test_no_map_over_a_mapped_page_and_no_unmap_of_an_unmapped_one(be):
    va = be.reserve(4 * G)
    h1, h2 = be.create_page(G), be.create_page(G)
    be.map(va, [h1], G)
    with pytest.raises(PageRuleError, match="already mapped"):
        be.map(va, [h2], G)
    with pytest.raises(PageRuleError, match="cuMemUnmap"):
        be.unmap(va + G, 1, G)
    with pytest.raises(PageRuleError, match="cuMemUnmap"):
        be.unmap(va, 2, G)  # the second page is not mapped: nothing is unmapped
    assert be.mapped_pages() == 1
    be.map(va + 2 * G, [h1], G)  # one page at two addresses: aliasing is legal
    a, b = be.view(va, G), be.view(va + 2 * G, G)
    a[:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert b[:3].tolist() == [7, 8, 9]
    with pytest.raises(PageRuleError, match="still mapped"):
        be.release_page(h1)
    with pytest.raises(PageRuleError, match="cuMemAddressFree"):
        be.release_reservation(va, 4 * G)
    be.unmap(va, 1, G)
    be.unmap(va + 2 * G, 1, G)
    be.release_page(h1)
    with pytest.raises(PageRuleError, match="cuMemRelease"):
        be.release_page(h1)
    with pytest.raises(PageRuleError, match="not a live"):
        be.map(va, [h1], G)
    be.release_reservation(va, 4 * G)


def test_a_refused_call_is_a_driver_error_naming_the_call(be):
    with pytest.raises(DriverError) as info:
        be.create_page(G // 2)
    assert info.value.call == "cuMemCreate" and "granularity" in str(info.value)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_the_cache_keeps_the_rules_at_2_mib(layout):
    """Every cache operation at CUDA's granularity: nothing refused, nothing left mapped."""
    spec = KVSpec(2, 4, 128, torch.float16)  # 1 KiB per token row: 2,048 tokens per page
    be = StrictBackend(HostBackend())
    c = VMKVCache(spec, 4, 6000, backend=be, layout=layout, pool_bytes=40 * G)
    s = c.new_sequence()
    c.grow(s, 2100)  # crosses a page edge
    k = torch.randn(2100, 4, 128, dtype=torch.float16)
    c.write(0, s, 0, k, -k)
    kids = c.fork(s, 2)
    c.grow(kids[0], 10)  # copy-on-write split of the tail page
    c.write(0, kids[0], 2100, k[:10], k[:10])
    c.beams.assign([kids[1]], [kids[0]])
    c.beams.truncate(kids[1], 100)
    back = c.swap.restore(c.swap.out(s))
    assert torch.equal(c.kv(0, back)[0], k)
    c.allocate(back, 0, ahead=3000)
    c.grow(back, 3000)
    check_invariants(c)
    c.close()
    assert be.mapped_pages() == 0
    be.close()


def test_page_sizes_the_driver_refuses_are_refused_at_construction():
    be = StrictBackend(HostBackend())
    with pytest.raises(ValueError, match="granularity"):
        VMKVCache(KVSpec(2, 2, 16, torch.float32), 4, 64, backend=be, page_size=4096)
    be.close()


def test_printing_a_whole_cache_view_reads_nothing():
    """A whole K tensor is mostly unmapped: printing it must not touch it (it would crash
    the process on the host, and poison the CUDA context on a GPU)."""
    code = (
        "import torch\n"
        "from vmcache import KVSpec, VMKVCache\n"
        "c = VMKVCache(KVSpec(2, 2, 16, torch.float32), 4, 4096, page_size=4096)\n"
        "s = c.new_sequence(); c.grow(s, 3)\n"
        "text = repr(c.views.k_cache(0)) + str(c.views.v_cache(1)) + repr(c)\n"
        "assert 'CacheView' in text and 'shape=(4, 4096, 2, 16)' in text, text\n"
        "print(c.kv(0, s)[0].sum())  # the valid prefix is a plain tensor and prints\n"
        "assert type(c.views.k_cache(0)[s, :3]) is torch.Tensor\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd="/")  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
