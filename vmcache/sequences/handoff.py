"""A sequence as it moves between caches and processes (``cache.handoff``): its
:class:`Manifest` (what it is apart from its K/V), its :class:`TableRuns` per table (where its K/V
lie, as few contiguous tensors as the layout allows), ``adopt`` (map a new sequence where a
manifest says and fill it, all or nothing), and a host copy of a sequence (``export`` /
``load``, a :class:`SwapHandle`: the swap tier uses them). A sliding window's released pages
stay released: only what the tables map travels. :mod:`vmcache.distributed.handoff` sends
these between processes.

Touches, through the core it is handed (:mod:`.core`): lengths, token ids, salts (read;
``adopt`` sets the new sequence's), the groups' page lists (read), ``new_sequence`` / ``free``,
the cache's ``runs`` hook and the transactional core (``tx.adopt``); the pool only through
those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Manifest:
    """Sequence state apart from its K/V bytes: enough to map an equal sequence elsewhere."""

    length: int
    firsts: tuple[int, ...]  # per attention group: pages its window released at the front
    token_ids: tuple[int, ...] | None
    salt: object = None


@dataclass(eq=False)
class SwapHandle:
    """K/V of a swapped-out sequence, held in host memory until ``cache.swap.restore``."""

    manifest: Manifest = field(repr=False)  # length, released pages, token ids, salt
    nbytes: int
    payload: list[torch.Tensor] = field(repr=False)  # per table: its TableRuns, packed (uint8)
    owner: int = field(repr=False)  # id() of the cache that made it
    consumed: bool = False
    spec: object = field(default=None, repr=False)  # what the bytes mean (dtypes, scales)

    @property
    def length(self) -> int:
        return self.manifest.length

    def __repr__(self) -> str:
        return (f"SwapHandle(length={self.length}, nbytes={self.nbytes}, "
                f"consumed={self.consumed})")  # fmt: skip


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (what transfers send)."""
    return x.reshape(-1).view(torch.uint8)


@dataclass(eq=False)
class TableRuns:
    """One table's mapped K/V of one sequence as contiguous tensors (``views``, in order):
    what a transfer sends, or receives into, without a copy. ``packed()`` is all of them as
    one flat uint8 tensor (the view itself when there is one; else a copy, by ``gather`` when
    given) and ``unpack(buf)`` the inverse (by ``scatter``): one message for one copy."""

    views: list[torch.Tensor]
    gather: Callable[[], torch.Tensor] | None = None
    scatter: Callable[[torch.Tensor], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.views)

    def packed(self) -> torch.Tensor:
        if len(self.views) == 1:
            return as_bytes(self.views[0])
        if self.gather is not None:
            return as_bytes(self.gather())
        return torch.cat([as_bytes(v) for v in self.views])

    def unpack(self, buf: torch.Tensor) -> None:
        """Write ``buf`` (flat uint8, :attr:`nbytes`) into the views."""
        if len(self.views) == 1 and buf.data_ptr() == self.views[0].data_ptr():
            return
        if self.scatter is not None:
            return self.scatter(buf)
        i = 0
        for v in self.views:
            n = v.numel() * v.element_size()
            as_bytes(v).copy_(buf[i : i + n])
            i += n


