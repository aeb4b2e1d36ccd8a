"""PagedKVCache's kernel-facing views (``cache.views``): block pools and block tables beside
what :class:`~vmcache.sequences.views.Views` shares. Read only."""

from __future__ import annotations

import torch

from vmcache.sequences.views import Views


class PagedViews(Views):
    def k_pool(self, layer: int) -> torch.Tensor:
        """``[num_blocks, B, N_KV, d_h]`` K blocks of ``layer`` (read through the block
        table of :meth:`table_of_layer`)."""
        return self._c.block_pool(self._c.check_layer(layer), 0)

    def v_pool(self, layer: int) -> torch.Tensor:
        return self._c.block_pool(self._c.check_layer(layer), 1)

    def table_of_layer(self, layer: int) -> int:
        """The block table ``layer`` reads (0 unless the model mixes attention types)."""
        return self._c.table_of_layer(self._c.check_layer(layer))

    def block_row(self, s: int, table: int) -> list[int]:
        """Block table ``table`` of live sequence ``s`` (not copied, not checked; ``RELEASED``
        (-1) where a sliding window gave a block back)."""
        return self._c.group_of[table].row(s, table)

    def block_tables(self, seq_ids: list[int], layer: int = 0) -> torch.Tensor:
        """``[len(seq_ids), max_blocks]`` int32 on the device: ``layer``'s block tables,
        padded with 0, and 0 where a sliding window released a block (kernels read neither:
        they stop at each sequence's length and start at its window)."""
        c = self._c
        t = self.table_of_layer(layer)
        tabs = [self.block_row(c.check_seq(s), t) for s in seq_ids]
        width = max([len(r) for r in tabs] + [1])
        out = torch.zeros((len(tabs), width), dtype=torch.int32)
        for i, r in enumerate(tabs):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int32).clamp_(min=0)
        return out.to(c.config.device)
