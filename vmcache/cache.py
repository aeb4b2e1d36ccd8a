"""VMKVCache: every sequence owns one contiguous virtual range per K/V tensor; physical pages
are mapped into it on demand (vAttention's design), refcounted and shared copy-on-write.

layer_major (default): per layer, K and V tensors ``[max_seqs, max_seq_len, N_KV, d_h]``:

    reservation: | L0.K | L0.V | L1.K | L1.V | ...          table t = 2·layer + (0 K | 1 V)
    tensor t:    | row 0 (seq 0) | row 1 | ... | row S-1 |  each row = pages_per_row pages
    address(s, t, j) = base + (t·S + s)·row_bytes + j·page_size

token_major ("megacache"): one K and one V tensor ``[max_seqs, max_seq_len, N_L, N_KV, d_h]``
(tables 0 and 1); a page then holds every layer of fewer tokens, and a layer's view is strided.

Rows are padded to a multiple of lcm(page, token row), so a page never spans two sequences
and every row starts at a whole token (FlashAttention's varlen path addresses the layer as one
flat ``[S·L_row, N_KV, d_h]`` tensor, row ``s`` at token ``s·L_row``). Only pages a sequence's
length needs are mapped; reading past that faults (host) or is an illegal address (CUDA), so
the whole-tensor views print a summary, never their contents.
"""

from __future__ import annotations

import math

import torch

from .backends import Backend, make_backend, round_up
from .pagestore import VMPageStore
from .pool import PagePool
from .seqcache import SequenceCache, _check_int
from .spec import KVSpec

LAYOUTS = ("layer_major", "token_major")


