"""Prefix tiers (host RAM, disk) under both caches: demoted pages come back byte-identical,
one file and one copy per batch, LRU and byte limits per tier, checksums turn damage into a
miss, salts stay apart in every tier, a directory outlives its cache; and the prefix machine
with tiers under it, where any wrong page served shows in its content check."""

import shutil
import tempfile
from collections import Counter

import pytest
from caches import examples, record_coverage
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test
from prefix_machine import PrefixMachine, append, make, tpp
from tier_cases import cache, cached, hit, kvt

from vmcache import CacheFull
from vmcache.prefix.tiers import PrefixTiers
from vmcache.prefix.tiers.digest import page_digest, salt_bytes
from vmcache.prefix.tiers.disk import file_bytes
from vmcache.sequences.invariants import check_invariants

KINDS = ["vm", "vm_token_major", "paged"]


@pytest.fixture
def tmp(tmp_path):
    return tmp_path / "tier"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["host", "disk", "host+disk"])
def test_demoted_prefix_comes_back_byte_identical(kind, where, tmp):
    host = 1 << 20 if "host" in where else 0
    disk = dict(disk_dir=tmp, disk_bytes=1 << 22) if "disk" in where else {}
    c = cache(kind, PrefixTiers(host, **disk))
    P = tpp(c)
    A = [1] * P + [2] * P + [0, 1] * (P // 2) + [7]  # three full pages and a tail
    cached(c, A)
    T = c.prefix.tier_stats().demoted_pages // 3
    assert c.prefix.cached_tokens(A) == 3 * P  # the tiers count, no I/O yet
    assert hit(c, A) == 3 * P
    st_, ps = c.prefix.tier_stats(), c.prefix.index.stats()
    assert ps.tier_hit_tokens == 3 * P and ps.cached_pages == 3 * T
    assert st_.promoted_host_pages + st_.promoted_disk_pages == 3 * T
    assert st_.device_copies == 2  # one copy down for the chain, one back up
    if where == "disk":  # one file written for the chain, one read for its promotion
        assert (st_.disk_files_written, st_.disk_files_read) == (1, 1)
        assert st_.promoted_disk_pages == 3 * T
    # promoted pages are ordinary cached pages: evicted again, the disk keeps its file
    c.prefix.index.clear()
    assert hit(c, A) == 3 * P
    assert c.prefix.tier_stats().disk_files_written == (1 if "disk" in where and not host else 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", ["data", "table", "truncate", "grow", "delete"])
def test_a_damaged_tier_file_is_a_miss(kind, damage, tmp):
    c = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    P = tpp(c)
    A = [1] * P + [2] * P + [3]
    cached(c, A)
    (path,) = c.prefix.index.tiers.disk.files()
    raw = bytearray(path.read_bytes())
    if damage == "data":  # the last byte: the chain's root page (the leaf is evicted first)
        raw[-1] ^= 0x40
    elif damage == "table":
        raw[60] ^= 1
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "grow":
        raw += b"\0"
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(raw))
    assert hit(c, A) == 0  # the content check inside: never a damaged page
    st_ = c.prefix.tier_stats()
    assert st_.corrupt_files == 1 and st_.disk_bytes == 0  # a vanished file counts too
    assert not path.exists() and len(c.prefix.index.tiers.disk) == 0
    cached(c, A)  # recomputed, written again, and then served
    assert hit(c, A) == 2 * P


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_salts_stay_apart_in_every_tier(kind, tmp):
    c = cache(kind, PrefixTiers(1, disk_dir=tmp, disk_bytes=1 << 22))  # 1 byte: all to disk
    P = tpp(c)
    A = [4] * (2 * P)
    cached(c, A, salt="tenant-a")
    assert c.prefix.tier_stats().disk_files_written == 1
    assert hit(c, A, salt="tenant-b") == 0 and hit(c, A) == 0 and hit(c, A, salt=b"tenant-a") == 0
    assert hit(c, A, salt="tenant-a") == 2 * P
    with pytest.raises(TypeError, match="salt"):
        c.new_sequence(prefix_tokens=A, salt=1.5)  # no name outside this process
    assert c.sequences == [] and c.prefix.index.stats().lookups == 5  # the refusal changed nothing


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_each_tier_evicts_least_recently_used_within_its_byte_limit(kind, tmp):
    probe = cache(kind, None) if kind == "vm" else make(kind, pages=16)
    entry = (
        probe.capacity.pages_for_tokens(tpp(probe)) * probe.config.page_bytes
    )  # one page per table
    # two entries in RAM, two one-entry files on disk
    c = cache(kind, PrefixTiers(2 * entry, disk_dir=tmp, disk_bytes=2 * file_bytes(1, entry)))
    P, tiers = tpp(c), c.prefix.index.tiers
    assert tiers.entry_bytes == entry
    prompts = [[i] * P for i in range(5)]  # one page each
    for p in prompts:  # each evicted on its own: host overflow goes to disk a file at a time
        cached(c, p)
    # RAM: 3, 4 (newest); disk: 1, 2 (0's file was the oldest, dropped)
    held = [c.prefix.cached_tokens(p) // P for p in prompts]
    assert held == [0, 1, 1, 1, 1]
    assert len(tiers.host) == 2 and len(tiers.disk) == 2
    st_ = c.prefix.tier_stats()
    assert st_.dropped_pages == st_.demoted_pages // 5  # prompt 0's entry, of five
    assert hit(c, prompts[1]) == P  # from disk; its file is now the most recently used
    cached(c, prompts[1])  # back to RAM: 3 goes to disk, and 2's file (oldest) is dropped
    held = [c.prefix.cached_tokens(p) // P for p in prompts]
    assert held == [0, 1, 0, 1, 1]


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_directory_serves_the_next_cache_of_the_same_layout_and_namespace(kind, tmp):
    """One PrefixTiers per directory at a time (the next one opens it once the last closed)."""
    c = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22, namespace="model-a"))
    P = tpp(c)
    A = [3] * (2 * P)
    cached(c, A)
    c.close()
    other = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22, namespace="model-b"))
    assert hit(other, A) == 0 and len(kvt(tmp)) == 1  # not its file: left alone
    cached(other, [9] * P)  # model-b's own file
    other.close()
    wider = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22, namespace="model-a"),
                  max_seq_len=512)  # fmt: skip
    assert hit(wider, A) == 2 * P  # max_seq_len is not part of a page's bytes
    wider.close()
    again = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22, namespace="model-a"))
    assert hit(again, A) == 2 * P
    again.prefix.index.clear()
    again.prefix.index.tiers.clear()  # this namespace's files go, model-b's stays
    assert hit(again, A) == 0 and again.prefix.cached_tokens(A) == 0
    assert len(kvt(tmp)) == 1
    again.close()
    other = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22, namespace="model-b"))
    assert hit(other, [9] * P) == P


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_promotion_takes_only_the_room_there_is(kind, tmp):
    c = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22), pages=12 if kind == "vm" else 8)
    P = tpp(c)
    A = [1] * P + [2] * P + [3]
    cached(c, A)
    per_page = c.capacity.pages_for_tokens(P)
    hog = c.new_sequence()
    c.grow(hog, (c._pool.num_pages // per_page - 1) * P)  # all but one page per table
    assert hit(c, A) == P  # one page of two came back, no CacheFull
    c.free(hog)
    c.prefix.index.clear()
    assert hit(c, A) == 2 * P  # the rest stayed on disk
    hog = c.new_sequence()
    c.grow(hog, c._pool.num_pages // per_page * P)  # everything
    s = c.new_sequence(prefix_tokens=A)
    assert c.seq_len(s) == 0  # no room at all: a miss, not an error
    with pytest.raises(CacheFull):
        c.grow(s, 1)


def test_bad_tier_input(tmp):
    with pytest.raises(ValueError, match="no tier"):
        PrefixTiers()
    with pytest.raises(ValueError):
        PrefixTiers(-1)
    with pytest.raises(ValueError, match="together"):
        PrefixTiers(disk_dir=tmp)
    with pytest.raises(ValueError, match="together"):
        PrefixTiers(disk_bytes=10)
    with pytest.raises(TypeError):
        PrefixTiers(10, namespace=3)
    with pytest.raises(ValueError, match="prefix_caching"):
        from caches import SPEC

        from vmcache.paged_fallback import PagedKVCache

        PagedKVCache(SPEC, num_blocks=8, prefix_tiers=PrefixTiers(10))
    with pytest.raises(TypeError, match="PrefixTiers"):
        make("paged", prefix_tiers=object())
    tiers = PrefixTiers(10)
    make("paged", prefix_tiers=tiers)
    with pytest.raises(ValueError, match="one cache"):
        make("paged", prefix_tiers=tiers)


class TieredPrefixMachine(PrefixMachine):
    """The prefix machine with a small host tier and a disk tier under its index: every
    eviction demotes, lookups promote, and a rule damages disk files; the inherited content
    check fails on any page served from the wrong prefix, salt or a damaged file."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="vmcache-tiers-")
        super().__init__()
        kind = type(self).kind
        entry = self.c.capacity.pages_for_tokens(tpp(self.c)) * self.c.config.page_bytes
        self.c.close()
        pages = 48 if kind == "vm" else 24
        tiers = PrefixTiers(entry, disk_dir=self.dir, disk_bytes=40 * entry)
        self.c = make(kind, pages=pages, max_seqs=6, max_seq_len=160, prefix_tiers=tiers)
        self.seen = TIER_COVERAGE.setdefault(kind, Counter())

    def teardown(self):
        try:
            st_ = self.c.prefix.index.stats()
            self.seen["tier hit tokens"] += st_.tier_hit_tokens
            self.seen["corrupt files"] += self.c.prefix.tier_stats().corrupt_files
            super().teardown()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule()
    def demote_every_cached_page(self):
        self.c.prefix.index.clear()  # what the pool does piecemeal when it runs short
        self.seen["demote all"] += 1

    @precondition(lambda self: len(self.c.prefix.index.tiers.disk) > 0)
    @rule(data=st.data(), offset=st.integers(0, 1 << 20))
    def damage_a_file(self, data, offset):
        """Demote what the device caches, then flip a byte of a tier file: of the seeded
        prompt's first page if the disk holds it (then looked up, so the damage is met),
        else of any file."""
        disk, ix = self.c.prefix.index.tiers.disk, self.c.prefix.index
        ix.clear()
        root = page_digest(ix.root, salt_bytes(None), self.seeded[: tpp(self.c)])
        files = disk.files()
        where = disk._where.get(root)  # noqa: SLF001
        path = disk.dir / where[0] if where else data.draw(st.sampled_from(files))
        raw = bytearray(path.read_bytes())
        if where:  # a byte of that page's entry (header and table damage: the unit tests)
            n = len(disk._files[where[0]].digests)  # noqa: SLF001
            offset = file_bytes(n, 0) + where[1] * disk.entry_bytes + offset % disk.entry_bytes
        raw[offset % len(raw)] ^= 0xFF
        path.write_bytes(bytes(raw))
        self.seen["damaged files"] += 1
        try:  # the next request for the seeded prompt (checked by the content invariant)
            s = self.c.new_sequence(prefix_tokens=self.seeded)
        except CacheFull:
            return
        self.tokens[s] = self.seeded[: self.c.seq_len(s)]


TIER_COVERAGE: dict[str, Counter] = {}


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_the_tiered_prefix_machine_really_promotes(kind):
    """A fixed-seed run serves pages from the tiers often and meets damaged files (the
    machine would pass if the tiers never answered otherwise)."""
    TIER_COVERAGE.pop(kind, None)
    machine = type(f"Tiered{kind}", (TieredPrefixMachine,), {"kind": kind})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None, derandomize=True,
        database=None))  # fmt: skip
    seen = TIER_COVERAGE[kind]
    assert seen["tier hit tokens"] >= 256, seen
    assert seen["corrupt files"] >= 1, seen
    record_coverage(f"tiered prefix machine {kind}", seen)


def _machine(kind):
    case = type(f"Tiered{kind}", (TieredPrefixMachine,), {"kind": kind}).TestCase
    case.settings = settings(max_examples=examples(30), stateful_step_count=30, deadline=None)
    return case


TestVMTieredPrefixMachine = _machine("vm")
TestPagedTieredPrefixMachine = _machine("paged")


@pytest.mark.parametrize("kind", KINDS)
def test_a_sleep_that_keeps_nothing_leaves_the_prefixes_in_the_tiers(kind, tmp):
    c = cache(kind, PrefixTiers(1 << 20, disk_dir=tmp, disk_bytes=1 << 22))
    P = tpp(c)
    A, B = [1] * P + [2] * P + [3], [5] * P + [6]
    s = c.new_sequence(prefix_tokens=A)
    append(c, s, A)
    c.free(s)  # A cached, unreferenced
    live = c.new_sequence(prefix_tokens=B)
    append(c, live, B)
    c.prefix.publish(live)  # B cached and mapped by a live sequence
    c.elastic.sleep(keep="none")
    assert c.prefix.index.stats().cached_pages == 0
    c.elastic.wake()
    assert c.seq_len(live) == len(B) and c.kv(1, live)[0].abs().sum() == 0  # zeros, as said
    assert hit(c, A) == 2 * P and hit(c, B) == P  # both served from the tiers, checked
    c.free(live)
    check_invariants(c)
