"""StrictBackend: the CUDA driver's page rules, enforced over any backend (a test double for
the contract, and a debugging aid: ``VMKVCache(..., backend=StrictBackend(HostBackend()))``).

The host backend accepts things the CUDA driver refuses: 4 KiB pages, mapping over a mapped
page (``MAP_FIXED`` replaces it), unmapping what is not mapped. Code that only ever ran on the
host can therefore break on its first GPU run. This wrapper refuses, with a
:class:`PageRuleError` naming the CUDA call that would fail, everything the driver would:

    cuMemAddressReserve  size a multiple of the granularity; base aligned to it
    cuMemCreate          size a multiple of the granularity
    cuMemMap             address and size at the granularity, inside one reservation, nothing
                         mapped there already, a live handle (access is set in the same call)
    cuMemUnmap           whole mappings only (each page address starts a mapping of that size)
    cuMemRelease         the handle is live (and, by our protocol, mapped nowhere)
    cuMemAddressFree     the exact reservation, with nothing mapped inside it

``granularity`` defaults to CUDA's 2 MiB. It also counts ``synchronize`` calls, so tests can
check how often the caches wait for the device.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from vmcache.errors import DriverError
from vmcache.memory.backends.base import Backend, round_up

CUDA_GRANULARITY = 2 << 20  # cuMemGetAllocationGranularity(MINIMUM) on every current GPU


class PageRuleError(DriverError):
    """A call the CUDA driver would refuse (``call`` names the driver call)."""

    def __init__(self, call: str, detail: str) -> None:
        super().__init__(call, "CUDA_ERROR_INVALID_VALUE (page rule)", detail)


class StrictBackend:
    """Wraps ``inner``; see the module docstring. Owns ``inner`` (closes it)."""

    def __init__(self, inner: Backend, granularity: int = CUDA_GRANULARITY) -> None:
        if granularity <= 0 or granularity % inner.granularity:
            raise ValueError(
                f"granularity {granularity} must be a positive multiple of the inner "
                f"backend's {inner.granularity}"
            )
        self.inner = inner
        self.device = inner.device
        self.granularity = granularity
        self.default_page_size = round_up(inner.default_page_size, granularity)
        self._reservations: dict[int, tuple[int, int, int]] = {}  # va -> (size, inner va, size)
        self._starts: list[int] = []  # sorted reservation bases, for lookups
        self._handles: dict[Any, int] = {}  # live handle -> page size
        self._mapped: dict[int, tuple[int, Any]] = {}  # mapping start -> (size, handle)
        self._granules: dict[int, int] = {}  # mapped granule index -> its mapping's start
        self._mapped_handles: dict[Any, int] = {}  # handle -> number of live mappings
        self.sync_calls = 0  # synchronize() calls so far
        self.map_calls = self.unmap_calls = 0
        self.create_calls = self.release_calls = 0  # pages created / released so far
        self.closed = False

    # --- rules ---------------------------------------------------------------------------
    def _aligned(self, call: str, what: str, value: int) -> None:
        if value % self.granularity:
            raise PageRuleError(
                call, f"{what} {value:#x} is not a multiple of the {self.granularity}-byte "
                "granularity"
            )  # fmt: skip

    def _reservation_of(self, call: str, va: int, nbytes: int) -> int:
        i = bisect.bisect_right(self._starts, va) - 1
        if i >= 0:
            base = self._starts[i]
            if va + nbytes <= base + self._reservations[base][0]:
                return base
        raise PageRuleError(call, f"[{va:#x}, +{nbytes}) is not inside one reservation")

    # --- the protocol --------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        self._aligned("cuMemAddressReserve", "size", nbytes)
        g = self.granularity
        inner_size = nbytes + g  # room to align the base up to the granularity
        inner_va = self.inner.reserve(inner_size)
        va = round_up(inner_va, g)
        self._reservations[va] = (nbytes, inner_va, inner_size)
        bisect.insort(self._starts, va)
        return va

    def release_reservation(self, va: int, nbytes: int) -> None:
        if va not in self._reservations:
            raise PageRuleError("cuMemAddressFree", f"{va:#x} is not a reservation base")
        size, inner_va, inner_size = self._reservations[va]
        if round_up(nbytes, self.granularity) != size:
            raise PageRuleError("cuMemAddressFree", f"size {nbytes} != reserved {size}")
        inside = [a for a in self._mapped if va <= a < va + size]
        if inside:
            raise PageRuleError(
                "cuMemAddressFree", f"{len(inside)} page(s) still mapped in [{va:#x}, +{size})"
            )
        self.inner.release_reservation(inner_va, inner_size)
        del self._reservations[va]
        self._starts.remove(va)

    def live_handles(self) -> int:
        """Pages created and not yet released (what a leak check counts)."""
        return len(self._handles)

    def create_page(self, page_size: int) -> Any:
        self._aligned("cuMemCreate", "size", page_size)
        h = self.inner.create_page(page_size)
        self._handles[h] = page_size
        self.create_calls += 1
        return h

    def release_page(self, handle: Any) -> None:
        if handle not in self._handles:
            raise PageRuleError("cuMemRelease", f"unknown or released handle {handle!r}")
        if self._mapped_handles.get(handle):
            raise PageRuleError(
                "cuMemRelease", f"handle {handle!r} is still mapped "
                f"{self._mapped_handles[handle]} time(s)"
            )  # fmt: skip
        self.inner.release_page(handle)
        del self._handles[handle]
        self.release_calls += 1

    def map(self, va: int, handles: list[Any], page_size: int) -> None:
        self._aligned("cuMemMap", "address", va)
        self._aligned("cuMemMap", "size", page_size)
        self._reservation_of("cuMemMap", va, len(handles) * page_size)
        for i, h in enumerate(handles):
            addr = va + i * page_size
            if self._handles.get(h) != page_size:
                raise PageRuleError("cuMemMap", f"handle {h!r} is not a live {page_size}-byte page")
            hit = self._overlapping(addr, page_size)
            if hit is not None:
                raise PageRuleError("cuMemMap", f"{addr:#x} is already mapped (at {hit:#x})")
        self.inner.map(va, handles, page_size)
        self.map_calls += 1
        g = self.granularity
        for i, h in enumerate(handles):
            addr = va + i * page_size
            self._mapped[addr] = (page_size, h)
            self._mapped_handles[h] = self._mapped_handles.get(h, 0) + 1
            for k in range(addr // g, (addr + page_size) // g):
                self._granules[k] = addr

    def _overlapping(self, addr: int, size: int) -> int | None:
        g = self.granularity
        for k in range(addr // g, (addr + size) // g):
            if k in self._granules:
                return self._granules[k]
        return None

    def unmap(self, va: int, npages: int, page_size: int) -> None:
        if npages <= 0:
            return
        for i in range(npages):
            addr = va + i * page_size
            got = self._mapped.get(addr)
            if got is None or got[0] != page_size:
                raise PageRuleError(
                    "cuMemUnmap", f"{addr:#x} does not start a mapping of {page_size} bytes"
                )
        self.inner.unmap(va, npages, page_size)
        self.unmap_calls += 1
        g = self.granularity
        for i in range(npages):
            addr = va + i * page_size
            _, h = self._mapped.pop(addr)
            self._mapped_handles[h] -= 1
            for k in range(addr // g, (addr + page_size) // g):
                del self._granules[k]

    def zero_page(self, handle: Any, view: torch.Tensor) -> None:
        if handle not in self._handles:
            raise PageRuleError("cuMemsetD8", f"unknown or released handle {handle!r}")
        self.inner.zero_page(handle, view)

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        if nbytes:
            self._reservation_of("view", va, nbytes)
        return self.inner.view(va, nbytes)

    def synchronize(self) -> None:
        self.sync_calls += 1
        self.inner.synchronize()

    def mapped_pages(self) -> int:
        """Page mappings in place now (the caches' page windows included)."""
        return len(self._mapped)

    def close(self) -> None:
        if not self.closed:
            self.inner.close()
            self.closed = True

    def __enter__(self) -> StrictBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