class VMKVCache(SequenceCache):
    def __init__(
        self,
        spec: KVSpec,
        max_seqs: int,
        max_seq_len: int,
        device: torch.device | str = "cpu",
        page_size: int | None = None,
        pool_bytes: int | None = None,
        layout: str = "layer_major",
        *,
        backend: Backend | None = None,
        scrub_on_reuse: bool = True,
        swap_bytes: int | None = None,
        chunk_pages: int = 64,
        prefix_caching: bool = False,
        own_backend: bool | None = None,
    ) -> None:
        """``backend``: physical memory (default: the real one for ``device``); the cache
        closes it when it made it, or when ``own_backend`` is True."""
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        for name, value in (("max_seqs", max_seqs), ("max_seq_len", max_seq_len)):
            if _check_int(name, value) <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        spec.check_full_attention_up_to(max_seq_len, "VMKVCache")
        self._owns_backend = backend is None if own_backend is None else bool(own_backend)
        self.backend = backend if backend is not None else make_backend(device)
        try:
            self._setup(spec, max_seqs, max_seq_len, page_size, pool_bytes, layout,
                        scrub_on_reuse, swap_bytes, chunk_pages, prefix_caching)  # fmt: skip
        except BaseException:
            if self._owns_backend:
                self.backend.close()
            raise

    def _setup(
        self, spec, max_seqs, max_seq_len, page_size, pool_bytes, layout, scrub, swap, chunk,
        prefix,
    ):  # fmt: skip
        be = self.backend
        P = be.default_page_size if page_size is None else _check_int("page_size", page_size)
        if P <= 0 or P % be.granularity:
            raise ValueError(
                f"page_size must be a positive multiple of the backend granularity "
                f"{be.granularity} bytes, got {P}"
            )
        self.layout = layout
        self.page_size = P
        n_tables = 2 * spec.num_layers if layout == "layer_major" else 2
        token_bytes = spec.bytes_per_token_per_layer * (2 * spec.num_layers // n_tables)
        self.token_bytes = token_bytes  # bytes of one token in one tensor row
        self.row_bytes = round_up(max_seq_len * token_bytes, math.lcm(P, token_bytes))
        self.pages_per_row = self.row_bytes // P
        capacity = n_tables * max_seqs * self.pages_per_row
        num_pages = capacity
        if pool_bytes is not None:
            _check_int("pool_bytes", pool_bytes)
            if pool_bytes < P:
                raise ValueError(f"pool_bytes ({pool_bytes}) is smaller than one page ({P})")
            num_pages = min(capacity, pool_bytes // P)
        self.store = VMPageStore(be, P, num_pages)
        pool = PagePool(num_pages, self.store, scrub_on_reuse=scrub, chunk_pages=chunk)
        super().__init__(
            spec, max_seqs, max_seq_len, pool,
            num_tables=n_tables, units_per_token=token_bytes, units_per_page=P,
            page_bytes=P, device=be.device, swap_bytes=swap, prefix_caching=prefix,
        )  # fmt: skip
        self._reserved = n_tables * max_seqs * self.row_bytes
        self.base = be.reserve(self._reserved)
        self._bytes = be.view(self.base, self._reserved)  # uint8 over the whole reservation
        el = spec.dtype_bytes
        row, H, D, NL = self.row_bytes // el, spec.num_kv_heads, spec.head_dim, spec.num_layers
        flat = self._bytes.view(spec.dtype)
        if layout == "layer_major":
            shape, strides = (max_seqs, max_seq_len, H, D), (row, H * D, D, 1)
        else:
            shape, strides = (max_seqs, max_seq_len, NL, H, D), (row, NL * H * D, H * D, D, 1)
        tensors = [flat.as_strided(shape, strides, t * max_seqs * row) for t in range(n_tables)]
        if layout == "layer_major":
            views = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(NL)]
        else:
            views = [(tensors[0][:, :, i], tensors[1][:, :, i]) for i in range(NL)]
        self._views = [(k.as_subclass(CacheView), v.as_subclass(CacheView)) for k, v in views]
        self.closed = False

    # --- kernel-facing views -----------------------------------------------------------
    @property
    def row_tokens(self) -> int:
        """Tokens one padded row spans (a whole number: rows are lcm(page, token)-padded);
        token t of row s is row ``s·row_tokens + t`` of a layer's flat varlen view."""
        return self.row_bytes // self.token_bytes

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s whole virtual K tensor ``[max_seqs, max_seq_len, N_KV, d_h]``
        (strided in ``token_major``). Only each sequence's first ``seq_len`` rows are mapped."""
        return self._layer_view(self._check_layer(layer), 0)

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._layer_view(self._check_layer(layer), 1)

    def _layer_view(self, layer: int, kv: int) -> torch.Tensor:
        return self._views[layer][kv]

    def kv(self, layer: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy views ``[seq_len, N_KV, d_h]`` of sequence ``s``'s valid K and V."""
        layer, s = self._check_layer(layer), self._check_seq(s)
        n = self._lens[s]
        return self._layer_view(layer, 0)[s, :n], self._layer_view(layer, 1)[s, :n]

    # --- physical hooks ----------------------------------------------------------------
    def _va(self, s: int, t: int, j: int) -> int:
        return self.base + (t * self.max_seqs + s) * self.row_bytes + j * self.page_size

    def _attach(self, s: int, t: int, j0: int, pages: list[int]) -> None:
        handles = self.store.handles(pages)
        self.backend.map(self._va(s, t, j0), handles, self.page_size)

    def _detach(self, s: int, t: int, j0: int, n: int) -> None:
        self.backend.unmap(self._va(s, t, j0), n, self.page_size)

    def _copy_page(self, src: int, dst: int, used_units: int) -> None:
        self.store.view(dst)[:used_units].copy_(self.store.view(src)[:used_units])

    def _tables_of_layer(self, layer: int) -> list[int]:
        return [2 * layer, 2 * layer + 1] if self.layout == "layer_major" else [0, 1]

    def _store(self, layer: int, s: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        self._layer_view(layer, 0)[s, start : start + n].copy_(k)
        self._layer_view(layer, 1)[s, start : start + n].copy_(v)

    def _row(self, s: int, t: int, nbytes: int) -> torch.Tensor:
        off = (t * self.max_seqs + s) * self.row_bytes
        return self._bytes[off : off + nbytes]

    def _export(self, s: int, length: int) -> list[torch.Tensor]:
        pin = self.device.type == "cuda"
        out = []
        for t in range(self._T):
            row = self._row(s, t, length * self.token_bytes)
            out.append(torch.empty(row.shape, dtype=torch.uint8, pin_memory=pin).copy_(row))
        return out

    def _import(self, s: int, payload: list[torch.Tensor]) -> None:
        for t, data in enumerate(payload):
            self._row(s, t, data.numel()).copy_(data)

    def _sync(self) -> None:
        self.backend.synchronize()

    # --- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Unmap everything and release pages, reservations and (if owned) the backend.

        Views returned by :meth:`kv`, :meth:`k_cache` and :meth:`v_cache` are invalid after
        this (their memory is unmapped). Without ``close()``, a live view keeps the memory."""
        if getattr(self, "closed", True):
            return
        for s in self.sequences:
            self.free(s)
        self._views = []
        self._bytes = None
        self.store.close()
        self.backend.release_reservation(self.base, self._reserved)
        if self._owns_backend:
            self.backend.close()
        self.closed = True

    def __repr__(self) -> str:
        return (f"VMKVCache({self.spec}, max_seqs={self.max_seqs}, max_seq_len="
                f"{self.max_seq_len}, layout={self.layout!r}, page_size={self.page_size}, "
                f"device={self.device})")  # fmt: skip

    def __enter__(self) -> VMKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CacheView(torch.Tensor):
    """A whole virtual K or V tensor: mostly unmapped, so it prints its shape, never its
    contents (printing reads every element: a fault on the host, a sticky illegal address on
    CUDA). Operations on it return plain tensors (no ``__torch_function__`` overhead)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *args, **kwargs) -> str:
        return (f"CacheView(shape={tuple(self.shape)}, stride={self.stride()}, "
                f"dtype={self.dtype}, device={self.device}; mapped only up to each "
                "sequence's length)")  # fmt: skip

    __str__ = __repr__
