"""Weights the CPU step streams every step, copied into one file-backed mapping: a private
mapping of a file the process writes and unlinks at once (in a private directory), as
llama.cpp maps its weights. On an AMD EPYC VM (2 cores, 2026-12-06) the kernel backed such
mappings with large folios while anonymous memory got 4 KiB pages even where advised
(``MADV_HUGEPAGE``): SmolLM2's packed GEMMs at a decode's 2 rows took 22.8 ms from torch's
allocations and 19.1 ms from the mapping (one run of 20 alternating passes), the page walks of
the stream being the difference; the whole-graph package's weights, inside its shared library,
were mapped so already. Nothing of it outlives the tensors: the file has no name after
:func:`file_backed` returns, and the pages are the page cache's (no second copy in anonymous
memory once the originals are freed).
"""

from __future__ import annotations

import os
import tempfile

import torch

ALIGN_BYTES = 64  # each tensor's start: a cache line (and an AVX-512 vector)


def file_backed(tensors: list[torch.Tensor], directory: str | os.PathLike) -> list[torch.Tensor]:
    """Copies of float32 CPU ``tensors`` (contiguous), each a view of one private mapping of a
    file written in ``directory`` (which must be private: the file is 0600 and unlinked before
    this returns) → the views, in order."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise TypeError("file_backed takes float32 CPU tensors")
    step = ALIGN_BYTES // 4
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() // step) * step
    if total == 0:
        return [t.clone() for t in tensors]
    fd, path = tempfile.mkstemp(prefix=".weights-", dir=directory)  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as f:
            for t, at in zip(tensors, offsets):
                f.seek(at * 4)
                f.write(t.detach().contiguous().numpy().data)
            f.truncate(total * 4)
        flat = torch.from_file(path, shared=False, size=total, dtype=torch.float32)
    finally:
        os.unlink(path)
    return [flat[at : at + t.numel()].view(t.shape) for t, at in zip(tensors, offsets)]
