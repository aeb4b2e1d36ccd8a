"""Physical pages of a virtual-memory backend, each also mapped once in a private window.

    window:  [ page 0 | page 1 | page 2 | ... | page N-1 ]   (one reservation, N × P bytes)

Every page the pool creates is mapped at ``window + id × P`` for its whole life, besides
wherever sequences map it. The window gives the pool and the caches a stable address for any
page, so copy-on-write, scrubbing and swapping are plain tensor copies with no extra mapping.
"""

from __future__ import annotations

from typing import Any

import torch

from .backends.base import Backend, runs


class VMPageStore:
    def __init__(self, backend: Backend, page_size: int, num_pages: int) -> None:
        self.backend = backend
        self.page_size = page_size
        self.num_pages = num_pages
        self.window = backend.reserve(num_pages * page_size)
        self._window_view = backend.view(self.window, num_pages * page_size)
        self._handles: list[Any] = [None] * num_pages  # page id -> handle (None: no memory)

    def handle(self, page: int) -> Any:
        return self._handles[page]

    def handles(self, pages: list[int]) -> list[Any]:
        h = self._handles
        return [h[p] for p in pages]

    def view(self, page: int) -> torch.Tensor:
        """The page's bytes: a ``uint8`` tensor of ``page_size`` elements on the device."""
        return self._window_view[page * self.page_size : (page + 1) * self.page_size]

    def create(self, pages: list[int]) -> None:
        """Create ``pages`` (ascending ids) and map each at its window slot; all or nothing."""
        made: list[Any] = []  # handles, in the order of ``pages``
        mapped: list[tuple[int, int]] = []  # (first id, count) of runs mapped
        P = self.page_size
        try:
            for _ in pages:
                made.append(self.backend.create_page(P))
            for i, n in runs(pages, 1):
                self.backend.map(self.window + pages[i] * P, made[i : i + n], P)
                mapped.append((pages[i], n))
        except Exception:
            for first, n in mapped:
                self.backend.unmap(self.window + first * P, n, P)
            for h in made:
                self.backend.release_page(h)
            raise
        for p, h in zip(pages, made):
            self._handles[p] = h
        if self.backend.device.type != "cpu":  # new device memory is not zeroed; memfd is
            for first, n in mapped:
                self._window_view[first * P : (first + n) * P].zero_()

    def read(self, pages: list[int], pin: bool = False) -> torch.Tensor:
        """``[len(pages), page_size]`` uint8 host copy of ``pages`` (one gather, one copy)."""
        rows = self._window_view.view(self.num_pages, self.page_size)
        idx = torch.tensor(pages, dtype=torch.long, device=rows.device)
        out = torch.empty((len(pages), self.page_size), dtype=torch.uint8, pin_memory=pin)
        return out.copy_(rows[idx])

    def write(self, pages: list[int], data: torch.Tensor) -> None:
        """Inverse of :meth:`read`."""
        rows = self._window_view.view(self.num_pages, self.page_size)
        idx = torch.tensor(pages, dtype=torch.long, device=rows.device)
        rows[idx] = data.to(rows.device)

    def release(self, pages: list[int]) -> None:
        """Unmap ``pages`` from the window and give their memory back (cuMemRelease; on the
        host, a punched hole). Mappings elsewhere must be gone already."""
        P, ids = self.page_size, sorted(pages)
        for i, n in runs(ids, 1):
            self.backend.unmap(self.window + ids[i] * P, n, P)
        for p in pages:
            self.backend.release_page(self._handles[p])
            self._handles[p] = None

    def scrub(self, pages: list[int]) -> None:
        for p in pages:
            self.backend.zero_page(self._handles[p], self.view(p))

    def close(self) -> None:
        live = [p for p, h in enumerate(self._handles) if h is not None]
        if live:
            self.release(live)
        self.backend.release_reservation(self.window, self.num_pages * self.page_size)
