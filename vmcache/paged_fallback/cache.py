"""PagedKVCache: vLLM-style block tables over preallocated block pools, the A/B twin of
VMKVCache behind the same interface.

Memory: one tensor ``[G, 2, num_blocks, B, R]`` of stored rows (R = N_KV·d_h, plus per-token
scales with ``kv_granularity="token"``: :mod:`vmcache.sequences.quant`); ``k_pool(layer)`` is
the ``[num_blocks, B, N_KV, d_h]`` (NHD) view of its K elements. A block id stands for the
same block in the K and V pools of the G layers of one *table group*, so a sequence has one
block table per group. A model whose layers all attend alike is one group (G = N_L, one
table). A hybrid model (sliding and full layers) splits each attention type into groups of
G = gcd(layers per type) layers, as vLLM's hybrid allocator does, so every block is the
same size and none is wasted:

    Gemma-3-style, 12 layers (10 sliding, 2 full): G = 2, tables 0-4 sliding, table 5 full
    layer 7 -> table 3, slot 1: its K blocks are kv_pool[1, 0, table_3_blocks]

Token ``t`` lives at (see :func:`block_address`):

    table:  [ 7 | 2 | 9 | ... ]        t = 38, B = 16  ->  table index 2, offset 6
    block 9 (table index 2): tokens 32..47, token 38 at offset 6

Copy-on-write follows the seed's protocol: ``fork`` copies table entries and adds n to each
block's refcount; a write into a block with refcount > 1 allocates a new block, copies the
``o`` tokens in use, decrements the old one, updates the table, then writes.
"""

from __future__ import annotations

import math

import torch

from vmcache.memory.budget import Budget
from vmcache.memory.pool import PagePool
from vmcache.paged_fallback.views import PagedViews
from vmcache.sequences.config import CacheConfig
from vmcache.sequences.coordinator import SequenceCache, _check_int
from vmcache.sequences.handoff import TableRuns
from vmcache.sequences.quant import split_rows
from vmcache.sequences.spec import KVSpec
from vmcache.sequences.tables import PageTables

STAGE_BYTES = 64 << 20  # the most a device-side gather of blocks (tiers, sleep) allocates


def layers_per_table(spec: KVSpec) -> int:
    """G: the layers one block table serves (gcd of the layer counts per attention type;
    every layer for a model whose layers attend alike). A sequence has N_L / G tables."""
    return math.gcd(*(len(layers) for _, layers in spec.attention_groups))


def block_address(t: int, block_size: int) -> tuple[int, int]:
    """Token position -> (block-table index, offset in block)."""
    return t // block_size, t % block_size


