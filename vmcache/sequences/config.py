"""CacheConfig: what a cache was built with beside its model shape (:class:`KVSpec`), one
frozen record for both caches (``cache.config``). The arithmetic a scheduler plans with
lives on ``cache.capacity``; the kernels' views on ``cache.views``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheConfig:
    """``max_seqs`` sequence slots of at most ``max_seq_len`` tokens each, on ``device``;
    ``page_bytes``: one physical page (VMKVCache: ``page_size``; PagedKVCache: one block of
    every layer its table serves, K and V); ``layout``: ``"layer_major"`` /
    ``"token_major"`` (VMKVCache) or ``"paged"``; ``block_size`` (tokens a block) and
    ``num_blocks``: PagedKVCache's, None on VMKVCache."""

    max_seqs: int
    max_seq_len: int
    device: torch.device
    page_bytes: int
    layout: str
    block_size: int | None = None
    num_blocks: int | None = None
