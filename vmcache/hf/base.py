"""The machinery :class:`~vmcache.hf.VMCache` and :class:`~vmcache.hf.PagedCache` share: a
transformers ``Cache`` whose batch row ``i`` is slot ``i`` of the underlying cache, built at
the first update; the step's writes, its in-cache attention, and what ``generate`` calls on
the whole cache (reorder, crop, reset, repeat, select, copy). Each subclass says how the
cache is made (``_make``) and how its K/V views are read (``_views``)."""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers.cache_utils import Cache

from vmcache import kernels
from vmcache.errors import check_int
from vmcache.hf.attention import ATTN_NAME
from vmcache.hf.layer import _Layer
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec
from vmcache.sequences.stats import CacheStats


class _HFCache(Cache):
    """Shared machinery of :class:`VMCache` and :class:`PagedCache`."""

    def __init__(self, config, max_cache_len: int, max_batch_size: int | None = None,
                 device=None, dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None, kv_scales=None,
                 kv_granularity: str = "head") -> None:  # fmt: skip
        if check_int("max_cache_len", max_cache_len) <= 0:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        if max_batch_size is not None and check_int("max_batch_size", max_batch_size) <= 0:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        # ValueError for unreadable configs and bad kv_dtype / kv_scales / kv_granularity
        self.spec = KVSpec.from_hf_config(config, dtype, kv_dtype, kv_scales, kv_granularity)
        self.config = config
        self._max_len, self._max_rows = max_cache_len, max_batch_size
        self._device, self._dtype = device, dtype
        self.kv: VMKVCache | PagedKVCache | None = None  # built at the first update
        self.rows: list[int] = []  # row i -> slot i of self.kv
        self._len = 0  # tokens every row holds (left padding stored, so all rows are equal)
        self._groups: dict[int, list[int]] | None = None  # prefill: leader -> identical rows
        self._batch = None  # this step's StepBatch of every row (None: rows written apart)
        super().__init__(layers=[_Layer(self, i) for i in range(self.spec.num_layers)])

    def _make(self, spec: KVSpec, max_seqs: int, device: torch.device):
        raise NotImplementedError

    # read-only properties on Cache in transformers 5.17 (assigning them raises there)
    @property
    def max_cache_len(self) -> int:
        return self._max_len

    @property
    def max_batch_size(self) -> int | None:
        return self._max_rows

    # --- driven by the layers --------------------------------------------------------
    def _initialize(self, k: torch.Tensor) -> None:
        if self.kv is not None:
            return
        b, heads, _, dim = k.shape
        if (heads, dim) != (self.spec.num_kv_heads, self.spec.head_dim):
            raise ValueError(f"update got K/V with {heads} heads of dim {dim}; the config says "
                             f"{self.spec.num_kv_heads} of {self.spec.head_dim}")  # fmt: skip
        if self.max_batch_size is not None and b > self.max_batch_size:
            raise ValueError(f"batch of {b} rows exceeds max_batch_size={self.max_batch_size}")
        spec = dataclasses.replace(self.spec, dtype=self._dtype or k.dtype)
        self.spec = spec
        device = torch.device(self._device) if self._device is not None else k.device
        self.kv = self._make(spec, self.max_batch_size or b, device)

    def _update(self, layer: _Layer, k: torch.Tensor, v: torch.Tensor):
        b, _, q, _ = k.shape
        if not self.rows:
            if b > self.kv.config.max_seqs:
                if self.max_batch_size is not None:
                    raise ValueError(f"batch of {b} rows exceeds max_batch_size="
                                     f"{self.max_batch_size}")  # fmt: skip
                self.kv.close()  # empty after reset(): rebuild it for the larger batch
                self.kv = self._make(self.spec, b, self.kv.config.device)
            self.rows = [self.kv.new_sequence(slot=i) for i in range(b)]
        elif b != len(self.rows):
            raise ValueError(f"update got {b} rows, the cache holds {len(self.rows)}; "
                             "call reset() before a different batch")  # fmt: skip
        start, end = layer.length, layer.length + q
        if end > self.max_cache_len:
            raise ValueError(f"{end} tokens would pass max_cache_len={self.max_cache_len}")
        dtype_in, dtype = k.dtype, self.spec.dtype
        if k.dtype != dtype or v.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, q, N_KV, d_h]
        if end > self._len:
            self._grow(end - self._len, k, v)
        if self._groups is None and end == self._len:  # every row: one write per layer
            batch = self._batch
            if batch is None or not batch.fresh or batch.starts[0] != start:
                batch = self._batch = self.kv.batch(self.rows, [q] * b)
            batch.write(layer.idx, k.reshape(b * q, *k.shape[2:]), v.reshape(b * q, *v.shape[2:]))
            layer.length = end
            layer.dtype_in = dtype_in
            return self._layer_kv(layer)
        self._batch = None
        groups = self._groups or {r: [] for r in self.rows}
        for lead, rest in groups.items():
            same = [r for r in rest if torch.equal(k[r], k[lead]) and torch.equal(v[r], v[lead])]
            if same:
                self.kv.beams.write_group(layer.idx, [lead, *same], start, k[lead], v[lead])
            else:
                self.kv.write(layer.idx, lead, start, k[lead], v[lead])
            for r in rest:
                if r not in same:
                    self.kv.write(layer.idx, r, start, k[r], v[r])
        layer.length = end
        layer.dtype_in = dtype_in
        return self._layer_kv(layer)

    def _step_batch(self, length: int, q: int | None = None):
        """This step's batch when it still describes every row at ``length`` tokens (with
        ``q`` new ones), else None."""
        b = self._batch
        ok = b is not None and b.fresh and b.kv_lens[0] == length and q in (None, b.q_lens[0])
        return b if ok else None

    def _reads_itself(self, real: bool) -> bool:
        """Whether ``update`` may return stand-ins: the vmcache attention reads the cache
        itself (``real``: the caller wants the K/V themselves)."""
        return not real and getattr(self.config, "_attn_implementation", None) == ATTN_NAME

    def _layer_kv(self, layer: _Layer, real: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``layer.update`` returns: keys and values ``[batch, heads, keys, head_dim]``
        from the window's first mapped token to the layer's length (``real``: the K/V
        themselves, never the zero-stride stand-ins the vmcache attention takes)."""
        views, rows = self.kv.views, self.rows
        lo = 0 if self.spec.layer_windows is None else views.window_start(layer.idx, rows[0])
        keys, values = self._views(layer.idx, lo, layer.length, real)
        dtype_in = getattr(layer, "dtype_in", keys.dtype)
        if keys.dtype != dtype_in and keys.stride(-1):  # stored narrower (dtype=): convert;
            # zero-stride stand-ins stay as they are (the vmcache attention casts the query)
            keys, values = keys.to(dtype_in), values.to(dtype_in)
        keys._vmcache = values._vmcache = (self, layer.idx)
        return keys, values

    def _grow(self, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's first layer: every row += n tokens; fresh rows with identical K/V
        (a prompt repeated by generate) share one physical copy."""
        self._groups = None
        if self._len == 0 and len(self.rows) > 1:
            groups: dict[int, list[int]] = {}
            for r in self.rows:
                lead = next((g for g in groups if torch.equal(k[r], k[g])
                             and torch.equal(v[r], v[g])), None)  # fmt: skip
                groups.setdefault(r, []) if lead is None else groups[lead].append(r)
            if any(groups.values()):
                for lead, rest in groups.items():
                    self.kv.grow(lead, n)
                    if rest:
                        self.kv.beams.assign(rest, [lead] * len(rest))
                self._groups = groups
                self._len += n
                return
        for r in self.rows:
            self.kv.grow(r, n)
        self._len += n

    def _views(self, layer: int, lo: int, n: int, real: bool = False):
        """``[b, N_KV, n − lo, d_h]`` K and V of every row, tokens ``[lo, n)`` (``real``:
        never stand-ins)."""
        raise NotImplementedError

    def _window_offset(self, layer: int) -> int:
        """The first token ``layer`` keeps mapped once the next step's grow has run (rows all
        have one length, so one row answers for all); 0 for full attention."""
        if self.kv is None or not self.rows:
            return 0
        return self.kv.views.window_start_after_grow(layer, self.rows[0], self._len)

    def attend(self, layer: int, query: torch.Tensor, scale: float | None,
               softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """Attention of every row's new queries ``[b, N_Q, q, d_h]`` over the cache itself
        (:mod:`vmcache.kernels`) → ``[b, q, N_Q, d_h]``."""
        b, heads, q, dim = query.shape
        packed = query.transpose(1, 2).reshape(b * q, heads, dim)
        batch = self._step_batch(self.layers[layer].length, q)
        out = kernels.attend(self.kv, layer, packed, self.rows, [q] * b, scale=scale,
                             softcap=softcap, batch=batch)  # fmt: skip
        return out.view(b, q, heads, dim)

    def real_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every row ``[b, N_KV, n, d_h]``, from the layer's window start to its
        length, as real tensors in the model's dtype (FP8/INT8 dequantized): what a masked
        step's SDPA reads where ``update`` returned stand-ins."""
        if not 0 <= check_int("layer", layer) < len(self.layers):
            raise ValueError(f"layer must be in [0, {len(self.layers)}), got {layer}")
        return self._layer_kv(self.layers[layer], real=True)

    # --- what generate calls on the whole cache --------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i takes row ``beam_idx[i]``'s history: pages remapped or copied page by page
        (``assign``), nothing gathered."""
        srcs = [int(i) for i in beam_idx.tolist()]
        if self.rows and srcs != self.rows:
            self.kv.beams.assign(self.rows, srcs)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (5.x passes a negative count; 5.17's
        assisted decoding passes it as a 0-d integer tensor)."""
        if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.numel() == 1:
            if tokens_to_remove.is_floating_point():
                raise TypeError(f"tokens_to_remove must be an integer, got {tokens_to_remove}")
            tokens_to_remove = int(tokens_to_remove)
        if check_int("tokens_to_remove", tokens_to_remove) > 0:
            raise ValueError("crop takes a negative count of tokens to remove, got "
                             f"{tokens_to_remove}")  # fmt: skip
        new_len = max(0, self._len + tokens_to_remove)
        for r in self.rows:
            self.kv.beams.truncate(r, new_len)
        for layer in self.layers:
            layer.length = min(layer.length, new_len)
        self._len, self._groups = new_len, None

    def reset(self) -> None:
        """Free every row (pages back to the pool); the cache object stays usable."""
        for r in self.rows:
            self.kv.free(r)
        self.rows, self._len, self._groups, self._batch = [], 0, None, None
        for layer in self.layers:
            layer.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Row ``i`` becomes rows ``i·repeats … i·repeats + repeats − 1`` (contrastive search
        and similar): new rows share every page, nothing is copied."""
        if check_int("repeats", repeats) < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if not self.rows or repeats == 1:
            return
        b, n = len(self.rows), len(self.rows) * repeats
        if n > self.kv.config.max_seqs:
            raise ValueError(f"{n} rows would exceed this cache's {self.kv.config.max_seqs} rows")
        added = [self.kv.new_sequence(slot=i) for i in range(b, n)]
        try:
            self.kv.beams.assign(list(range(n)), [i // repeats for i in range(n)])
        except BaseException:
            for r in added:
                self.kv.free(r)
            raise
        self.rows, self._groups = list(range(n)), None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (in that order) and drop the others: a remap, no copy."""
        keep = [check_int("index", int(i)) for i in torch.as_tensor(indices).tolist()]
        if any(not 0 <= i < len(self.rows) for i in keep):
            raise ValueError(f"indices must be in [0, {len(self.rows)}), got {keep}")
        if not keep:
            raise ValueError("batch_select_indices needs at least one index")
        n = len(keep)
        self.kv.beams.assign(list(range(n)), keep)
        for r in self.rows[n:]:
            self.kv.free(r)
        self.rows, self._groups = list(range(n)), None

    def __deepcopy__(self, memo) -> _HFCache:
        """A real copy: its own memory, each row's K/V copied (never pages shared with the
        original, which keeps changing them)."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.layers = [_Layer(new, i) for i in range(len(self.layers))]
        for mine, theirs in zip(new.layers, self.layers):
            mine.length, mine.is_initialized = theirs.length, theirs.is_initialized
            mine.device = getattr(theirs, "device", None)
        new._options = copy.deepcopy(getattr(self, "_options", {}), memo)
        new.rows, new._groups, new._batch = list(self.rows), None, None
        if self.kv is not None:
            new.kv = new._make(self.spec, self.kv.config.max_seqs, self.kv.config.device)
            for r in self.rows:
                new.kv.handoff.load(self.kv.handoff.export(r), slot=r)
        return new

    def stats(self) -> CacheStats | None:
        """The underlying cache's stats (mapped, used, shared bytes, copies); None before the
        first update."""
        return None if self.kv is None else self.kv.stats()
