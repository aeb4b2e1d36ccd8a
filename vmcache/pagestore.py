"""Physical pages of a virtual-memory backend, each also mapped once in a private window.

    window:  [ page 0 | page 1 | page 2 | ... | page N-1 ]   (one reservation, N × P bytes)

Every page the pool creates is mapped at ``window + id × P`` for its whole life, besides
wherever sequences map it. The window gives the pool and the caches a stable address for any
page, so copy-on-write, scrubbing and swapping are plain tensor copies with no extra mapping.
"""

from __future__ import annotations

from typing import Any

import torch

from .backends.base import Backend


class VMPageStore:
    def __init__(self, backend: Backend, page_size: int, num_pages: int) -> None:
        self.backend = backend
        self.page_size = page_size
        self.num_pages = num_pages
        self.window = backend.reserve(num_pages * page_size)
        self._window_view = backend.view(self.window, num_pages * page_size)
        self._handles: list[Any] = []  # page id -> backend handle; owned here

    def handle(self, page: int) -> Any:
        return self._handles[page]

    def handles(self, pages: list[int]) -> list[Any]:
        h = self._handles
        return [h[p] for p in pages]

    def view(self, page: int) -> torch.Tensor:
        """The page's bytes: a ``uint8`` tensor of ``page_size`` elements on the device."""
        return self._window_view[page * self.page_size : (page + 1) * self.page_size]

    def create(self, start: int, count: int) -> None:
        if start != len(self._handles):
            raise ValueError(f"pages are created in order: expected {len(self._handles)}, "
                             f"got {start}")  # fmt: skip
        made: list[Any] = []
        try:
            for _ in range(count):
                made.append(self.backend.create_page(self.page_size))
            self.backend.map(self.window + start * self.page_size, made, self.page_size)
        except Exception:
            for h in made:
                self.backend.release_page(h)
            raise
        self._handles.extend(made)
        if self.backend.device.type != "cpu":  # new device memory is not zeroed; memfd is
            self._window_view[start * self.page_size : (start + count) * self.page_size].zero_()

    def scrub(self, pages: list[int]) -> None:
        for p in pages:
            self.backend.zero_page(self._handles[p], self.view(p))

    def close(self) -> None:
        if self._handles:
            self.backend.unmap(self.window, len(self._handles), self.page_size)
            for h in self._handles:
                self.backend.release_page(h)
            self._handles.clear()
        self.backend.release_reservation(self.window, self.num_pages * self.page_size)
