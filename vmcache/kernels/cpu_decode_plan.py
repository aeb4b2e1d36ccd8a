"""The CPU decode kernel's plan and call (:mod:`vmcache.kernels.cpu_decode` holds the kernel
itself): a step's read indices, lengths and write rows checked once and the parts and scratch
chosen once for every layer (:class:`DecodeRows`), then one kernel call a layer with that
layer's queries, its place in the store and, where the plan writes, the new K/V rows;
:func:`decode_rows` plans and runs once."""

from __future__ import annotations

import torch

from vmcache.kernels.cpu_decode import KERNEL, MIN_PART_ROWS


class DecodeRows:
    """One step's decodes planned once for every layer (plan, then run): ``read`` and
    ``kv_lens`` checked and made contiguous, the parts chosen, the scratch allocated; then
    :meth:`__call__` once a layer, with that layer's queries and place in the store.

    read     int64 ``[B, S]``: row of sequence b's position j (read only for j < kv_len)
    kv_lens  int64 ``[B]``, each in [1, S]
    rows     how many rows each layer's K (and V) has: every read index is below it
    heads    N_Q, the query heads; dim: d_h
    write    int64 ``[N]`` or None: the rows each layer's new K/V go to (then every call
             stores its ``k``, ``v`` there before reading, in the kernel: no index_copy_)
    """

    def __init__(self, read: torch.Tensor, kv_lens: torch.Tensor, rows: int, heads: int,
                 dim: int, write: torch.Tensor | None = None) -> None:  # fmt: skip
        fn = KERNEL.fn
        if fn is None:
            raise RuntimeError(f"the CPU decode kernel is not available: {KERNEL.reason}")
        if read.dim() != 2 or read.shape[0] < 1 or heads < 1 or dim < 1:
            raise ValueError(f"shapes do not agree: read {list(read.shape)}, {heads} heads "
                             f"of {dim}")  # fmt: skip
        b, span = read.shape
        lens = kv_lens.to(torch.int64).contiguous()
        if lens.shape != (b,) or int(lens.min()) < 1 or int(lens.max()) > span:
            raise ValueError(f"kv_lens must be {b} lengths in [1, {span}]")
        read = read.to(torch.int64).contiguous()
        if int(read.min()) < 0 or int(read.max()) >= rows:
            raise ValueError(f"read indices must be rows in [0, {rows})")
        if write is not None:
            write = write.to(torch.int64).contiguous()
            if write.dim() != 1 or (write.numel() and (int(write.min()) < 0
                                                       or int(write.max()) >= rows)):  # fmt: skip
                raise ValueError(f"write indices must be rows in [0, {rows})")
        self.fn, self.read, self.lens, self.rows, self.write = fn, read, lens, rows, write
        self.shape = (b, heads, dim)  # the queries' [B, N_Q, d_h]
        self.threads = torch.get_num_threads()
        # parts a sequence: enough tasks for every thread, none under MIN_PART_ROWS rows
        self.parts = max(1, min(-(-2 * self.threads // b), span // MIN_PART_ROWS))
        self.scratch = torch.empty(b * span * heads, dtype=torch.float32)
        self.partial = torch.empty(b * self.parts * heads * (dim + 2), dtype=torch.float32)

    def __call__(self, q: torch.Tensor, store: torch.Tensor, layout: tuple[int, int, int, int],
                 scale: float, k: torch.Tensor | None = None,
                 v: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """q float32 ``[B, N_Q, d_h]`` (one query a sequence), store float32 ``[E]``
        contiguous, layout (rows, R, K's offset, V's offset) in elements, R = N_KV · d_h;
        k, v float32 ``[N, R]``: the new rows, stored at the plan's ``write`` first (both or
        neither; a plan made with ``write`` only) → float32 ``[B, N_Q, d_h]``."""
        rows, width, k_at, v_at = layout
        b, heads, dim = self.shape
        f32 = torch.float32
        n = -1 if self.write is None else self.write.shape[0]
        if (q.dtype is not f32 or store.dtype is not f32 or not q.is_cpu
                or q.shape != self.shape or width < dim or width % dim or heads % (width // dim)
                or rows != self.rows or not store.is_contiguous() or min(k_at, v_at) < 0
                or max(k_at, v_at) + rows * width > store.numel()
                or (k is not None or v is not None) and (
                    k is None or v is None or k.dtype is not f32 or v.dtype is not f32
                    or k.shape != (n, width) or v.shape != (n, width))):  # fmt: skip
            self._refuse(q, store, layout, k, v)  # (one test a layer; the reason only here)
        new = (None, None, None, 0, width, width)
        if k is not None:  # (rows apart by any stride: a slice of a fused GEMM's output is one)
            k = k if k.stride(1) == 1 else k.contiguous()
            v = v if v.stride(1) == 1 else v.contiguous()
            new = (k.data_ptr(), v.data_ptr(), self.write.data_ptr(), n, k.stride(0), v.stride(0))
        q = q.contiguous()
        out = torch.empty_like(q)
        self.fn(q.data_ptr(), store.data_ptr(), k_at, v_at, self.read.data_ptr(),
                self.lens.data_ptr(), out.data_ptr(), self.scratch.data_ptr(),
                self.partial.data_ptr(), b, self.read.shape[1], heads, width // dim, dim,
                self.parts, scale, self.threads, *new)  # fmt: skip
        return out

    def _refuse(self, q, store, layout, k, v) -> None:
        """Why :meth:`__call__` refuses these arguments, raised."""
        rows, width, k_at, v_at = layout
        b, heads, dim = self.shape
        if (q.dtype, store.dtype) != (torch.float32, torch.float32) or q.device.type != "cpu":
            raise TypeError("decode_rows takes float32 CPU tensors")
        if (tuple(q.shape) != self.shape or width < dim or width % dim
                or heads % (width // dim) or rows != self.rows):  # fmt: skip
            raise ValueError(f"shapes do not agree: q {list(q.shape)} (planned "
                             f"{list(self.shape)}), R {width}, {rows} rows "
                             f"(planned {self.rows})")  # fmt: skip
        if not store.is_contiguous() or min(k_at, v_at) < 0 or (
                max(k_at, v_at) + rows * width > store.numel()):  # fmt: skip
            raise ValueError("layout's rows pass the end of store")
        n = -1 if self.write is None else self.write.shape[0]
        raise ValueError(f"k and v must be float32 [{n}, {width}] (a plan with write)")


def decode_rows(q: torch.Tensor, store: torch.Tensor, layout: tuple[int, int, int, int],
                read: torch.Tensor, kv_lens: torch.Tensor,
                scale: float) -> torch.Tensor:  # fmt: skip
    """Decode attention over stored rows (see the module docstring), planned and run once;
    a step of many layers plans once (:class:`DecodeRows`).

    q        float32 ``[B, N_Q, d_h]``, one query a sequence
    store    float32 ``[E]``, contiguous: the cache's storage (unmapped parts never read)
    layout   (rows, R, K's offset, V's offset) in elements, R = N_KV · d_h
    read     int64 ``[B, S]``: row of sequence b's position j (read only for j < kv_len)
    kv_lens  int64 ``[B]``, each in [1, S]
    → float32 ``[B, N_Q, d_h]``
    """
    if read.dim() != 2 or q.dim() != 3 or read.shape[0] != q.shape[0]:
        raise ValueError(f"shapes do not agree: q {list(q.shape)}, read {list(read.shape)}")
    return DecodeRows(read, kv_lens, layout[0], q.shape[1], q.shape[2])(q, store, layout, scale)
