"""Fault injection: the k-th map fails (the real host backend underneath); every public call
either completes or leaves the cache exactly as it was (DESIGN.md: a failed call changes
nothing)."""

import subprocess
import sys

import pytest
import torch
from caches import strict_host

from vmcache import DriverError, KVSpec, VMKVCache
from vmcache.backends.host import HostBackend

SPEC = KVSpec(2, 2, 16, torch.float32)
INJECTED: set[str] = (
    set()
)  # kinds of call that failed at least once  # 128 B per token row: 32 tokens per 4 KiB page


class FaultyBackend(HostBackend):
    """Fails the ``fail_at``-th fallible call (map, create_page or a page copy), once."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.fail_at = None

    def _maybe_fail(self, call):
        self.calls += 1
        if self.calls == self.fail_at:
            INJECTED.add(call)
            raise DriverError(call, "EINJECTED", "fault injection")

    def map(self, va, handles, page_size):
        self._maybe_fail("mmap(MAP_FIXED page)")
        super().map(va, handles, page_size)

    def create_page(self, page_size):
        self._maybe_fail("ftruncate(memfd)")
        return super().create_page(page_size)


class FaultyCache(VMKVCache):
    def _copy_page(self, src, dst, used_units):
        self.backend.inner._maybe_fail("copy page")
        super()._copy_page(src, dst, used_units)


def snapshot(c):
    return (
        c.stats(),
        {s: (c.seq_len(s), c.page_table(s)) for s in c.sequences},
        {s: [torch.cat(c.kv(layer, s)).clone() for layer in range(2)] for s in c.sequences},
    )


def same(a, b):
    return (
        a[0] == b[0]
        and a[1] == b[1]
        and all(torch.equal(x, y) for s in a[2] for x, y in zip(a[2][s], b[2][s]))
    )


def setup(be):
    c = FaultyCache(SPEC, 8, 512, page_size=4096, backend=strict_host(inner=be), chunk_pages=3)
    s = c.new_sequence()
    c.grow(s, 40)
    for layer in range(2):
        c.write(layer, s, 0, torch.randn(40, 2, 16), torch.randn(40, 2, 16))
    child = c.fork(s, 1)[0]
    return c, s, child


OPS = {
    "grow across pages": lambda c, s, child: c.grow(s, 150),
    "grow splitting a shared tail": lambda c, s, child: c.grow(child, 5),
    "fork": lambda c, s, child: c.fork(s, 3),
    "write splitting shared pages": lambda c, s, child: c.write(
        1, child, 0, torch.ones(40, 2, 16), torch.ones(40, 2, 16)
    ),
    "swap_in": lambda c, s, child: c.swap_in(c.swap_out(child)),
    "assign (beam reorder) of diverged rows": lambda c, s, child: c.assign([s, child], [child, s]),
    "reserve ahead": lambda c, s, child: c.reserve(s, 300),
    "grow taking reserved pages and more": lambda c, s, child: c.grow(s, 400),
}
# state an op needs first (done before the snapshot, never failed)
PREPARE = {
    "assign (beam reorder) of diverged rows": lambda c, s, child: c.grow(child, 100),
    "grow taking reserved pages and more": lambda c, s, child: c.reserve(s, 100),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_failure_rolls_back(op):
    injected = 0
    for k in range(1, 40):
        be = FaultyBackend()
        c, s, child = setup(be)
        if op == "swap_in":  # fail inside swap_in, not swap_out: count from after swap_out
            h = c.swap_out(child)
            before = snapshot(c)
            be.fail_at = be.calls + k
            try:
                c.swap_in(h)
            except DriverError:
                injected += 1
                assert same(before, snapshot(c)) and not h.consumed
                c.swap_in(h)  # the handle still works after the failure
            else:
                assert be.calls < be.fail_at
                c.check_invariants()
                c.close()
                be.close()
                break
        else:
            PREPARE.get(op, lambda *a: None)(c, s, child)
            before = snapshot(c)
            be.fail_at = be.calls + k
            try:
                OPS[op](c, s, child)
            except DriverError:
                injected += 1
                assert same(before, snapshot(c)), f"{op}: map #{k} failed and changed state"
            else:
                assert be.calls < be.fail_at  # no more maps to fail: the op completed
                c.check_invariants()
                c.close()
                be.close()
                break
        c.check_invariants()
        c.close()
        be.close()
    assert injected >= 1


def test_running_out_of_mappings_is_a_clear_error():
    code = (
        "from vmcache import MapLimitError\n"
        "from vmcache.backends.host import HostBackend\n"
        "be = HostBackend(); P = 4096; n = 80000\n"
        "va = be.reserve(2 * n * P)\n"
        "try:\n"
        "    for i in range(n):  # isolated pages: every one is its own VMA\n"
        "        be.map(va + 2 * i * P, [be.create_page(P)], P)\n"
        "except MapLimitError as e:\n"
        "    print('MapLimitError', i, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "MapLimitError" in r.stdout and "vm.max_map_count" in r.stdout


def test_all_three_kinds_were_injected():
    for op in sorted(OPS):
        test_every_failure_rolls_back(op)
    assert INJECTED == {"mmap(MAP_FIXED page)", "ftruncate(memfd)", "copy page"}
