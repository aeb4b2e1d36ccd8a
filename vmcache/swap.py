"""Moving a sequence out of a cache and into one: the host swap tier (a sequence's mapped K/V
copied out to host memory and its pages freed, then restored byte-identical into a free slot:
the engine's swap preemption) and the pieces a transfer between processes uses
(:mod:`vmcache.distributed.transfer`): a :class:`Manifest` (what a sequence is apart from its
K/V), :meth:`SwapOps.wires` (where its K/V lie, as few contiguous tensors as the layout
allows) and :meth:`SwapOps.adopt_sequence` (map a new sequence, fill it, all or nothing). A
sliding window's released front pages stay released: only what the tables map travels.

:class:`SwapTier` owns the tier's byte count; :class:`SwapOps` (operations of the sequence
coordinator) read the coordinator's lengths, ids and groups and call its physical hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .errors import CacheFull
from .tables import RELEASED


@dataclass(frozen=True)
class Manifest:
    """Sequence state apart from its K/V bytes: enough to map an equal sequence elsewhere."""

    length: int
    firsts: tuple[int, ...]  # per attention group: pages its window released at the front
    token_ids: tuple[int, ...] | None
    salt: object = None


@dataclass(eq=False)
class SwapHandle:
    """K/V of a swapped-out sequence, held in host memory until :meth:`swap_in`."""

    manifest: Manifest = field(repr=False)  # length, released pages, token ids, salt
    nbytes: int
    payload: list[torch.Tensor] = field(repr=False)  # per table: its Wire, packed (uint8)
    owner: int = field(repr=False)  # id() of the cache that made it
    consumed: bool = False

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
class Wire:
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


class SwapTier:
    """The host tier's limit and the bytes live handles hold (owned here)."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit = limit_bytes
        self.held_bytes = 0

    def check(self, nbytes: int) -> None:
        if self.limit is not None and self.held_bytes + nbytes > self.limit:
            free = self.limit - self.held_bytes
            raise CacheFull(f"host swap tier full: {nbytes} bytes wanted, {free} free of "
                            f"{self.limit}", wanted=nbytes, free=free)  # fmt: skip

    def hold(self, handle: SwapHandle) -> None:
        self.held_bytes += handle.nbytes

    def check_handle(self, cache, handle) -> None:
        if not isinstance(handle, SwapHandle):
            raise TypeError(f"swap_in needs a SwapHandle, got {type(handle).__name__}")
        if handle.owner != id(cache):
            raise ValueError("this SwapHandle was made by another cache")
        if handle.consumed:
            raise ValueError("this SwapHandle was already swapped in")

    def release(self, handle: SwapHandle) -> None:
        handle.consumed = True
        handle.payload = []
        self.held_bytes -= handle.nbytes


class SwapOps:
    """swap_out / swap_in: operations of :class:`~vmcache.seqcache.SequenceCache`."""

    def swap_out(self, s: int) -> SwapHandle:
        """Copy the sequence's mapped K/V to host memory and free its pages; returns a
        :class:`SwapHandle` for :meth:`swap_in`."""
        s = self._check_seq(s)
        self.swap.check(sum(w.nbytes for w in self.wires(s)))
        handle = self.export_sequence(s)
        self.swap.hold(handle)
        self.free(s)
        return handle

    def swap_in(self, handle: SwapHandle) -> int:
        """Restore a swapped-out sequence (byte-identical) into a free slot; returns it."""
        self.swap.check_handle(self, handle)
        s = self.import_sequence(handle)
        self.swap.release(handle)
        return s

    def swap_in_pages(self, handle: SwapHandle) -> int:
        """Pages :meth:`swap_in` maps for ``handle`` (a window's released pages excluded)."""
        return self.adopt_pages(handle.length, handle.manifest.firsts)

    def adopt_pages(self, length: int, firsts) -> int:
        """Pages a sequence of ``length`` tokens maps with ``firsts`` released per group."""
        return sum(len(g.ids) * (g.pages_for(length) - f) for g, f in zip(self.groups, firsts))

    def manifest(self, s: int) -> Manifest:
        s = self._check_seq(s)
        ids = None if self._tokens[s] is None else tuple(self._tokens[s])
        return Manifest(self._lens[s], tuple(g.first(s) for g in self.groups), ids,
                        self._salts[s])  # fmt: skip

    def can_adopt(self, m: Manifest, headroom_pages: int = 0) -> bool:
        """Whether :meth:`adopt_sequence` of ``m`` would find a slot and its pages now, with
        ``headroom_pages`` still free after."""
        need = self.adopt_pages(m.length, m.firsts) + headroom_pages
        return (bool(self._free_slots) and 0 < m.length <= self.max_seq_len
                and self.pool.can_allocate(need))  # fmt: skip

    def wires(self, s: int) -> list[Wire]:
        """Sequence ``s``'s mapped K/V, one :class:`Wire` per table (table order): zero-copy
        views a transfer sends from or receives into."""
        s = self._check_seq(s)
        return [self._wire(s, t, g.first(s), self._lens[s]) for g in self.groups for t in g.ids]

    def adopt_sequence(self, m: Manifest, fill: Callable[[int], None],
                       slot: int | None = None) -> int:  # fmt: skip
        """A new sequence (in ``slot``, else any free slot) of ``m.length`` tokens, mapped
        where ``m`` says (released pages stay released), whose K/V ``fill(s)`` writes (through
        :meth:`wires`); all or nothing: if ``fill`` raises, the sequence is
        freed and the error propagates. Token ids and salt are set once it is filled."""
        if m.length > self.max_seq_len:
            raise ValueError(f"{m.length} tokens exceed max_seq_len {self.max_seq_len}")
        if len(m.firsts) != len(self.groups):
            raise ValueError(f"manifest has {len(m.firsts)} groups, this cache {len(self.groups)}")
        s = self.new_sequence(slot, salt=m.salt)
        self._tokens[s] = None  # its pages hold no K/V yet: never index them
        try:
            ext = []
            for g, f in zip(self.groups, m.firsts):
                g.open(s, [[RELEASED] * f for _ in g.ids], f)
                ext.append((g, f, g.pages_for(m.length)))
            self._split_pages([], s, ext)
            self._set_len(s, m.length)
            fill(s)
        except BaseException:
            self.free(s)
            raise
        self._tokens[s] = None if m.token_ids is None else list(m.token_ids)
        return s

    def export_sequence(self, s: int) -> SwapHandle:
        """A host copy of sequence ``s`` (its mapped K/V, length, ids, salt); ``s`` stays."""
        pin = self.device.type == "cuda"
        payload = [torch.empty(w.nbytes, dtype=torch.uint8, pin_memory=pin).copy_(w.packed())
                   for w in self.wires(s)]  # fmt: skip
        nbytes = sum(p.numel() for p in payload)
        return SwapHandle(self.manifest(s), nbytes, payload, id(self))

    def import_sequence(self, handle: SwapHandle, slot: int | None = None) -> int:
        """A new sequence (in ``slot``, else any free slot) holding ``handle``'s K/V, mapped
        where they were (a window's released pages stay released); all or nothing."""

        def fill(s: int) -> None:
            for w, data in zip(self.wires(s), handle.payload, strict=True):
                w.unpack(data.to(self.device))

        return self.adopt_sequence(handle.manifest, fill, slot)
