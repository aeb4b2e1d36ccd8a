"""Drop-in transformers caches over :class:`VMKVCache` and :class:`PagedKVCache`.

    cache = VMCache(config=model.config, max_cache_len=2048)
    out = model.generate(input_ids, cache=cache, max_new_tokens=64)

Batch row ``i`` is sequence slot ``i`` of the underlying cache. ``update`` grows every row on
the first layer of a step (pages are mapped as tokens arrive), writes each layer's K/V, and
returns ``[b, N_KV, length, d_h]`` views:

    VMKVCache:  K_layer[0:b, :length].transpose(1, 2)   zero-copy, strided, no torch.cat
    PagedKVCache: a gather through the block tables (nothing, with attn "vmcache": see below)

Sharing where transformers copies: ``generate`` repeats each prompt for beams / return
sequences before prefill, so those rows arrive with identical K/V; rows found identical at
prefill hold one physical copy (``assign`` + ``write_group``). ``reorder_cache(beam_idx)``
remaps pages (``assign``) instead of gathering K/V where beams share them; the tail page a row
writes next is copied into a page the row holds alone (what splitting a shared tail on that
write would copy), and on VMKVCache so is a page a remap would only move (cheaper than an
unmap and a map; nothing would be shared).

``attn_implementation="vmcache"`` (registered on import) runs :func:`vmcache.kernels.prefill`
/ :func:`~vmcache.kernels.decode` on the cache itself; a step with padding (a mask) falls back
to SDPA over the returned views. Layers only record lengths; the owner alone changes tables.
"""

from __future__ import annotations

import torch

from vmcache.hf.attention import ATTN_NAME, register, stand_ins, vmcache_attention
from vmcache.hf.base import _HFCache
from vmcache.hf.layer import cache_keyword
from vmcache.paged_fallback import PagedKVCache
from vmcache.paged_fallback.cache import layers_per_table
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.hooks import _bits


class VMCache(_HFCache):
    """transformers ``Cache`` over :class:`VMKVCache`: memory is mapped as tokens arrive."""

    def __init__(self, config, max_cache_len: int, max_batch_size: int | None = None,
                 device=None, dtype: torch.dtype | None = None, page_size: int | None = None,
                 layout: str = "layer_major", kv_dtype: torch.dtype | None = None,
                 kv_scales=None, kv_granularity: str = "head",
                 **vmkv_options) -> None:  # fmt: skip
        self._page_size, self._layout, self._options = page_size, layout, vmkv_options
        super().__init__(config, max_cache_len, max_batch_size, device, dtype, kv_dtype,
                         kv_scales, kv_granularity)  # fmt: skip

    def _make(self, spec, max_seqs, device):
        return VMKVCache(spec, max_seqs, self.max_cache_len, device, page_size=self._page_size,
                         layout=self._layout, **self._options)  # fmt: skip

    def _views(self, layer, lo, n, real=False):
        b, kv = len(self.rows), self.kv
        if kv.spec.quantized and self._reads_itself(real):  # FP8/INT8: else copies
            return stand_ins(
                self.spec, kv.config.device, b, n - lo
            )  # the attention reads the cache
        rows = kv.views.stored_rows
        k, v = kv.views.decode(layer, rows(layer, 0)[:b, lo:n], rows(layer, 1)[:b, lo:n])
        return k.transpose(1, 2), v.transpose(1, 2)


class PagedCache(_HFCache):
    """transformers ``Cache`` over :class:`PagedKVCache` (block tables, preallocated pool of
    ``num_blocks``, by default enough for every row at ``max_cache_len``)."""

    def __init__(self, config, max_cache_len: int, max_batch_size: int | None = None,
                 device=None, dtype: torch.dtype | None = None, block_size: int = 16,
                 num_blocks: int | None = None, kv_dtype: torch.dtype | None = None,
                 kv_scales=None, kv_granularity: str = "head",
                 **paged_options) -> None:  # fmt: skip
        self._block_size, self._num_blocks, self._options = block_size, num_blocks, paged_options
        # (cache, epoch, table) -> the rows' block tables [b, W]: one step's, rebuilt when the
        # cache changes (a grow, a split, a reorder)
        self._tables: dict = {}
        super().__init__(config, max_cache_len, max_batch_size, device, dtype, kv_dtype,
                         kv_scales, kv_granularity)  # fmt: skip

    def _make(self, spec, max_seqs, device):
        tables = spec.num_layers // layers_per_table(spec)
        blocks = self._num_blocks or max_seqs * tables * -(-self.max_cache_len // self._block_size)
        return PagedKVCache(spec, num_blocks=blocks, block_size=self._block_size, device=device,
                            max_seq_len=self.max_cache_len, max_seqs=max_seqs,
                            **self._options)  # fmt: skip

    def _views(self, layer, lo, n, real=False):
        b, kv, spec = len(self.rows), self.kv, self.spec
        if self._reads_itself(real):
            return stand_ins(
                spec, kv.config.device, b, n - lo
            )  # the attention reads the pool itself
        return self._gather(layer)

    def _gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every row from the layer's window start ``lo`` to its length ``n``,
        ``[b, N_KV, n − lo, d_h]``. Rows all have one length, so whole blocks are gathered:
        one ``index_select`` of ``[num_blocks, B·R]`` rows per K and V (a copy of 16 tokens at
        a time, not one token), through the block tables' tensor built once per step and
        table; then the first and last block are trimmed:

            tables [b, W] -> blocks lo//B .. (n-1)//B of each row -> [b, k·B, R]
                          -> tokens [lo − (lo//B)·B, n − (lo//B)·B) of each row
        """
        kv, n, b, B = self.kv, self.layers[layer].length, len(self.rows), self._block_size
        views = kv.views
        lo = 0 if self.spec.layer_windows is None else views.window_start(layer, self.rows[0])
        t = views.table_of_layer(layer)
        key = (kv, views.epoch, t, lo, n)  # the cache itself: a rebuilt one counts epochs anew
        got = self._tables.get(key)
        if got is None:
            tables = views.block_tables(self.rows, layer).long()  # [b, W], RELEASED -> 0
            first, last = lo // B, -(-n // B)
            got = (tables[:, first:last].reshape(-1), (last - first) * B,
                   slice(lo - first * B, n - first * B))  # fmt: skip
            self._tables = {k: v for k, v in self._tables.items() if k[:2] == key[:2]}
            self._tables[key] = got
        idx, width, cut = got
        k, v = (_bits(views.stored_rows(layer, x)).flatten(1).index_select(0, idx)
                .view(b, width, -1)[:, cut] for x in (0, 1))  # fmt: skip
        if k.dtype != kv.spec.storage_dtype:  # FP8 gathered as its bytes
            k, v = k.view(kv.spec.storage_dtype), v.view(kv.spec.storage_dtype)
        k, v = views.decode(layer, k, v)  # FP8/INT8: dequantized
        return k.transpose(1, 2), v.transpose(1, 2)


register()

from vmcache.hf.calibrate import calibrate_kv_scales  # noqa: E402

__all__ = ["VMCache", "PagedCache", "vmcache_attention", "register", "ATTN_NAME",
           "calibrate_kv_scales", "cache_keyword"]  # fmt: skip
