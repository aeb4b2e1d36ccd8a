"""The cache state machine both caches run (tests/properties/test_interface.py, and the elastic
machine built on it in tests/sequences/test_elastic.py): random grow / write / fork / assign /
truncate / write_group / reserve / free / swap against a plain-Python shadow of every token
row, DESIGN.md's invariants after every step, and what each run reached counted in
COVERAGE; the pools per cache kind that make it run out; a machine class per name."""

from collections import Counter

import caches
import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vmcache import CacheFull
from vmcache.sequences.invariants import check_invariants

COVERAGE: dict[str, Counter] = {}  # machine name -> what its runs reached (see below)


class CacheMachine(RuleBasedStateMachine):
    """Random grow/write/fork/assign/truncate/write_group/reserve/free/swap against a shadow
    dict of token rows, with pools small enough (12–14 pages) that they really run out. Every
    CacheFull must leave stats, page tables, lengths and contents as they were; what the runs
    reach (pool exhaustion, copy-on-write splits, swap round trips) is counted in COVERAGE."""

    factory = None
    name = ""
    windows = (None, None)  # per layer: a sliding window W, or None
    rollback = 0  # the cache's rollback_tokens
    tokens_per_page = 1
    stored = staticmethod(lambda x: x)  # what the cache gives back for written K/V x

    def __init__(self):
        super().__init__()
        self.c = type(self).factory()
        self.seen = COVERAGE.setdefault(type(self).name, Counter())
        self.shadow: dict[int, list[torch.Tensor]] = {}  # seq -> per layer [len, 2, 2, 16]
        self.swapped: list[tuple[object, list[torch.Tensor], int]] = []  # handle, K/V, top
        self.counter = 0
        self.dirty: set[int] = set()  # truncated: regrown positions may hold its old bytes
        self.top: dict[int, int] = {}  # seq -> its length right after its last grow

    def teardown(self):
        for s in list(self.shadow):
            self.c.free(s)
        self.c.elastic.set_limit(self.c._pool.num_pages * self.c.config.page_bytes)
        st_ = self.c.stats()
        assert st_.physical_pages == 0 and st_.free_pages == st_.total_pages
        check_invariants(self.c)
        self.c.close()

    def _value(self, n):
        self.counter += 1
        return torch.full((n, 2, 2, 16), float(self.counter))

    seqs = property(lambda self: sorted(self.shadow))

    def _snapshot(self):
        c = self.c
        return (c.stats(), {s: (c.seq_len(s), c.views.page_table(s)) for s in c.sequences},
                {s: [torch.stack(c.kv(layer, s), 1).clone() for layer in range(2)]
                 for s in c.sequences})  # fmt: skip

    def attempt(self, op, fn):
        """Run ``fn``; on CacheFull check that nothing changed and count why it was full.
        Returns True when ``fn`` completed."""
        before = self._snapshot()
        copies = self.c.stats().cow_copies
        try:
            fn()
        except CacheFull:
            after = self._snapshot()
            assert before[0] == after[0], f"{op}: CacheFull changed the stats"
            assert before[1] == after[1], f"{op}: CacheFull changed page tables or lengths"
            for s in before[2]:
                for x, y in zip(before[2][s], after[2][s]):
                    assert torch.equal(x.nan_to_num(7.5), y.nan_to_num(7.5)), op
            slots = self.c.capacity.free_slots
            kind = "slots full" if op in ("new", "fork") and slots < 3 else "pool full"
            event(f"{op}: {kind}")
            self.seen[kind] += 1
            return False
        if self.c.stats().cow_copies > copies:
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
        self.shadow[s] = [self.stored(val).clone() for _ in range(2)]  # one tensor each
        (kid,) = self.c.fork(s, 1)
        self.shadow[kid] = [self.stored(val).clone() for _ in range(2)]
        self.top[s] = self.top[kid] = n

    @precondition(lambda self: len(self.shadow) < 5)  # a full slot table comes from fork
    @rule()
    def new(self):
        got = []
        if not self.attempt("new", lambda: got.append(self.c.new_sequence())):
            assert len(self.shadow) == self.c.config.max_seqs
            return
        self.shadow[got[0]] = [torch.empty(0, 2, 2, 16) for _ in range(2)]
        self.top[got[0]] = 0

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(0, 70))
    def grow(self, data, n):
        s = data.draw(st.sampled_from(self.seqs))
        before = len(self.shadow[s][0])
        if before + n > self.c.config.max_seq_len:
            return
        released = self.c.stats().window_released_pages
        trusted = self.c.can_grow(s, n)  # a scheduler's answer, counting the window's release
        ok = self.attempt("grow", lambda: self.c.grow(s, n))
        assert ok == trusted, (s, n, trusted)
        if not ok:
            return
        if self.c.stats().window_released_pages > released:
            self.seen["window release"] += 1
        prev = self.top.get(s, 0)  # the greatest length it reached (a release point)
        if n:
            self.top[s] = max(prev, before + n)
        for layer, w in enumerate(self.windows):  # what the window no longer needs is gone
            if w is not None and n:
                gone = max(0, before - w + 1 - self.rollback)  # the next query or a rollback
                tpp = self.tokens_per_page  # by k tokens reads nothing before `gone`
                ws = self.c.views.window_start(layer, s)
                # at most: the next query's window, and a rollback by k from the greatest
                # length a release happened at (a rollback since may have used the margin)
                most = min(
                    max(0, before - w + 1), max(0, max(before, prev) - w + 1 - self.rollback)
                )
                assert gone // tpp * tpp <= ws <= most, (layer, before, prev, ws)
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
        if start < self.c.views.window_start(layer, s):  # released positions cannot be written
            with pytest.raises(ValueError, match="sliding window"):
                self.c.write(layer, s, start, val[:, 0], val[:, 1])
            return
        if not self.attempt("write", lambda: self.c.write(layer, s, start, val[:, 0], val[:, 1])):
            return
        self.shadow[s][layer][start : start + n] = self.stored(val)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        s = data.draw(st.sampled_from(self.seqs))
        kids = []
        if not self.attempt("fork", lambda: kids.extend(self.c.fork(s, n))):
            return
        for k in kids:
            self.shadow[k] = [t.clone() for t in self.shadow[s]]
            self.top[k] = self.top.get(s, 0)
            if s in self.dirty:
                self.dirty.add(k)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def assign(self, data):
        dsts = data.draw(st.lists(st.sampled_from(self.seqs), min_size=1, unique=True))
        srcs = [data.draw(st.sampled_from(self.seqs)) for _ in dsts]
        self.c.beams.assign(dsts, srcs)
        before = {s: [t.clone() for t in self.shadow[s]] for s in srcs}
        dirty = {s for s in srcs if s in self.dirty}
        top = {s: self.top.get(s, 0) for s in srcs}
        for d, s in zip(dsts, srcs):
            self.shadow[d] = [t.clone() for t in before[s]]
            self.top[d] = top[s]
            (self.dirty.add if s in dirty else self.dirty.discard)(d)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(0, 70))
    def reserve(self, data, n):
        s = data.draw(st.sampled_from(self.seqs))
        self.c.allocate(s, 0, ahead=n)  # best effort; contents and lengths do not change

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self._truncate(s, data.draw(st.integers(0, len(self.shadow[s][0]))))

    @precondition(lambda self: self.shadow and any(self.windows))
    @rule(data=st.data())
    def roll_back(self, data):
        """Speculative decoding's rollback: a few tokens, around the window's margin."""
        s = data.draw(st.sampled_from(self.seqs))
        back = data.draw(st.integers(0, self.rollback + 2 * self.tokens_per_page))
        self._truncate(s, max(0, len(self.shadow[s][0]) - back))

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), k=st.integers(1, 5))
    def speculate(self, data, k):
        """Speculative decoding's step: grow by a token and k drafts (can_grow truthful),
        write them, then keep a verified run and truncate the rest, which must always be
        possible within the rollback margin (k <= rollback_tokens on a sliding window)."""
        s = data.draw(st.sampled_from(self.seqs))
        if self.windows and any(self.windows):
            k = min(k, self.rollback)
        before = len(self.shadow[s][0])
        if before + 1 + k > self.c.config.max_seq_len:
            return
        trusted = self.c.can_grow(s, 1 + k)
        ok = self.attempt("grow", lambda: self.c.grow(s, 1 + k))
        assert ok == trusted, (s, k, trusted)
        if not ok:
            return
        self.top[s] = max(self.top.get(s, 0), before + 1 + k)
        fill = float("nan") if s in self.dirty else 0.0
        for layer in range(2):
            self.shadow[s][layer] = torch.cat([self.shadow[s][layer],
                                               torch.full((1 + k, 2, 2, 16), fill)])  # fmt: skip
        val = self._value(1 + k)
        for layer in range(2):
            if before < self.c.views.window_start(layer, s):
                continue  # the window already left these positions
            if not self.attempt("write", lambda layer=layer: self.c.write(
                    layer, s, before, val[:, 0], val[:, 1])):  # fmt: skip
                continue
            self.shadow[s][layer][before:] = self.stored(val)
        self.dirty.add(s)
        self.seen["speculate"] += 1
        if not any(self.windows or ()) and k and data.draw(st.booleans()):
            # a token tree's accepted path: any ascending picks among the drafts, compacted
            picks = sorted(data.draw(st.sets(st.integers(before + 1, before + k), max_size=k)))
            if self.attempt("compact", lambda: self.c.beams.compact(s, before + 1, picks)):
                self.shadow[s] = [torch.cat([t[: before + 1], t[picks]]) for t in self.shadow[s]]
                return
        keep = before + 1 + data.draw(st.integers(0, k))  # the token, then accepted drafts
        self.c.beams.truncate(s, keep)  # never refused: within the margin of this grow
        self.shadow[s] = [t[:keep] for t in self.shadow[s]]

    def _truncate(self, s, length):
        needed = {i: max(0, length - w + 1) for i, w in enumerate(self.windows) if w}
        if any(x < self.c.views.window_start(i, s) for i, x in needed.items()):
            # a rollback within the margin of the last grow must always be possible
            assert length < self.top.get(s, 0) - self.rollback, (s, length, self.top.get(s))
            with pytest.raises(ValueError, match="rollback_tokens"):  # past the margin
                self.c.beams.truncate(s, length)
            self.seen["truncate refused"] += 1
            return
        self.c.beams.truncate(s, length)
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
        if start < max(self.c.views.window_start(layer, s) for s in group):
            return
        if not self.attempt(
            "write_group",
            lambda: self.c.beams.write_group(layer, group, start, val[:, 0], val[:, 1]),
        ):
            return
        for s in group:
            self.shadow[s][layer][start : start + n] = self.stored(val)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self.c.free(s)
        del self.shadow[s]
        self.dirty.discard(s)
        self.top.pop(s, None)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self.swapped.append((self.c.swap.out(s), self.shadow.pop(s), self.top.pop(s, 0)))
        self.dirty.discard(s)  # swap_in restores exactly the written length

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self):
        h, content, top = self.swapped[0]
        got = []
        if not self.attempt("swap_in", lambda: got.append(self.c.swap.restore(h))):
            return
        self.swapped.pop(0)
        self.shadow[got[0]] = content
        self.top[got[0]] = top

    @invariant()
    def contents_match_shadow(self):
        for s, layers in self.shadow.items():
            assert self.c.seq_len(s) == len(layers[0])
            for layer, w in enumerate(self.windows):
                ws = self.c.views.window_start(layer, s)  # nothing before it is readable
                # the next query reads keys (L − W, L]: all of them must still be mapped
                assert ws == 0 if w is None else ws <= max(0, len(layers[0]) - w + 1), ws
                want = layers[layer][ws:]  # NaN: never written, anything may be read
                got = torch.stack(self.c.kv(layer, s), 1)
                assert got.shape == want.shape and bool(((got == want) | want.isnan()).all())
        check_invariants(self.c)


