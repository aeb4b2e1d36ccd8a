"""What attention kernels read of a cache (``cache.views``): the K/V tensors, the window and
scales of a layer, each sequence's lengths and page tables, and the plan memo the kernels own.
Read only: nothing here changes a sequence. ``VMViews`` is VMKVCache's (whole virtual K/V
tensors, one row per sequence); PagedKVCache's adds block pools and block tables
(:mod:`vmcache.paged_fallback.views`).

Touches, through the core it is handed (:mod:`.core`): lengths (read, through ``Slots``), page
tables (read), the epoch it bumps on every length or table change (read), the layer checks, and
the cache's K/V views.
"""

from __future__ import annotations

import torch


class Views:
    """``cache.views``: the kernel-facing side both caches share."""

    def __init__(self, core) -> None:
        self._c = core
        # the kernels' per-step plans for callers that hold no memo of their own, and how many
        # plans were built (device uploads): vmcache.kernels.plan writes both
        self.plans: dict = {}
        self.plans_built = 0

    def check_layer(self, layer: int) -> int:
        """``layer``, or ``ValueError`` / ``TypeError`` when it is not one of the model's."""
        return self._c.check_layer(layer)

    def lengths(self, seq_ids) -> list[int]:
        """The token lengths of live sequences ``seq_ids`` (batch order; not checked)."""
        return self._c.seqs.lengths(seq_ids)

    @property
    def epoch(self) -> int:
        """Bumped whenever a length or a page table changes: a plan built at one epoch is
        valid while it stands."""
        return self._c.epoch

    def window_start(self, layer: int, s: int) -> int:
        """The first position of ``s`` whose K/V layer ``layer`` still maps (0 unless its
        sliding window released pages)."""
        return self._c.window_start(layer, s)

    def window_start_after_grow(self, layer: int, s: int, length: int) -> int:
        """The first position layer ``layer`` of ``s`` keeps mapped once a grow past
        ``length`` tokens has run (0 for full attention)."""
        c = self._c
        g = c.group_of[c.tables_of_layer(layer)[0]]
        return g.first_token_after_grow(s, length)

    def page_table(self, s: int) -> list[list[int]]:
        """A copy of sequence ``s``'s page tables (``T`` lists of page ids, table order;
        ``RELEASED`` (-1) where a sliding window gave a page back)."""
        return self._c.page_table(s)

    def stored_rows(self, layer: int, kv: int) -> torch.Tensor:
        """The stored rows of ``layer``'s K (``kv`` 0) or V (1), in the storage dtype:
        ``[max_seqs, max_seq_len, R]`` (VMKVCache; mapped only up to each sequence's length)
        or ``[num_blocks, B, R]`` (PagedKVCache), R = ``spec.row_elems``."""
        return self._c.rows(self._c.check_layer(layer), kv)

    def decode(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Stored rows ``[..., R]`` of ``layer`` (from :meth:`stored_rows`) → K and V
        ``[..., N_KV, d_h]`` in the compute dtype: views unless FP8/INT8 (dequantized)."""
        return self._c.decode(layer, k, v)

    def synchronize(self) -> None:
        """Wait until no kernel may still write the cache (before reading its bytes from
        another stream or process)."""
        self._c.sync()

    def kv_scales_for(self, layer: int):
        """What a kernel dequantizes ``layer``'s K/V with: fp32 ``[2, N_KV]`` head scales, or
        per token the pair of fp32 views ``[..., N_KV]`` over K's and V's stored rows, or
        None when K/V are not quantized."""
        return self._c.kv_scales_for(layer)


class VMViews(Views):
    """VMKVCache's views: whole virtual tensors, row ``s`` is sequence ``s``'s range."""

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s whole virtual K tensor ``[max_seqs, max_seq_len, N_KV, d_h]``
        (strided in ``token_major``). Only each sequence's first ``seq_len`` rows are mapped."""
        return self._c.layer_view(self._c.check_layer(layer), 0)

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._c.layer_view(self._c.check_layer(layer), 1)

    def layer_row_tokens(self, layer: int) -> int:
        """Tokens one padded row of ``layer``'s tensors spans (a whole number: rows are
        padded to whole pages and whole tokens of every table); token t of row s is row
        ``s·row_tokens + t`` of the layer's flat varlen view."""
        return self._c.layer_row_tokens(layer)
