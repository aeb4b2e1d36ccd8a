"""The host-RAM tier: demoted prefix pages as host tensors, least recently used first out.

put(items)  newest last  ->  [ oldest ... newest ]  ->  over the byte limit, the oldest
                                                        leave (returned: the disk tier's)
take(d)     a hit leaves this tier (its bytes go back to the device)
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # owned here; LRU order
        self.bytes = 0  # sum of the held tensors' bytes (owned here)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items

    def __len__(self) -> int:
        return len(self._items)

    def put(self, items: list[tuple[bytes, torch.Tensor]]) -> list[tuple[bytes, torch.Tensor]]:
        """Hold ``items`` ((digest, uint8 CPU tensor), least recently used first); returns
        the items the byte limit pushes out, least recently used first (possibly some of
        ``items`` themselves)."""
        for d, blob in items:
            if d in self._items:
                self._items.move_to_end(d)
                continue
            self._items[d] = blob
            self.bytes += blob.numel()
        out = []
        while self.bytes > self.limit_bytes:
            d, blob = self._items.popitem(last=False)
            self.bytes -= blob.numel()
            out.append((d, blob))
        return out

    def take(self, digest: bytes) -> torch.Tensor | None:
        blob = self._items.pop(digest, None)
        if blob is not None:
            self.bytes -= blob.numel()
        return blob

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0
