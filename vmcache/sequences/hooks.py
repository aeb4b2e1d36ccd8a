"""The physical hooks each cache implements under the coordinator: how the K/V of table t of
sequence s, from page j0 to its token length, are mapped, copied, stored, read and moved
(VMKVCache: driver mappings over a virtual range; PagedKVCache: block tables over a pool).
The coordinator, its transactions and its facets call these and nothing physical else.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PhysicalHooks(Protocol):
    """What a cache implements (subclassed explicitly: the defaults raise, or do nothing where
    nothing is needed). ``tests/project/test_architecture.py`` fails on a physical call the
    coordinator, its transactions or its facets make that is not declared here."""

    def _attach(self, s: int, t: int, j0: int, pages: list[int]) -> None:
        raise NotImplementedError

    def _detach(self, s: int, t: int, j0: int, n: int) -> None:
        raise NotImplementedError

    def _page(self, p: int, units: int) -> torch.Tensor:
        """Physical page ``p``'s first ``units`` units, as a view that writes through."""
        raise NotImplementedError

    def _copy_page(self, src: int, dst: int, used_units: int) -> None:
        self._copy_pages([(src, dst, used_units)])

    def _copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        """``(source, destination, units)`` copies as one simultaneous assignment: a source
        that is also a destination is read before anything is written (the pages of a beam
        swap form a cycle: a ← b, b ← a)."""
        if not copies or self._page(copies[0][0], 1).is_meta:
            return  # nothing, or pages without bytes (the sizing backend: bookkeeping only)
        dsts = {d for _, d, _ in copies}
        staged = {s: self._page(s, u).clone() for s, _, u in copies if s in dsts}
        for s, d, u in copies:
            self._page(d, u).copy_(staged[s] if s in staged else self._page(s, u))

    def _tables_of_layer(self, layer: int) -> list[int]:
        raise NotImplementedError

    def _rows(self, layer: int, kv: int) -> torch.Tensor:
        """The stored rows of ``layer``'s K (``kv`` 0) or V (1): ``[max_seqs, max_seq_len, R]``
        (VMKVCache) or ``[num_blocks, B, R]`` (PagedKVCache), R = ``spec.row_elems``."""
        raise NotImplementedError

    def _flat_rows(self, layer: int, kv: int) -> torch.Tensor:
        """``layer``'s stored K (``kv`` 0) or V (1) rows as one ``[rows, R]`` view, the rows
        :meth:`_flat_index` numbers (a step's writes and reads are one indexed copy each)."""
        raise NotImplementedError

    def _flat_index(self, layer: int, seqs: torch.Tensor, positions: torch.Tensor):
        """int64 ``[B, n]`` rows of :meth:`_flat_rows` holding position ``positions[b, j]``
        of sequence ``seqs[b, 0]`` (host int64 ``[B, 1]`` and ``[B, n]``; mapped positions
        only)."""
        raise NotImplementedError

    def _seq_rows(self, layer: int, kv: int) -> torch.Tensor | None:
        """``[max_seqs, L_row, R]`` where every sequence's rows of ``layer`` lie in one range
        of its own (VMKVCache: :meth:`_rows`; a step reads its batch there in place), or
        None where they are scattered over blocks (PagedKVCache: a step gathers them)."""
        return None

    def _store_flat(self, layer: int, index: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:  # fmt: skip
        """Stored rows ``[n, R]`` of K and V written at rows ``index`` (int64 ``[n]``, on the
        device) of :meth:`_flat_rows`: a step's writes of every sequence, one copy each."""
        for kv, x in ((0, k), (1, v)):
            _bits(self._flat_rows(layer, kv)).index_copy_(0, index, _bits(x.detach()))

    def _store(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stored rows ``[n, R]`` of K and V written at positions ``start…start+n``."""
        raise NotImplementedError

    def _load(self, layer: int, s: int, positions: torch.Tensor):  # stored rows [n, R] copies
        raise NotImplementedError

    def _runs(self, s: int, t: int, j0: int, length: int):  # handoff.TableRuns over the pages
        raise NotImplementedError

    def _sync(self) -> None:
        pass

    def _read_pages(self, pages: list[int], pin: bool = False) -> torch.Tensor:
        """uint8 ``[len(pages), page_bytes]`` host copy of ``pages`` (one copy; prefix tiers,
        sleep); ``pin``: page-locked where the cache can (VMKVCache), for a fast copy back."""
        raise NotImplementedError

    def _write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Inverse of :meth:`_read_pages` (pages no sequence maps)."""
        raise NotImplementedError

    def _release_all(self, live: list[int], keep: bool):
        """Sleep: before the pool releases every page, ``live`` pages' bytes copied to the
        host when ``keep``, every mapping dropped; returns the state :meth:`_restore_all`
        takes back."""
        raise NotImplementedError

    def _restore_all(self, live: list[int], state) -> None:
        """Wake: after the pool created ``live`` again, their contents back (unless
        :meth:`_wake_fill` wrote them) and every sequence mapped where it was."""
        raise NotImplementedError

    def _device_bytes(self) -> int:
        """Device bytes the cache's storage holds now, where the pool does not count them
        (PagedKVCache's one preallocated tensor)."""
        raise NotImplementedError

    def _wake_fill(self, live: list[int], state):
        """A fill the pool calls as each chunk of ``live`` exists again on wake (VMKVCache),
        or None: ``_restore_all`` restores the contents."""
        return None


def _bits(x: torch.Tensor) -> torch.Tensor:
    """FP8 rows as their bytes: torch's indexed copies have no FP8 kernels on the CPU."""
    return x.view(torch.uint8) if x.dtype.itemsize == 1 and x.dtype.is_floating_point else x
