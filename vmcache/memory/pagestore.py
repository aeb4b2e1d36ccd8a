"""Physical pages of a virtual-memory backend, each also mapped once in a private window.

    window:  [ page 0 | page 1 | page 2 | ... | page N-1 ]   (one reservation, N × P bytes)

Every page the pool creates is mapped at ``window + id × P`` for its whole life, besides
wherever sequences map it. The window gives the pool and the caches a stable address for any
page, so copy-on-write, scrubbing and swapping are plain tensor copies with no extra mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vmcache.memory.backends.base import Backend, runs

CREATE_CHUNK = 64  # pages a wake creates before it writes their bytes
STAGE_BYTES = 64 << 20  # one pinned staging buffer (two alternate)


class Stager:
    """Host-to-device copies through two pinned buffers of at most :data:`STAGE_BYTES` each,
    asynchronous on the current stream: the host fills one buffer while the device reads the
    other, so a wake's copies overlap its next page creations. On the CPU, plain copies.
    ``finish()`` waits for the last copy (before the host buffers may change)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: list[torch.Tensor] = []
        self._events: list = []
        self._next = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (uint8, on the device) = ``src`` (uint8, host), in pieces of a buffer."""
        if self.device.type != "cuda":
            dst.copy_(src)
            return
        if not self._bufs:
            size = min(STAGE_BYTES, max(src.numel(), 1))
            self._bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in "ab"]
            self._events = [None, None]
        size = self._bufs[0].numel()
        for lo in range(0, src.numel(), size):
            n = min(size, src.numel() - lo)
            k = self._next
            if self._events[k] is not None:
                self._events[k].synchronize()  # the device finished reading this buffer
            buf = self._bufs[k][:n]
            buf.copy_(src[lo : lo + n])
            dst[lo : lo + n].copy_(buf, non_blocking=True)
            self._events[k] = torch.cuda.Event()
            self._events[k].record()
            self._next = 1 - k

    def finish(self) -> None:
        for e in self._events:
            if e is not None:
                e.synchronize()


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

    def create(self, pages: list[int], fill: Callable[[list[int]], None] | None = None,
               chunk: int = CREATE_CHUNK) -> None:  # fmt: skip
        """Create ``pages`` (ascending ids) and map each at its window slot; all or nothing.
        With ``fill``, pages are created ``chunk`` at a time and ``fill(chunk_pages)`` runs
        after each chunk is mapped (a wake writes the chunk's bytes while, on a GPU, the
        copy overlaps the next chunk's ``cuMemCreate`` calls)."""
        made: list[Any] = []  # handles, in the order of ``pages``
        mapped: list[tuple[int, int]] = []  # (first id, count) of runs mapped
        P = self.page_size
        step = chunk if fill is not None else max(1, len(pages))
        try:
            for lo in range(0, len(pages), step):
                part = pages[lo : lo + step]
                for _ in part:
                    made.append(self.backend.create_page(P))
                for i, n in runs(part, 1):
                    self.backend.map(self.window + part[i] * P, made[lo + i : lo + i + n], P)
                    mapped.append((part[i], n))
                for p, h in zip(part, made[lo:]):
                    self._handles[p] = h
                if self.backend.device.type != "cpu" and fill is None:  # device memory comes
                    for i, n in runs(part, 1):  # unzeroed (a fill writes every byte itself)
                        self._window_view[part[i] * P : (part[i] + n) * P].zero_()
                if fill is not None:
                    fill(part)
        except Exception:
            for first, n in mapped:
                self.backend.unmap(self.window + first * P, n, P)
            for p, h in zip(pages, made):
                self.backend.release_page(h)
                self._handles[p] = None
            raise

    def read(self, pages: list[int], pin: bool = False) -> torch.Tensor:
        """``[len(pages), page_size]`` uint8 host copy of ``pages``: one copy per run of
        consecutive ids, straight from each page's own bytes in the window into the host
        tensor, which is exactly that size (no gather on the device, no second copy: a sleep
        needs no device memory beyond what it holds). ``pin``: the host tensor is pinned."""
        P = self.page_size
        out = torch.empty((len(pages), P), dtype=torch.uint8, pin_memory=pin)
        flat = out.view(-1)
        for i, n, first in self._runs(pages):
            flat[i * P : (i + n) * P].copy_(self._window_view[first * P : (first + n) * P])
        return out

    def write(self, pages: list[int], data: torch.Tensor, stager: Stager | None = None) -> None:
        """Inverse of :meth:`read`: one host-to-device copy per run of consecutive ids, into
        the pages' own bytes (``data`` is never copied to the device whole); through
        ``stager`` (pinned, asynchronous) when given."""
        P = self.page_size
        flat = data.reshape(-1)
        if flat.numel() != len(pages) * P:
            raise ValueError(f"{flat.numel()} bytes for {len(pages)} pages of {P}")
        for i, n, first in self._runs(pages):
            dst = self._window_view[first * P : (first + n) * P]
            if stager is not None:
                stager.copy(dst, flat[i * P : (i + n) * P])
            else:
                dst.copy_(flat[i * P : (i + n) * P])

    @staticmethod
    def _runs(pages: list[int]):
        """(index in ``pages``, count, first id) of each run of consecutive ids."""
        return [(i, n, pages[i]) for i, n in runs(pages, 1)]

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
