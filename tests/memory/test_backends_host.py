"""The host backend is real Linux virtual memory: these tests check the kernel really aliases."""

import os
import subprocess
import sys

import pytest
import torch

from vmcache.memory.backends.base import runs as _runs
from vmcache.memory.backends.host import HostBackend, process_map_count

P = 4096


def test_same_page_mapped_twice_aliases():
    with HostBackend() as be:
        va = be.reserve(4 * P)
        h = be.create_page(P)
        be.map(va, [h], P)
        be.map(va + 2 * P, [h], P)
        a, b = be.view(va, P), be.view(va + 2 * P, P)
        a[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
        assert b[:5].tolist() == [1, 2, 3, 4, 5]
        b[100] = 77
        assert a[100].item() == 77


def test_zero_page_reads_as_zeros_at_every_mapping():
    """A scrub zeroes the page itself (a memset through one mapping): every other mapping
    of it reads zeros, and writing it again needs no new page."""
    with HostBackend() as be:
        va = be.reserve(2 * P)
        h = be.create_page(P)
        be.map(va, [h], P)
        be.map(va + P, [h], P)
        be.view(va, P).fill_(9)
        be.zero_page(h, be.view(va, P))
        assert int(be.view(va + P, P).sum()) == 0 and int(be.view(va, P).sum()) == 0
        be.view(va + P, P)[:3] = 5
        assert be.view(va, P)[:3].tolist() == [5, 5, 5]


def test_adjacent_pages_coalesce_into_one_mapping():
    assert _runs([0, P, 2 * P, 10 * P, 11 * P], P) == [(0, 3), (3, 2)]
    with HostBackend() as be:
        va = be.reserve(64 * P)
        handles = [be.create_page(P) for _ in range(64)]
        before = process_map_count()
        be.map(va, handles, P)
        # 64 file-contiguous pages: at most a couple of new VMAs, not 64
        assert process_map_count() - before <= 2
        be.unmap(va, 64, P)


def test_close_releases_mappings_and_fd():
    base_maps, base_fds = process_map_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        be = HostBackend()
        va = be.reserve(16 * P)
        be.map(va, [be.create_page(P) for _ in range(4)], P)
        be.close()
    assert process_map_count() <= base_maps + 2
    assert len(os.listdir("/proc/self/fd")) == base_fds


def test_unmapped_memory_faults():
    code = (
        "from vmcache.memory.backends.host import HostBackend\n"
        "be = HostBackend(); va = be.reserve(8192); h = be.create_page(4096)\n"
        "be.map(va, [h], 4096); be.view(va, 4096)[0] = 1\n"
        "print('mapped ok', flush=True)\n"
        "be.unmap(va, 1, 4096); be.view(va, 4096)[0].item()\n"
        "print('read unmapped memory')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "mapped ok" in r.stdout
    assert "read unmapped memory" not in r.stdout
    assert r.returncode != 0  # SIGSEGV


def test_closed_backend_refuses_work():
    be = HostBackend()
    be.close()
    with pytest.raises(ValueError, match="closed"):
        be.reserve(P)
