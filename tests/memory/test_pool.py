import pytest
from caches import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmcache import CacheFull, PagePool


class RecordingStore:
    """A real (in-memory) page store: pages are bytearrays; records scrubs."""

    def __init__(self):
        self.pages: dict[int, bytearray] = {}  # id -> bytes, for pages with memory
        self.scrubbed: list[int] = []

    def create(self, pages):
        assert pages == sorted(pages) and not set(pages) & set(self.pages)
        self.pages.update({p: bytearray(8) for p in pages})

    def release(self, pages):
        for p in pages:
            del self.pages[p]

    def scrub(self, pages):
        for p in pages:
            self.pages[p][:] = bytes(8)
        self.scrubbed.extend(pages)


def test_allocate_is_all_or_nothing():
    pool = PagePool(10, RecordingStore(), chunk_pages=4)
    got = pool.allocate(7)
    assert len(set(got)) == 7 and pool.num_free == 3
    with pytest.raises(CacheFull, match="4 pages wanted, 3 free") as ei:
        pool.allocate(4)
    assert (ei.value.wanted, ei.value.free) == (4, 3)
    assert pool.num_free == 3 and pool.num_used == 7


def test_pages_created_lazily_in_chunks():
    store = RecordingStore()
    pool = PagePool(100, store, chunk_pages=16)
    pool.allocate(3)
    assert len(store.pages) == 16
    pool.allocate(20)
    assert len(store.pages) == 32


def test_refcounts_and_free_list():
    pool = PagePool(4, RecordingStore())
    (a,) = pool.allocate(1)
    pool.incref([a], 2)
    assert pool.refcount(a) == 3
    assert pool.decref([a, a]) == []
    assert pool.decref([a]) == [a]
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="below zero"):
        pool.decref([a])
    with pytest.raises(ValueError, match="not allocated"):
        pool.incref([a])


def test_scrub_on_reuse_only_for_used_pages():
    store = RecordingStore()
    pool = PagePool(4, store, chunk_pages=4)
    pages = pool.allocate(2)
    assert store.scrubbed == []  # fresh pages read as zero already
    store.pages[pages[0]][:] = b"secret!!"
    pool.decref(pages)
    again = pool.allocate(2)
    assert sorted(store.scrubbed) == sorted(pages)
    assert all(store.pages[p] == bytes(8) for p in again)


def test_scrub_off_keeps_bytes():
    store = RecordingStore()
    pool = PagePool(2, store, scrub_on_reuse=False)
    (p,) = pool.allocate(1)
    pool.decref([p])
    pool.allocate(1)
    assert store.scrubbed == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_allocate_arguments(bad):
    pool = PagePool(4, RecordingStore())
    with pytest.raises(ValueError):
        pool.allocate(bad)
    assert pool.num_free == 4


class PoolMachine(RuleBasedStateMachine):
    """The pool against a shadow dict of refcounts."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(12, RecordingStore(), chunk_pages=5)
        self.shadow: dict[int, int] = {}

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        free = 12 - len(self.shadow)
        if n > free:
            with pytest.raises(CacheFull):
                self.pool.allocate(n)
            return
        for p in self.pool.allocate(n):
            assert p not in self.shadow
            self.shadow[p] = 1

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), k=st.integers(1, 3))
    def incref(self, data, k):
        p = data.draw(st.sampled_from(sorted(self.shadow)))
        self.pool.incref([p], k)
        self.shadow[p] += k

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def decref(self, data):
        p = data.draw(st.sampled_from(sorted(self.shadow)))
        freed = self.pool.decref([p])
        self.shadow[p] -= 1
        if self.shadow[p] == 0:
            del self.shadow[p]
            assert freed == [p]
        else:
            assert freed == []

    @invariant()
    def matches_shadow(self):
        assert self.pool.num_used == len(self.shadow)
        for p in range(12):
            assert self.pool.refcount(p) == self.shadow.get(p, 0)
        assert set(self.pool._free).isdisjoint(self.shadow)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None
)
