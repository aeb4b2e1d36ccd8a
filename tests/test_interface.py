"""Both caches behind one interface: the same bad-input sweep and the same state machine
against a plain-Python shadow model (docs/DESIGN.md invariants 1-4 after every step)."""

from collections import Counter

import caches
import pytest
import torch
from caches import examples, record_coverage
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vmcache import CacheFull


@pytest.fixture(params=sorted(caches.FACTORIES))
def cache(request):
    c = caches.FACTORIES[request.param]()
    yield c
    c.close()


def state(c):
    return (
        c.stats(),
        {s: (c.seq_len(s), c.page_table(s)) for s in c.sequences},
        {s: [torch.cat(c.kv(layer, s)).clone() for layer in range(2)] for s in c.sequences},
    )


def kv(n, dtype=torch.float32, heads=2, dim=16, device="cpu"):
    return torch.randn(n, heads, dim, dtype=dtype, device=device)


BAD_CALLS = [
    ("grow unknown seq", lambda c, s: c.grow(99, 1), KeyError),
    ("grow non-int seq", lambda c, s: c.grow("a", 1), TypeError),
    ("grow n<0", lambda c, s: c.grow(s, -1), ValueError),
    ("grow float n", lambda c, s: c.grow(s, 1.0), TypeError),
    ("grow past max_seq_len", lambda c, s: c.grow(s, 1000), ValueError),
    (
        "write wrong shape",
        lambda c, s: c.write(0, s, 0, kv(2, heads=3), kv(2, heads=3)),
        ValueError,
    ),
    (
        "write wrong dtype",
        lambda c, s: c.write(0, s, 0, kv(2, torch.float16), kv(2, torch.float16)),
        TypeError,
    ),
    (
        "write wrong device",
        lambda c, s: c.write(0, s, 0, kv(2, device="meta"), kv(2, device="meta")),
        ValueError,
    ),
    ("write beyond length", lambda c, s: c.write(0, s, 19, kv(2), kv(2)), ValueError),
    ("write negative start", lambda c, s: c.write(0, s, -1, kv(2), kv(2)), ValueError),
    ("write k/v mismatch", lambda c, s: c.write(0, s, 0, kv(2), kv(3)), ValueError),
    ("write not a tensor", lambda c, s: c.write(0, s, 0, [1], [1]), TypeError),
    ("write bad layer", lambda c, s: c.write(5, s, 0, kv(1), kv(1)), ValueError),
    ("kv bad layer", lambda c, s: c.kv(-1, s), ValueError),
    ("fork n<1", lambda c, s: c.fork(s, 0), ValueError),
    ("fork too many", lambda c, s: c.fork(s, 50), CacheFull),
    ("free unknown", lambda c, s: c.free(7), KeyError),
    ("swap_in not a handle", lambda c, s: c.swap_in("h"), TypeError),
    ("pool exhausted", lambda c, s: [c.grow(c.new_sequence(), 250) for _ in range(8)], CacheFull),
]


