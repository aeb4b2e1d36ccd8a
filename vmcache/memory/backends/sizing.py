"""SizingBackend: the page bookkeeping of a real backend with no bytes behind it.

For sizing runs at real model scale (Llama-3-70B, tens of GB of KV) on any machine: address
ranges are reserved from a counter, pages are ids, map/unmap only check and count, and views
are ``meta`` tensors (shape and strides, no storage), so every cache operation runs its real
bookkeeping — page tables, refcounts, copy-on-write splits — while K/V writes cost nothing.
Results from it are labelled "sizing"; it never backs data.
"""

from __future__ import annotations

import torch

from vmcache.memory.backends.base import round_up


class SizingBackend:
    device = torch.device("meta")

    def __init__(self, granularity: int = 2 << 20, page_size: int | None = None) -> None:
        self.granularity = granularity
        self.default_page_size = round_up(page_size or granularity, granularity)
        self._next_va = granularity  # never 0
        self._next_page = 0
        self.live_pages = 0
        self.mapped_pages = 0  # page mappings in place (windows included)
        self.map_calls = self.unmap_calls = 0

    def reserve(self, nbytes: int) -> int:
        va = self._next_va
        self._next_va += round_up(nbytes, self.granularity) + self.granularity
        return va

    def release_reservation(self, va: int, nbytes: int) -> None:
        pass

    def create_page(self, page_size: int) -> int:
        if page_size % self.granularity:
            raise ValueError(f"page_size {page_size} is not a multiple of {self.granularity}")
        self._next_page += 1
        self.live_pages += 1
        return self._next_page

    def release_page(self, handle: int) -> None:
        self.live_pages -= 1

    def map(self, va: int, handles: list, page_size: int) -> None:
        if va % self.granularity:
            raise ValueError(f"map at {va:#x}: not a multiple of {self.granularity}")
        self.mapped_pages += len(handles)
        self.map_calls += 1

    def unmap(self, va: int, npages: int, page_size: int) -> None:
        if npages > self.mapped_pages:
            raise ValueError(f"unmap of {npages} pages: only {self.mapped_pages} are mapped")
        self.mapped_pages -= npages
        self.unmap_calls += 1

    def zero_page(self, handle, view: torch.Tensor) -> None:
        pass

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass
