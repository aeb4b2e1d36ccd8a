"""The host swap tier (``cache.swap``): a sequence's mapped K/V copied out to host memory and
its pages freed (``out``), then restored byte-identical into a free slot (``restore``): the
engine's swap preemption. The facet owns the tier's limit and the bytes live handles hold.

Touches, through the core it is handed (:mod:`.core`): ``cache.handoff`` (export, load, runs,
adopt_pages) and ``free``; nothing else.
"""

from __future__ import annotations

from vmcache.errors import CacheFull
from vmcache.sequences.handoff import SwapHandle


class Swap:
    """``cache.swap``: the host tier's limit and held bytes (owned here), swap out and in."""

    def __init__(self, core, limit_bytes: int | None) -> None:
        self._c = core
        self.limit = limit_bytes
        self.held_bytes = 0  # bytes of the handles not yet restored (owned here)

    def _check(self, nbytes: int) -> None:
        if self.limit is not None and self.held_bytes + nbytes > self.limit:
            free = self.limit - self.held_bytes
            raise CacheFull(f"host swap tier full: {nbytes} bytes wanted, {free} free of "
                            f"{self.limit}", wanted=nbytes, free=free)  # fmt: skip

    def _hold(self, handle: SwapHandle) -> None:
        self.held_bytes += handle.nbytes

    def _check_handle(self, cache, handle) -> None:
        if not isinstance(handle, SwapHandle):
            raise TypeError(f"swap.restore needs a SwapHandle, got {type(handle).__name__}")
        if handle.owner != id(cache):
            raise ValueError("this SwapHandle was made by another cache")
        if handle.consumed:
            raise ValueError("this SwapHandle was already swapped in")

    def _release(self, handle: SwapHandle) -> None:
        handle.consumed = True
        handle.payload = []
        self.held_bytes -= handle.nbytes

    def out(self, s: int) -> SwapHandle:
        """Copy the sequence's mapped K/V to host memory and free its pages; returns a
        :class:`SwapHandle` for :meth:`restore`."""
        c = self._c
        s = c.check_seq(s)
        self._check(sum(w.nbytes for w in c.cache.handoff.runs(s)))
        handle = c.cache.handoff.export(s)
        self._hold(handle)
        c.cache.free(s)
        return handle

    def restore(self, handle: SwapHandle) -> int:
        """Restore a swapped-out sequence (byte-identical) into a free slot; returns it."""
        c = self._c
        self._check_handle(c, handle)
        s = c.cache.handoff.load(handle)
        self._release(handle)
        return s

    def discard(self, handle: SwapHandle) -> None:
        """Drop a swapped-out sequence's host copy without restoring it (its request was
        aborted): the tier's bytes are free again; the handle cannot be restored after."""
        self._check_handle(self._c, handle)
        self._release(handle)

    def restore_pages(self, handle: SwapHandle) -> int:
        """Pages :meth:`restore` maps for ``handle`` (a window's released pages excluded)."""
        c = self._c
        return c.cache.handoff.adopt_pages(handle.length, handle.manifest.firsts)
