"""The physical-memory protocol: what a cache needs from virtual memory, nothing more.

A backend reserves virtual address ranges, creates physical pages (opaque handles), maps
handles at page-aligned addresses inside a reservation, unmaps them, and turns an address
range into a zero-copy ``uint8`` tensor. The same handle may be mapped at several
addresses at once; writes through one address are read through every other (aliasing).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Backend(Protocol):
    device: torch.device
    granularity: int  # smallest legal page size in bytes, queried from the OS / driver
    default_page_size: int  # the page size a cache uses when none is given

    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of address space (a multiple of ``granularity``); return its base."""

    def release_reservation(self, va: int, nbytes: int) -> None:
        """Give back a range from :meth:`reserve` (everything in it must be unmapped)."""

    def create_page(self, page_size: int) -> Any:
        """Create one physical page of ``page_size`` bytes and return its handle."""

    def release_page(self, handle: Any) -> None:
        """Destroy a page created by :meth:`create_page` (it must be unmapped everywhere)."""

    def map(self, va: int, handles: list[Any], page_size: int) -> None:
        """Map ``handles[i]`` at ``va + i * page_size``, read-write. All or nothing."""

    def unmap(self, va: int, npages: int, page_size: int) -> None:
        """Unmap ``npages`` pages starting at ``va``. It does not wait for the device: the
        caller synchronises first (once per operation) if a kernel may still read them."""

    def zero_page(self, handle: Any, view: torch.Tensor) -> None:
        """Make a page read as zeros (``view`` is a mapped uint8 view of it)."""

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        """A zero-copy 1-D ``uint8`` tensor over ``[va, va + nbytes)`` on :attr:`device`."""

    def synchronize(self) -> None:
        """Wait until no device work may still touch mapped memory."""

    def close(self) -> None:
        """Release every page, mapping and reservation; idempotent."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def runs(values: list[int], step: int) -> list[tuple[int, int]]:
    """Split ``values`` into runs where each is the previous + ``step`` (file-contiguous page
    offsets, consecutive page ids): ``[(start index, count), ...]``."""
    out: list[tuple[int, int]] = []
    for i, v in enumerate(values):
        if out and values[i - 1] + step == v:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out