class _BlockStore:
    """Blocks are rows of preallocated tensors: creating is free, scrubbing zeroes rows, and
    releasing gives nothing back (the pool tensor is allocated whole: what a block-table
    cache without virtual memory can do; its budget still counts blocks) but zeroes them, so
    a block created again reads as zeros like a new page."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def create(self, pages: list[int]) -> None:
        pass

    def release(self, pages: list[int]) -> None:
        if pages and self.kv.untyped_storage().nbytes():  # asleep, the storage is gone
            self.scrub(pages)

    def scrub(self, pages: list[int]) -> None:
        self.kv[:, :, pages] = 0


class PagedKVCache(SequenceCache):
    _releases_memory = False  # one preallocated block tensor: trim counts, gives nothing back
    _copies_moves = False  # a beam reorder rewrites block tables: cheaper than a block copy

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
        prefix_tiers=None,
        rollback_tokens: int = 0,
        budget: Budget | None = None,
        chunk_pages: int | None = None,
    ) -> None:
        """``budget``: how many blocks may be in use at once (a shared budget counts them;
        the block tensor itself is allocated whole, so it does not give memory back).
        ``chunk_pages``: blocks taken from the budget at a time (default: every block)."""
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        for name, value in (("block_size", block_size), ("max_seq_len", max_seq_len),
                            ("max_seqs", max_seqs)):  # fmt: skip
            if _check_int(name, value) <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if _check_int("rollback_tokens", rollback_tokens) < 0:
            raise ValueError(f"rollback_tokens must be >= 0, got {rollback_tokens}")
        if (num_blocks is None) == (pool_bytes is None):
            raise ValueError("give exactly one of num_blocks and pool_bytes")
        per_type = spec.attention_groups
        G = layers_per_table(spec)
        self._layer_at: dict[int, tuple[int, int]] = {}  # layer -> (block table, slot)
        windows = []
        for w, layers in per_type:
            for i in range(0, len(layers), G):
                for slot, layer in enumerate(layers[i : i + G]):
                    self._layer_at[layer] = (len(windows), slot)
                windows.append(w)
        block_bytes = 2 * G * block_size * spec.bytes_per_token_per_layer
        if num_blocks is None:
            num_blocks = _check_int("pool_bytes", pool_bytes) // block_bytes
        if _check_int("num_blocks", num_blocks) <= 0:
            raise ValueError(f"the pool must hold at least one block, got {num_blocks}")
        dev = torch.device(device)
        self._layers_per_block = G
        shape = (G, 2, num_blocks, block_size, spec.row_elems)  # stored rows (see quant.py)
        self._kv_pool = torch.zeros(shape, dtype=spec.storage_dtype, device=dev)
        pool = PagePool(num_blocks, _BlockStore(self._kv_pool), scrub_on_reuse=scrub_on_reuse,
                        chunk_pages=chunk_pages or num_blocks, budget=budget)  # fmt: skip
        groups = [PageTables([t], w, max_seqs, 1, block_size, rollback_tokens)
                  for t, w in enumerate(windows)]  # fmt: skip
        config = CacheConfig(max_seqs, max_seq_len, dev, block_bytes, "paged", block_size,
                             num_blocks)  # fmt: skip
        super().__init__(spec, config, pool, groups=groups, swap_bytes=swap_bytes,
                         prefix_caching=prefix_caching, prefix_tiers=prefix_tiers)  # fmt: skip
        self._max_blocks_per_seq = -(-max_seq_len // block_size)
        # per layer, K's and V's stored rows as one [num_blocks·B, R] view (the pool is never
        # reallocated): what a step's writes and gathers index
        self._flat = [tuple(self._kv_pool[self._layer_at[i][1], kv].view(-1, spec.row_elems)
                            for kv in (0, 1)) for i in range(spec.num_layers)]  # fmt: skip
        self.views = PagedViews(self._core)  # facet: what the kernels read

    # --- kernel-facing views (cache.views reads them) --------------------------------------
    def _block_pool(self, layer: int, kv: int) -> torch.Tensor:
        return split_rows(self._rows(layer, kv), self.spec.num_kv_heads, self.spec.head_dim)[0]

    def _table_of_layer(self, layer: int) -> int:
        return self._layer_at[layer][0]

    def _slots(self, s: int, t: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n)
        table = torch.tensor(self._group_of[t].row(s, t), dtype=torch.long)
        return table[pos // self.config.block_size].to(self.config.device), (
            pos % self.config.block_size
        ).to(self.config.device)

    def kv(self, layer: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[seq_len − w, N_KV, d_h]`` K and V of sequence ``s`` from ``w =
        window_start(layer, s)`` (a gather: blocks are scattered)."""
        w, n = self._window_start(layer, s), self._seqs.length(s)
        t, slot = self._layer_at[layer]
        blocks, offs = self._slots(s, t, w, n - w)
        k, v = self._kv_pool[slot, :, blocks, offs]  # [2, n, ...]: one gather for both
        return self._decode(layer, k, v)

    def _rows(self, layer: int, kv: int) -> torch.Tensor:
        return self._kv_pool[self._layer_at[layer][1], kv]

    # --- physical hooks: a block table needs no mapping ------------------------------------
    def _attach(self, s: int, t: int, j0: int, pages: list[int]) -> None:
        pass

    def _detach(self, s: int, t: int, j0: int, n: int) -> None:
        pass

    def _page(self, p: int, units: int) -> torch.Tensor:
        return self._kv_pool[:, :, p, :units]  # every layer of the block's table, K and V

    def _tables_of_layer(self, layer: int) -> list[int]:
        return [self._layer_at[layer][0]]

    def _flat_rows(self, layer: int, kv: int) -> torch.Tensor:
        return self._flat[layer][kv]

    def _flat_index(self, layer: int, seqs: torch.Tensor, positions: torch.Tensor):
        """Row ``block·B + offset`` of the pool's flat view, through the block tables."""
        t = self._layer_at[layer][0]
        uniq, inv = torch.unique(seqs[:, 0], return_inverse=True)
        rows = [self._group_of[t].row(s, t) for s in uniq.tolist()]
        width = max(len(r) for r in rows)
        tab = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        blocks = tab[inv].gather(1, positions // self.config.block_size)
        return blocks * self.config.block_size + positions % self.config.block_size

    def _store(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t, slot = self._layer_at[layer]
        blocks, offs = self._slots(s, t, start, k.shape[0])
        self._kv_pool[slot, 0, blocks, offs] = k
        self._kv_pool[slot, 1, blocks, offs] = v

    def _load(self, layer: int, s: int, positions: torch.Tensor):
        t, slot = self._layer_at[layer]
        table = torch.tensor(self._group_of[t].row(s, t), dtype=torch.long)
        blocks = table[positions // self.config.block_size].to(self.config.device)
        offs = (positions % self.config.block_size).to(self.config.device)
        return self._kv_pool[slot, 0, blocks, offs], self._kv_pool[slot, 1, blocks, offs]

    def _runs(self, s: int, t: int, j0: int, length: int) -> TableRuns:
        """One view per block per layer slot and K/V (``[B, R]``; the last block to
        ``length`` only), as block-granular transfers go; packed: the full blocks gathered by
        one index, then the last block's tokens.

            blocks:  | b0 full | b1 full | b2: `used` tokens of B |
            views:   for slot g, for K then V: b0, b1, b2[:used]   (stored rows [n, R])
            packed:  pool[:, :, [b0, b1]] (G, 2, 2, B, R)  +  pool[:, :, b2, :used]
        """
        B, pool = self.config.block_size, self._kv_pool
        blocks = self._group_of[t].row(s, t)[j0 : -(-length // B)]
        used = length - (j0 + len(blocks) - 1) * B if blocks else 0
        sizes = [B] * (len(blocks) - 1) + [used] * bool(blocks)
        views = [pool[g, kv, b, :n] for g in range(pool.shape[0]) for kv in (0, 1)
                 for b, n in zip(blocks, sizes)]  # fmt: skip
        full = torch.tensor(blocks[:-1], dtype=torch.long, device=self.config.device)
        full_shape = pool.shape[:2] + (len(full),) + pool.shape[3:]
        tail_shape = pool.shape[:2] + (used,) + pool.shape[4:]

        def gather() -> torch.Tensor:
            head = pool[:, :, full].reshape(-1).view(torch.uint8)
            if not blocks:
                return head
            tail = pool[:, :, blocks[-1], :used].contiguous().reshape(-1).view(torch.uint8)
            return torch.cat([head, tail])

        def scatter(buf: torch.Tensor) -> None:
            buf = buf.to(pool.device).view(pool.dtype)
            cut = math.prod(full_shape)
            pool[:, :, full] = buf[:cut].view(full_shape)
            if blocks:
                pool[:, :, blocks[-1], :used] = buf[cut:].view(tail_shape)

        return TableRuns(views, gather, scatter)

    # --- prefix tier hooks (vmcache.prefix.tiers): a block's bytes across its slots and K/V ----
    def _read_pages(self, pages: list[int], pin: bool = False) -> torch.Tensor:
        """uint8 ``[len(pages), page_bytes]`` host copy of ``pages`` (blocks across slots and
        K/V), gathered on the device in bounded chunks (:data:`STAGE_BYTES`), so a sleep of
        the whole pool needs no second pool's worth of device memory."""
        out = torch.empty((len(pages), self.config.page_bytes), dtype=torch.uint8, pin_memory=pin)
        for i in range(0, len(pages), self._stage_blocks):
            chunk = pages[i : i + self._stage_blocks]
            idx = torch.tensor(chunk, dtype=torch.long, device=self.config.device)
            blocks = self._kv_pool[:, :, idx].movedim(2, 0)  # [n, G, 2, B, ...]: one temporary
            dst = out[i : i + len(chunk)].view(self._kv_pool.dtype).view(blocks.shape)
            dst.copy_(blocks)  # strided source, straight into the host rows
        return out

    def _write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        pool = self._kv_pool
        for i in range(0, len(pages), self._stage_blocks):
            chunk = pages[i : i + self._stage_blocks]
            idx = torch.tensor(chunk, dtype=torch.long, device=self.config.device)
            shape = (len(chunk),) + pool.shape[:2] + pool.shape[3:]
            part = data[i : i + len(chunk)].to(self.config.device).contiguous()
            pool[:, :, idx] = part.view(pool.dtype).view(shape).movedim(0, 2)

    @property
    def _stage_blocks(self) -> int:
        return max(1, STAGE_BYTES // self.config.page_bytes)

    # --- sleep / wake hooks (cache.elastic) ---------------------------------------------
    def _device_bytes(self) -> int:
        return self._kv_pool.untyped_storage().nbytes()

    def _release_all(self, live: list[int], keep: bool):
        saved = self._read_pages(live) if keep else None
        nbytes = self._device_bytes()
        self._kv_pool.untyped_storage().resize_(0)  # k_pool / v_pool views share it
        if self.config.device.type == "cuda":  # back to the device, not to torch's cache of blocks
            torch.cuda.empty_cache()
        return saved, nbytes

    def _restore_all(self, live: list[int], state) -> None:
        saved, nbytes = state
        self._kv_pool.untyped_storage().resize_(nbytes)
        self._kv_pool.zero_()
        if saved is not None:
            self._write_pages(live, saved)

    def close(self) -> None:
        self.prefix.close_tiers()
        if self._pool.asleep:
            return
        for s in self.sequences:
            self.free(s)

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