@pytest.mark.parametrize("name,call,exc", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_typed_error_state_unchanged(cache, name, call, exc):
    s = cache.new_sequence()
    cache.grow(s, 20)
    for layer in range(2):
        cache.write(layer, s, 0, kv(20), kv(20))
    cache.fork(s, 1)
    live = set(cache.sequences)
    before = state(cache)
    with pytest.raises(exc):
        call(cache, s)
    for extra in set(cache.sequences) - live:  # sequences the failing call made on purpose
        cache.free(extra)
    after = state(cache)
    assert before[0] == after[0] and before[1] == after[1]
    for x in before[2]:
        assert all(torch.equal(a, b) for a, b in zip(before[2][x], after[2][x]))
    cache.check_invariants()


def test_freed_sequence_and_double_free(cache):
    s = cache.new_sequence()
    cache.grow(s, 3)
    cache.free(s)
    for call in (lambda: cache.free(s), lambda: cache.grow(s, 1), lambda: cache.kv(0, s),
                 lambda: cache.fork(s, 1), lambda: cache.swap_out(s)):  # fmt: skip
        with pytest.raises(KeyError, match="not live"):
            call()


def test_swap_handle_from_another_cache_rejected(cache):
    other = caches.paged()
    s = other.new_sequence()
    other.grow(s, 2)
    h = other.swap_out(s)
    with pytest.raises(ValueError, match="another cache"):
        cache.swap_in(h)


COVERAGE: dict[str, Counter] = {}  # machine name -> what its runs reached (see below)


class CacheMachine(RuleBasedStateMachine):
    """Random grow/write/fork/assign/truncate/write_group/reserve/free/swap against a shadow
    dict of token rows, with pools small enough (12–14 pages) that they really run out. Every
    CacheFull must leave stats, page tables, lengths and contents as they were; what the runs
    reach (pool exhaustion, copy-on-write splits, swap round trips) is counted in COVERAGE."""

    factory = None
    name = ""

    def __init__(self):
        super().__init__()
        self.c = type(self).factory()
        self.seen = COVERAGE.setdefault(type(self).name, Counter())
        self.shadow: dict[int, list[torch.Tensor]] = {}  # seq -> per layer [len, 2, 2, 16]
        self.swapped: list[tuple[object, list[torch.Tensor]]] = []
        self.counter = 0
        self.dirty: set[int] = set()  # truncated: regrown positions may hold its old bytes

    def teardown(self):
        for s in list(self.shadow):
            self.c.free(s)
        st_ = self.c.stats()
        assert st_.physical_pages == 0 and st_.free_pages == st_.total_pages
        self.c.check_invariants()
        self.c.close()

    def _value(self, n):
        self.counter += 1
        return torch.full((n, 2, 2, 16), float(self.counter))

    seqs = property(lambda self: sorted(self.shadow))

    def _snapshot(self):
        c = self.c
        return (c.stats(), {s: (c.seq_len(s), c.page_table(s)) for s in c.sequences},
                {s: [torch.stack(c.kv(layer, s), 1).clone() for layer in range(2)]
                 for s in c.sequences})  # fmt: skip

    def attempt(self, op, fn):
        """Run ``fn``; on CacheFull check that nothing changed and count why it was full.
        Returns True when ``fn`` completed."""
        before = self._snapshot()
        copies = self.c.cow_copies
        try:
            fn()
        except CacheFull:
            after = self._snapshot()
            assert before[0] == after[0], f"{op}: CacheFull changed the stats"
            assert before[1] == after[1], f"{op}: CacheFull changed page tables or lengths"
            for s in before[2]:
                for x, y in zip(before[2][s], after[2][s]):
                    assert torch.equal(x.nan_to_num(7.5), y.nan_to_num(7.5)), op
            slots = len(self.c._free_slots)
            kind = "slots full" if op in ("new", "fork") and slots < 3 else "pool full"
            event(f"{op}: {kind}")
            self.seen[kind] += 1
            return False
        if self.c.cow_copies > copies:
            event(f"{op}: copy-on-write split")
            self.seen["cow split"] += 1
        self.seen[op] += 1
        return True

    @initialize(n=st.integers(10, 40))
    def a_forked_prompt(self, n):
        """Every run starts from a written prompt and a fork of it (pages shared)."""
        s = self.c.new_sequence()
        self.c.grow(s, n)
        val = self._value(n)
        for layer in range(2):
            self.c.write(layer, s, 0, val[:, 0], val[:, 1])
        self.shadow[s] = [val.clone(), val.clone()]
        (kid,) = self.c.fork(s, 1)
        self.shadow[kid] = [val.clone(), val.clone()]

    @precondition(lambda self: len(self.shadow) < 5)  # a full slot table comes from fork
    @rule()
    def new(self):
        got = []
        if not self.attempt("new", lambda: got.append(self.c.new_sequence())):
            assert len(self.shadow) == self.c.max_seqs
            return
        self.shadow[got[0]] = [torch.empty(0, 2, 2, 16) for _ in range(2)]

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(0, 70))
    def grow(self, data, n):
        s = data.draw(st.sampled_from(self.seqs))
        if len(self.shadow[s][0]) + n > self.c.max_seq_len:
            return
        if not self.attempt("grow", lambda: self.c.grow(s, n)):
            return
        for layer in range(2):
            # new positions never expose another owner's bytes; after truncate they may
            # show the sequence's own old bytes (NaN = unspecified, not compared)
            fill = float("nan") if s in self.dirty else 0.0
            self.shadow[s][layer] = torch.cat(
                [self.shadow[s][layer], torch.full((n, 2, 2, 16), fill)]
            )

    @precondition(lambda self: any(len(v[0]) for v in self.shadow.values()))
    @rule(data=st.data())
    def write(self, data):
        s = data.draw(st.sampled_from([s for s in self.seqs if len(self.shadow[s][0])]))
        length = len(self.shadow[s][0])
        start = data.draw(st.integers(0, length - 1))
        n = data.draw(st.integers(1, length - start))
        layer = data.draw(st.integers(0, 1))
        val = self._value(n)
        if not self.attempt("write", lambda: self.c.write(layer, s, start, val[:, 0], val[:, 1])):
            return
        self.shadow[s][layer][start : start + n] = val

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        s = data.draw(st.sampled_from(self.seqs))
        kids = []
        if not self.attempt("fork", lambda: kids.extend(self.c.fork(s, n))):
            return
        for k in kids:
            self.shadow[k] = [t.clone() for t in self.shadow[s]]
            if s in self.dirty:
                self.dirty.add(k)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def assign(self, data):
        dsts = data.draw(st.lists(st.sampled_from(self.seqs), min_size=1, unique=True))
        srcs = [data.draw(st.sampled_from(self.seqs)) for _ in dsts]
        self.c.assign(dsts, srcs)
        before = {s: [t.clone() for t in self.shadow[s]] for s in srcs}
        dirty = {s for s in srcs if s in self.dirty}
        for d, s in zip(dsts, srcs):
            self.shadow[d] = [t.clone() for t in before[s]]
            (self.dirty.add if s in dirty else self.dirty.discard)(d)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(0, 70))
    def reserve(self, data, n):
        s = data.draw(st.sampled_from(self.seqs))
        self.c.reserve(s, n)  # best effort; contents and lengths do not change

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        length = data.draw(st.integers(0, len(self.shadow[s][0])))
        self.c.truncate(s, length)
        self.shadow[s] = [t[:length] for t in self.shadow[s]]
        self.dirty.add(s)

    @precondition(lambda self: any(len(v[0]) for v in self.shadow.values()))
    @rule(data=st.data())
    def write_group(self, data):
        live = [s for s in self.seqs if len(self.shadow[s][0])]
        group = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        length = min(len(self.shadow[s][0]) for s in group)
        start = data.draw(st.integers(0, length - 1))
        n = data.draw(st.integers(1, length - start))
        layer = data.draw(st.integers(0, 1))
        val = self._value(n)
        if not self.attempt(
            "write_group", lambda: self.c.write_group(layer, group, start, val[:, 0], val[:, 1])
        ):
            return
        for s in group:
            self.shadow[s][layer][start : start + n] = val

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self.c.free(s)
        del self.shadow[s]
        self.dirty.discard(s)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self.swapped.append((self.c.swap_out(s), self.shadow.pop(s)))
        self.dirty.discard(s)  # swap_in restores exactly the written length

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self):
        h, content = self.swapped[0]
        got = []
        if not self.attempt("swap_in", lambda: got.append(self.c.swap_in(h))):
            return
        self.swapped.pop(0)
        self.shadow[got[0]] = content

    @invariant()
    def contents_match_shadow(self):
        for s, layers in self.shadow.items():
            assert self.c.seq_len(s) == len(layers[0])
            for layer in range(2):
                want = layers[layer]
                known = ~torch.isnan(want)
                got = torch.stack(self.c.kv(layer, s), 1)
                assert torch.equal(got[known], want[known])
        self.c.check_invariants()


