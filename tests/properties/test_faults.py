"""Fault injection: the k-th map fails (the real host backend underneath); every public call
either completes or leaves the cache exactly as it was (docs/DESIGN.md: a failed call changes
nothing)."""

import itertools
import subprocess
import sys

import pytest
import torch
from caches import record_coverage, strict_host

from vmcache import CacheFull, DriverError, KVSpec, VMKVCache
from vmcache.memory.backends.host import HostBackend
from vmcache.sequences.invariants import check_invariants

SPEC = KVSpec(2, 2, 16, torch.float32)  # 128 B per token row: 32 tokens per 4 KiB page
INJECTED: set[str] = set()  # kinds of call that failed at least once
FAILURE_POINTS: dict[str, int] = {}  # op -> fallible calls it makes (each one failed once)


class FaultyBackend(HostBackend):
    """Fails the ``fail_at``-th fallible call (map, create_page or a page copy), once, with
    error ``code`` (``only``: count just that kind of call)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.fail_at = None
        self.code = "EINJECTED"
        self.only = None

    def _maybe_fail(self, call):
        if self.only is not None and call != self.only:
            return
        self.calls += 1
        if self.calls == self.fail_at:
            INJECTED.add(call)
            raise DriverError(call, self.code, "fault injection")

    def map(self, va, handles, page_size):
        self._maybe_fail("mmap(MAP_FIXED page)")
        super().map(va, handles, page_size)

    def create_page(self, page_size):
        self._maybe_fail("ftruncate(memfd)")
        return super().create_page(page_size)


class FaultyCache(VMKVCache):
    def _copy_page(self, src, dst, used_units):
        self._backend.inner._maybe_fail("copy page")
        super()._copy_page(src, dst, used_units)


def snapshot(c):
    return (
        c.stats(),
        {s: (c.seq_len(s), c.views.page_table(s)) for s in c.sequences},
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
    "swap_in": lambda c, s, child: c.swap.restore(c.swap.out(child)),
    "assign (beam reorder) of diverged rows": lambda c, s, child: c.beams.assign(
        [s, child], [child, s]
    ),
    "reserve ahead": lambda c, s, child: c.allocate(s, 0, ahead=300).ahead,
    "grow taking reserved pages and more": lambda c, s, child: c.grow(s, 400),
}
# state an op needs first (done before the snapshot, never failed)
PREPARE = {
    "assign (beam reorder) of diverged rows": lambda c, s, child: c.grow(child, 100),
    "grow taking reserved pages and more": lambda c, s, child: c.allocate(s, 0, ahead=100).ahead,
}


def _run_with_fault_at(op, k, code="EINJECTED"):
    """Build the scene, fail the k-th fallible call of ``op``; returns True when the op
    completed before reaching call k, False when it failed and changed nothing."""
    be = FaultyBackend()
    be.code = code
    c, s, child = setup(be)
    try:
        if op == "swap_in":  # fail inside swap_in, not swap_out: count from after swap_out
            h = c.swap.out(child)
            run = lambda: c.swap.restore(h)  # noqa: E731
        else:
            PREPARE.get(op, lambda *a: None)(c, s, child)
            run = lambda: OPS[op](c, s, child)  # noqa: E731
        before = snapshot(c)
        be.fail_at = be.calls + k
        expected = CacheFull if code == "ENOMEM" else DriverError
        try:
            run()
        except expected:
            assert same(before, snapshot(c)), f"{op}: call #{k} failed and changed state"
            if op == "swap_in":
                assert not h.consumed
                c.swap.restore(h)  # the handle still works after the failure
            return False
        assert be.calls < be.fail_at  # no more calls to fail: the op completed
        return True
    finally:
        check_invariants(c)
        c.close()
        be.close()


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_failure_rolls_back(op):
    """Fail the 1st, 2nd, ... fallible call until the operation completes: every failure
    point, up to the last mapping step, is exercised."""
    for k in itertools.count(1):
        if _run_with_fault_at(op, k):
            break
        assert k < 500, f"{op} never completed"
    assert k > 1  # at least one failure was injected
    FAILURE_POINTS[op] = k - 1


def test_out_of_memory_at_page_creation_is_cache_full_and_changes_nothing():
    """ENOMEM from the host (CUDA_ERROR_OUT_OF_MEMORY from the driver) while creating pages
    is exhaustion: CacheFull, state unchanged."""
    be = FaultyBackend()
    be.code = "ENOMEM"
    be.only = "ftruncate(memfd)"
    c, s, child = setup(be)
    before = snapshot(c)
    be.fail_at = be.calls + 1
    with pytest.raises(CacheFull, match="exhausted"):
        c.grow(s, 300)  # needs new pages: the next chunk's creation fails
    assert same(before, snapshot(c))
    c.grow(s, 300)  # the failure was transient: the pool grows now
    check_invariants(c)
    c.close()
    be.close()


def test_out_of_memory_while_waking_is_cache_full_and_the_cache_stays_asleep():
    """wake() recreates every live page at once: the driver's out-of-memory answer there is
    CacheFull (as the docstring promises), not a DriverError; the cache stays asleep and a
    later wake restores it whole."""
    be = FaultyBackend()
    be.code = "ENOMEM"
    be.only = "ftruncate(memfd)"
    c, s, child = setup(be)
    before = snapshot(c)
    c.elastic.sleep()
    be.fail_at = be.calls + 1
    with pytest.raises(CacheFull, match="waking"):
        c.elastic.wake()
    assert c.elastic.asleep and c.elastic.resident_bytes == 0
    c.elastic.wake()
    assert same(before, snapshot(c))
    check_invariants(c)
    c.close()
    be.close()


def test_running_out_of_mappings_is_a_clear_error():
    from vmcache.memory.backends.host import max_map_count

    n = max_map_count() // 2 + 5000  # isolated pages take a VMA each: past the host's limit
    if n > 600_000:
        pytest.skip(f"vm.max_map_count is {max_map_count()}: too many mappings to exhaust")
    code = (
        "from vmcache import MapLimitError\n"
        "from vmcache.memory.backends.host import HostBackend\n"
        f"be = HostBackend(); P = 4096; n = {n}\n"
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


def test_all_three_kinds_were_injected_up_to_the_last_call():
    for op in sorted(OPS):
        test_every_failure_rolls_back(op)
    assert INJECTED >= {"mmap(MAP_FIXED page)", "ftruncate(memfd)", "copy page"}
    assert FAILURE_POINTS["grow taking reserved pages and more"] >= 40  # past the old cap, 39
    record_coverage("fault injection", {f"{op}: failure points": k
                                        for op, k in FAILURE_POINTS.items()})  # fmt: skip
