"""The host swap tier: a sequence's mapped K/V copied out to host memory and its pages freed,
then restored byte-identical into a free slot (the engine's swap preemption). A sliding
window's released front pages stay released: only what the tables map travels.

:class:`SwapTier` owns the tier's byte count; :class:`SwapOps` (operations of the sequence
coordinator) read the coordinator's lengths, ids and groups and call its export/import hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import CacheFull
from .tables import RELEASED


@dataclass(eq=False)
class SwapHandle:
    """K/V of a swapped-out sequence, held in host memory until :meth:`swap_in`."""

    length: int
    nbytes: int
    payload: list[torch.Tensor] = field(repr=False)  # one per table, from its first mapped page
    owner: int = field(repr=False)  # id() of the cache that made it
    consumed: bool = False
    token_ids: list[int] | None = field(default=None, repr=False)
    salt: object = field(default=None, repr=False)
    firsts: list[int] = field(default_factory=list, repr=False)  # released pages, per group


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
        self.swap.check(self._held_bytes(s))
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
        return sum(len(g.ids) * (g.pages_for(handle.length) - f)
                   for g, f in zip(self.groups, handle.firsts))  # fmt: skip

    def export_sequence(self, s: int) -> SwapHandle:
        """A host copy of sequence ``s`` (its mapped K/V, length, ids, salt); ``s`` stays."""
        s = self._check_seq(s)
        length = self._lens[s]
        payload = [self._export_table(s, t, g.first(s), length)
                   for g in self.groups for t in g.ids]  # fmt: skip
        ids = None if self._tokens[s] is None else list(self._tokens[s])
        firsts = [g.first(s) for g in self.groups]
        return SwapHandle(length, self._held_bytes(s), payload, id(self), token_ids=ids,
                          salt=self._salts[s], firsts=firsts)  # fmt: skip

    def import_sequence(self, handle: SwapHandle, slot: int | None = None) -> int:
        """A new sequence (in ``slot``, else any free slot) holding ``handle``'s K/V, mapped
        where they were (a window's released pages stay released); all or nothing."""
        if handle.length > self.max_seq_len:
            raise ValueError(f"{handle.length} tokens exceed max_seq_len {self.max_seq_len}")
        s = self.new_sequence(slot, salt=handle.salt)
        self._tokens[s] = None  # its pages hold no K/V yet: never index them
        try:
            ext = []
            for g, f in zip(self.groups, handle.firsts):
                g.open(s, [[RELEASED] * f for _ in g.ids], f)
                ext.append((g, f, g.pages_for(handle.length)))
            self._split_pages([], s, ext)
            self._set_len(s, handle.length)
            data = iter(handle.payload)
            for g in self.groups:
                for t in g.ids:
                    self._import_table(s, t, g.first(s), next(data))
        except BaseException:
            self.free(s)
            raise
        self._tokens[s] = None if handle.token_ids is None else list(handle.token_ids)
        return s