# 128 B token rows, 4 KiB pages: a 160-token sequence needs 20 pages (VM, both layouts) or
# 10 blocks (paged, B = 16); the pools hold 14-16 pages / 10 blocks, so they run out
POOLS = {"vm": {"pages": 16}, "vm_token_major": {"pages": 14}, "paged": {"blocks": 10}}


def _machine_class(name):
    make = lambda: caches.FACTORIES[name](max_seqs=6, max_seq_len=160, **POOLS[name])
    return type(f"{name}Machine", (CacheMachine,), {"factory": staticmethod(make), "name": name})


def _machine(name):
    case = _machine_class(name).TestCase
    case.settings = settings(max_examples=examples(100), stateful_step_count=30, deadline=None)
    return case


TestVMMachine = _machine("vm")
TestVMTokenMajorMachine = _machine("vm_token_major")
TestPagedMachine = _machine("paged")


@pytest.mark.parametrize("name", sorted(POOLS))
def test_the_machines_reach_the_states_they_claim(name):
    """A fixed-seed run of each machine reaches pool exhaustion (not only a full slot
    table), copy-on-write splits and swap round trips: the machines can fail there."""
    from hypothesis.stateful import run_state_machine_as_test

    COVERAGE.pop(name, None)
    run_state_machine_as_test(_machine_class(name), settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None, derandomize=True,
        database=None))  # fmt: skip
    seen = COVERAGE[name]
    assert seen["pool full"] >= 3, seen
    assert seen["cow split"] >= 5, seen
    assert seen["swap_in"] >= 5, seen
    record_coverage(f"cache machine {name}", seen)