# 128 B token rows, 4 KiB pages: a 160-token sequence needs 20 pages (VM, both layouts) or
# 10 blocks (paged, B = 16); the pools hold 14-16 pages / 10 blocks, so they run out
POOLS = {"vm": {"pages": 16}, "vm_token_major": {"pages": 14}, "paged": {"blocks": 10}}
# INT8 per-token rows of 48 B: 160 tokens need 8 VM pages (both layouts) or 10 3-KiB blocks
QUANT_POOLS = {"vm": {"pages": 7}, "vm_token_major": {"pages": 6}, "paged": {"blocks": 10}}


def machine_class(name):
    base = name.removesuffix("_window").removesuffix("_int8_token")
    attrs = {"name": name}
    kw = dict(max_seqs=6, max_seq_len=160, **POOLS[base])
    if name.endswith("_int8_token"):  # tokens straddle VM pages; scales travel in each row
        kw.update(spec=caches.INT8_TOKEN, **QUANT_POOLS[base])
        attrs["stored"] = staticmethod(caches.int8_token_roundtrip)
    if name.endswith("_window"):  # layer 0 slides over 8 tokens, a rollback margin of 5
        kw.update(spec=caches.WINDOWED, rollback_tokens=5)
        # room for sequences long enough to leave the window (VM: 32 tokens a page)
        kw.update(blocks=20) if base == "paged" else kw.update(pages=2 * POOLS[base]["pages"])
        attrs.update(windows=caches.WINDOWED.layer_windows, rollback=5,
                     tokens_per_page=16 if base == "paged" else 32)  # fmt: skip
    attrs["factory"] = staticmethod(lambda: caches.FACTORIES[base](**kw))
    return type(f"{name}Machine", (CacheMachine,), attrs)
