"""The host swap tier: a sequence's K/V copied out to host memory and its pages freed, then
restored byte-identical into a free slot (the engine's swap preemption)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import CacheFull


@dataclass(eq=False)
class SwapHandle:
    """K/V of a swapped-out sequence, held in host memory until :meth:`swap_in`."""

    length: int
    nbytes: int
    payload: list[torch.Tensor] = field(repr=False)
    owner: int = field(repr=False)  # id() of the cache that made it
    consumed: bool = False
    token_ids: list[int] | None = field(default=None, repr=False)
    salt: object = field(default=None, repr=False)


class SwapOps:
    """swap_out / swap_in, mixed into :class:`~vmcache.seqcache.SequenceCache`, whose state
    (``_swap_limit``, ``_swapped_bytes``) and hooks (``_export``, ``_import``) they use."""

    def swap_out(self, s: int) -> SwapHandle:
        """Copy the sequence's K/V to host memory and free its pages."""
        s = self._check_seq(s)
        length = self._lens[s]
        nbytes = self.spec.kv_bytes(length)
        if self._swap_limit is not None and self._swapped_bytes + nbytes > self._swap_limit:
            raise CacheFull(
                f"host swap tier full: {nbytes} bytes wanted, "
                f"{self._swap_limit - self._swapped_bytes} free of {self._swap_limit}",
                wanted=nbytes,
                free=self._swap_limit - self._swapped_bytes,
            )
        payload = self._export(s, length)
        ids, salt = self._tokens[s], self._salts[s]
        ids = None if ids is None else list(ids)
        self.free(s)
        self._swapped_bytes += nbytes
        return SwapHandle(length, nbytes, payload, id(self), token_ids=ids, salt=salt)

    def swap_in(self, handle: SwapHandle) -> int:
        """Restore a swapped-out sequence (byte-identical) into a free slot; returns it."""
        if not isinstance(handle, SwapHandle):
            raise TypeError(f"swap_in needs a SwapHandle, got {type(handle).__name__}")
        if handle.owner != id(self):
            raise ValueError("this SwapHandle was made by another cache")
        if handle.consumed:
            raise ValueError("this SwapHandle was already swapped in")
        s = self.new_sequence()
        try:
            self._salts[s] = handle.salt
            self.grow(s, handle.length, token_ids=handle.token_ids)
            self._import(s, handle.payload)
        except BaseException:
            self._tokens[s] = None  # its pages hold no K/V: never index them
            self.free(s)
            raise
        handle.consumed = True
        handle.payload = []
        self._swapped_bytes -= handle.nbytes
        return s
