"""PagedKVCache: vLLM-style block tables over preallocated block pools, the A/B twin of
VMKVCache behind the same interface.

Memory: one tensor ``[N_L, 2, num_blocks, B, N_KV, d_h]`` (NHD blocks); ``k_pool(layer)`` is
``[num_blocks, B, N_KV, d_h]``. A block id stands for the same block in every layer's K and V
pool, so a sequence has one block table. Token ``t`` lives at (see :func:`block_address`):

    table:  [ 7 | 2 | 9 | ... ]        t = 38, B = 16  ->  table index 2, offset 6
    block 9 (table index 2): tokens 32..47, token 38 at offset 6

Copy-on-write follows the seed's protocol: ``fork`` copies table entries and adds n to each
block's refcount; a write into a block with refcount > 1 allocates a new block, copies the
``o`` tokens in use, decrements the old one, updates the table, then writes.
"""

from __future__ import annotations

import torch

from vmcache.pool import PagePool
from vmcache.seqcache import SequenceCache, _check_int
from vmcache.spec import KVSpec


def block_address(t: int, block_size: int) -> tuple[int, int]:
    """Token position -> (block-table index, offset in block)."""
    return t // block_size, t % block_size


class _BlockStore:
    """Blocks are rows of preallocated tensors: creating is free, scrubbing zeroes rows."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def create(self, start: int, count: int) -> None:
        pass

    def scrub(self, pages: list[int]) -> None:
        self.kv[:, :, pages] = 0


class PagedKVCache(SequenceCache):
    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int | None = None,
        pool_bytes: int | None = None,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        max_seq_len: int = 8192,
        max_seqs: int = 256,
        *,
        scrub_on_reuse: bool = True,
        swap_bytes: int | None = None,
        prefix_caching: bool = False,
    ) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        for name, value in (("block_size", block_size), ("max_seq_len", max_seq_len),
                            ("max_seqs", max_seqs)):  # fmt: skip
            if _check_int(name, value) <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        spec.check_full_attention_up_to(max_seq_len, "PagedKVCache")
        if (num_blocks is None) == (pool_bytes is None):
            raise ValueError("give exactly one of num_blocks and pool_bytes")
        if num_blocks is None:
            num_blocks = _check_int("pool_bytes", pool_bytes) // spec.block_bytes(block_size, False)
        if _check_int("num_blocks", num_blocks) <= 0:
            raise ValueError(f"the pool must hold at least one block, got {num_blocks}")
        dev = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_pool = torch.zeros(shape, dtype=spec.dtype, device=dev)
        pool = PagePool(num_blocks, _BlockStore(self.kv_pool), scrub_on_reuse=scrub_on_reuse,
                        chunk_pages=num_blocks)  # fmt: skip
        super().__init__(
            spec, max_seqs, max_seq_len, pool,
            num_tables=1, units_per_token=1, units_per_page=block_size,
            page_bytes=spec.block_bytes(block_size, per_layer=False), device=dev,
            swap_bytes=swap_bytes, prefix_caching=prefix_caching,
        )  # fmt: skip
        self.max_blocks_per_seq = -(-max_seq_len // block_size)

    # --- kernel-facing views -----------------------------------------------------------
    def k_pool(self, layer: int) -> torch.Tensor:
        """``[num_blocks, B, N_KV, d_h]`` K blocks of ``layer``."""
        return self.kv_pool[self._check_layer(layer), 0]

    def v_pool(self, layer: int) -> torch.Tensor:
        return self.kv_pool[self._check_layer(layer), 1]

    def block_tables(self, seq_ids: list[int]) -> torch.Tensor:
        """``[len(seq_ids), max_blocks]`` int32 on the device, padded with 0 (kernels stop at
        each sequence's length, so padding is never read)."""
        tabs = [self._tables[self._check_seq(s)][0] for s in seq_ids]
        width = max([len(t) for t in tabs] + [1])
        out = torch.zeros((len(tabs), width), dtype=torch.int32)
        for i, t in enumerate(tabs):
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(self.device)

    def _slots(self, s: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n)
        table = torch.tensor(self._tables[s][0], dtype=torch.long)
        return table[pos // self.block_size].to(self.device), (pos % self.block_size).to(
            self.device
        )

    def kv(self, layer: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[seq_len, N_KV, d_h]`` K and V of sequence ``s`` (a gather: blocks are scattered)."""
        layer, s = self._check_layer(layer), self._check_seq(s)
        blocks, offs = self._slots(s, 0, self._lens[s])
        return self.kv_pool[layer, 0, blocks, offs], self.kv_pool[layer, 1, blocks, offs]

    # --- physical hooks: a block table needs no mapping ------------------------------------
    def _attach(self, s: int, t: int, j0: int, pages: list[int]) -> None:
        pass

    def _detach(self, s: int, t: int, j0: int, n: int) -> None:
        pass

    def _copy_page(self, src: int, dst: int, used_units: int) -> None:
        self.kv_pool[:, :, dst, :used_units] = self.kv_pool[:, :, src, :used_units]

    def _tables_of_layer(self, layer: int) -> list[int]:
        return [0]

    def _store(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        blocks, offs = self._slots(s, start, k.shape[0])
        self.kv_pool[layer, 0, blocks, offs] = k
        self.kv_pool[layer, 1, blocks, offs] = v

    def _export(self, s: int, length: int) -> list[torch.Tensor]:
        blocks, offs = self._slots(s, 0, length)
        data = self.kv_pool[:, :, blocks, offs]  # [N_L, 2, length, N_KV, d_h], a copy
        return [data.to("cpu", copy=True)]

    def _import(self, s: int, payload: list[torch.Tensor]) -> None:
        (data,) = payload
        blocks, offs = self._slots(s, 0, data.shape[2])
        self.kv_pool[:, :, blocks, offs] = data.to(self.device)

    def close(self) -> None:
        for s in self.sequences:
            self.free(s)

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