class Handoff:
    """``cache.handoff``: manifests, runs, adoption and host copies of sequences."""

    def __init__(self, core) -> None:
        self._c = core

    def layout(self) -> tuple:
        """What both sides of a hand-off must share for bytes to mean the same K/V, per
        attention group: (its tables, its window, a token's units, a page's units)."""
        return tuple((tuple(g.ids), g.window, g.u, g.P) for g in self._c.groups)

    def releasable_pages(self, length: int) -> list[int]:
        """Per group, the most leading pages a ``length``-token sequence may have released
        (its window rule: never one a next step reads); what a received manifest is checked
        against."""
        return [g.keep_page(length, 0) for g in self._c.groups]

    def manifest(self, s: int) -> Manifest:
        c = self._c
        s = c.check_seq(s)
        slots = c.seqs
        ids = slots.tokens(s)
        return Manifest(slots.length(s), tuple(g.first(s) for g in c.groups),
                        None if ids is None else tuple(ids), slots.salt(s))  # fmt: skip

    def can_adopt(self, m: Manifest, headroom_pages: int = 0) -> bool:
        """Whether :meth:`adopt` of ``m`` would find a slot and its pages now, with
        ``headroom_pages`` still free after."""
        c = self._c
        need = self.adopt_pages(m.length, m.firsts) + headroom_pages
        return (c.seqs.num_free > 0 and 0 < m.length <= c.config.max_seq_len
                and c.pool.can_allocate(need))  # fmt: skip

    def adopt_pages(self, length: int, firsts) -> int:
        """Pages a sequence of ``length`` tokens maps with ``firsts`` released per group."""
        c = self._c
        return sum(len(g.ids) * (g.pages_for(length) - f) for g, f in zip(c.groups, firsts))

    def runs(self, s: int) -> list[TableRuns]:
        """Sequence ``s``'s mapped K/V, one :class:`TableRuns` per table (table order): zero-copy
        views a transfer sends from or receives into."""
        c = self._c
        s = c.check_seq(s)
        return [c.runs(s, t, g.first(s), c.seqs.length(s)) for g in c.groups for t in g.ids]

    def adopt(self, m: Manifest, fill: Callable[[int], None],
                       slot: int | None = None) -> int:  # fmt: skip
        """A new sequence (in ``slot``, else any free slot) of ``m.length`` tokens, mapped
        where ``m`` says (released pages stay released), whose K/V ``fill(s)`` writes (through
        :meth:`runs`); all or nothing: if ``fill`` raises, the sequence is
        freed and the error propagates. Token ids and salt are set once it is filled."""
        c = self._c
        if m.length > c.config.max_seq_len:
            raise ValueError(f"{m.length} tokens exceed max_seq_len {c.config.max_seq_len}")
        if len(m.firsts) != len(c.groups):
            raise ValueError(f"manifest has {len(m.firsts)} groups, this cache {len(c.groups)}")
        s = c.cache.new_sequence(slot, salt=m.salt)
        c.seqs.set_tokens(s, None)  # its pages hold no K/V yet: never index them
        try:
            c.tx.adopt(s, list(m.firsts), m.length)
            c.set_len(s, m.length)
            fill(s)
        except BaseException:
            c.cache.free(s)
            raise
        c.seqs.set_tokens(s, m.token_ids)
        return s

    def export(self, s: int) -> SwapHandle:
        """A host copy of sequence ``s`` (its mapped K/V, length, ids, salt); ``s`` stays."""
        c = self._c
        pin = c.config.device.type == "cuda"
        payload = [torch.empty(w.nbytes, dtype=torch.uint8, pin_memory=pin).copy_(w.packed())
                   for w in self.runs(s)]  # fmt: skip
        nbytes = sum(p.numel() for p in payload)
        return SwapHandle(self.manifest(s), nbytes, payload, id(c), spec=c.spec)

    def load(self, handle: SwapHandle, slot: int | None = None) -> int:
        """A new sequence (in ``slot``, else any free slot) holding ``handle``'s K/V, mapped
        where they were (a window's released pages stay released); all or nothing. A handle
        of another spec (shape, storage dtype, FP8/INT8 scales) is refused: its bytes would
        mean other K/V here."""
        c = self._c
        if handle.spec is not None and handle.spec != c.spec:
            raise ValueError(f"this handle holds K/V of {handle.spec}, not of this cache's "
                             f"{c.spec}")  # fmt: skip

        def fill(s: int) -> None:
            for w, data in zip(self.runs(s), handle.payload, strict=True):
                w.unpack(data.to(c.config.device))

        return self.adopt(handle.manifest, fill, slot)
