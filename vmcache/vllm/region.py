"""vLLM's KV tensor in a memfd: resident only where written, holes punched where blocks are freed.

    worker (the model)       HostKVRegion: one memfd of the KV space's size, mapped shared at
                             one address; vLLM builds its per-layer views over it. Nothing is
                             resident until a block is written.
    engine core (scheduler)  BlockPuncher: the same memfd, opened through /proc/<worker>/fd/<n>;
                             punches the pages of blocks vLLM freed (they read as zeros after).

They meet through a rendezvous file (JSON: the worker's pid, the memfd's descriptor, its size
and the block layout) that the worker writes, privately, before vLLM builds its scheduler; the
scheduler reads it and removes it. A memfd has no name, so a killed process's KV memory goes
back to the OS with its last holder (a file under /dev/shm would outlive both).

A block's bytes are ``segments``: (offset, stride, span): block b of a segment is
``[offset + b * stride, offset + b * stride + span)``; one segment per layer (and per outer
dimension of a view, e.g. K and V when they are outermost). Memory is given back by *groups*
of ``group_blocks`` consecutive blocks whose bytes are whole pages in every segment (1 where a
block's stride is a multiple of the page, as on the CPU); every segment must start on a page
(:class:`UnsupportedLayout` otherwise, naming it and what makes it so).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vmcache.memory.backends.base import runs
from vmcache.memory.backends.host import punch_hole

MAX_SEGMENTS = 1 << 16  # bounds what a rendezvous file may ask for
MAX_RENDEZVOUS_BYTES = 4 << 20


class UnsupportedLayout(ValueError):
    """vLLM laid its KV tensor out in a way this module cannot give back block by block."""


@dataclass(frozen=True)
class BlockLayout:
    segments: tuple[tuple[int, int, int], ...]  # (offset, stride, span) bytes
    num_blocks: int
    page_bytes: int

    def __post_init__(self) -> None:
        if not 0 < len(self.segments) <= MAX_SEGMENTS or self.num_blocks < 1:
            raise ValueError(f"a layout needs 1..{MAX_SEGMENTS} segments and a block")
        if self.page_bytes < 1 or self.page_bytes & (self.page_bytes - 1):
            raise ValueError(f"page_bytes must be a power of two, got {self.page_bytes}")
        for off, stride, span in self.segments:
            if min(off, stride, span) < 0 or span > stride or stride == 0:
                raise ValueError(f"bad segment (offset {off}, stride {stride}, span {span})")
        g = self.group_blocks
        bad = [off for off, _, _ in self.segments if off % self.page_bytes]
        if bad or self.num_blocks % g:
            raise UnsupportedLayout(
                f"vLLM's KV views ({self.num_blocks} blocks of {self.segments[0][1]} bytes a "
                f"layer) do not start every layer on a {self.page_bytes}-byte page, so groups of "
                f"{g} blocks are not whole pages: a number of blocks that is a multiple of {g} "
                "makes them so (--num-gpu-blocks-override)"
            )

    @property
    def group_blocks(self) -> int:
        """The fewest consecutive blocks whose bytes are whole pages in every segment."""
        return math.lcm(*(self.page_bytes // math.gcd(self.page_bytes, s)
                          for _, s, _ in self.segments))  # fmt: skip

    @property
    def num_groups(self) -> int:
        return self.num_blocks // self.group_blocks

    @property
    def block_bytes(self) -> int:
        """The bytes one block spans over every layer."""
        return sum(stride for _, stride, _ in self.segments)

    @property
    def group_bytes(self) -> int:
        return self.block_bytes * self.group_blocks

    @property
    def extent(self) -> int:
        """The bytes the layout's groups address (to the end of the last block's stride)."""
        return max(off + self.num_blocks * stride for off, stride, _ in self.segments)

    def ranges(self, groups: list[int]) -> list[tuple[int, int]]:
        """(offset, length) of the bytes of ``groups`` in every segment (whole pages),
        adjacent groups merged."""
        ids = sorted(set(groups))
        if ids and not (0 <= ids[0] and ids[-1] < self.num_groups):
            raise ValueError(f"group ids outside [0, {self.num_groups})")
        g = self.group_blocks
        return [(off + ids[start] * g * stride, count * g * stride)
                for off, stride, _ in self.segments for start, count in runs(ids, 1)]  # fmt: skip

    @classmethod
    def from_views(cls, views: list[torch.Tensor], base: int, num_blocks: int,
                   page_bytes: int) -> BlockLayout:  # fmt: skip
        """The layout of vLLM's per-layer views (blocks along dimension 0, ``num_blocks``
        logical blocks, each of ``shape[0] // num_blocks`` kernel blocks) over memory at
        ``base``; as vLLM's KV-block zeroer reads them."""
        segs: dict[int, tuple[int, int, int]] = {}
        for kv in views:
            if kv.ndim < 1 or kv.shape[0] % num_blocks:
                raise UnsupportedLayout(
                    f"a KV view of shape {tuple(kv.shape)} does not hold {num_blocks} blocks "
                    "along its first dimension"
                )
            ratio, el = kv.shape[0] // num_blocks, kv.element_size()
            kstride = kv.stride(0) * el
            outer = [d for d in range(1, kv.ndim) if kv.stride(d) * el > kstride]
            inner = [d for d in range(1, kv.ndim) if d not in outer]
            kspan = el + sum((kv.shape[d] - 1) * kv.stride(d) * el for d in inner)
            span, stride = (ratio - 1) * kstride + kspan, ratio * kstride
            for idx in itertools.product(*(range(kv.shape[d]) for d in outer)):
                off = kv.data_ptr() - base + sum(i * kv.stride(d) * el for i, d in zip(idx, outer))
                if off < 0:
                    raise UnsupportedLayout("a KV view lies before the KV buffer")
                segs[off] = (off, stride, max(span, segs.get(off, (0, 0, 0))[2]))
        return cls(tuple(sorted(segs.values())), num_blocks, page_bytes)


class HostKVRegion:
    """The worker's KV memory: a memfd of ``nbytes`` (whole pages) mapped shared once."""

    def __init__(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self.page_bytes = mmap.PAGESIZE
        self.nbytes = -(-nbytes // self.page_bytes) * self.page_bytes
        self.fd = os.memfd_create("vmcache-vllm-kv", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        except BaseException:
            os.close(self.fd)
            raise

    def tensor(self, nbytes: int, dtype: torch.dtype = torch.int8) -> torch.Tensor:
        """The first ``nbytes`` as a 1-D tensor (reads as zeros until written)."""
        if nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes asked of a {self.nbytes}-byte region")
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes).view(dtype)

    @property
    def base(self) -> int:
        return self.tensor(1).data_ptr()

    def resident_bytes(self) -> int:
        """The memfd's bytes backed by memory now (its allocated blocks)."""
        return os.fstat(self.fd).st_blocks * 512

    def publish(self, path: Path, layout: BlockLayout) -> None:
        publish_rendezvous(path, "host", self.fd, self.nbytes, layout)


def publish_rendezvous(path: Path, kind: str, fd: int, nbytes: int, layout: BlockLayout) -> None:
    """Write the rendezvous file (atomically, 0600): this process's memfd ``fd`` of ``nbytes``
    (``kind`` "host": the KV memory itself; "groups": one byte a group the scheduler sets)."""
    body = {"kind": kind, "pid": os.getpid(), "fd": fd, "nbytes": nbytes,
            "num_blocks": layout.num_blocks, "page_bytes": layout.page_bytes,
            "segments": [list(s) for s in layout.segments]}  # fmt: skip
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(out, "w") as fh:
        json.dump(body, fh)
    os.replace(tmp, path)


def open_peer_fd(body: dict) -> int:
    """The worker's memfd named by a rendezvous ``body``, opened through /proc and checked."""
    src = f"/proc/{body['pid']}/fd/{body['fd']}"
    try:
        fd = os.open(src, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise RuntimeError(f"cannot open the vLLM worker's KV memory {src}: {e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != body["nbytes"]:
        os.close(fd)
        raise RuntimeError(f"{src} is not the worker's memfd (size {st.st_size}, expected "
                           f"{body['nbytes']})")  # fmt: skip
    return fd


def open_worker_memory(path: Path):
    """The scheduler's handle on the worker's KV memory published at ``path`` (which it
    removes): a :class:`BlockPuncher` (host) or a :class:`vmcache.vllm.device.WantedGroups`.
    Either has ``layout``, ``back(groups)``, ``unback(groups)``, ``punch`` (a callable that
    gives single blocks back, or None) and ``close()``."""
    body = _read_rendezvous(path)
    layout = BlockLayout(tuple(tuple(s) for s in body["segments"]), body["num_blocks"],
                         body["page_bytes"])  # fmt: skip
    if body.get("kind") == "host":
        if layout.extent > body["nbytes"]:
            raise ValueError(f"{path}: the layout addresses past the KV memory's end")
        handle = BlockPuncher(body, layout)
    elif body.get("kind") == "groups":
        from vmcache.vllm.device import WantedGroups

        if body["nbytes"] != layout.num_groups:
            raise ValueError(f"{path}: {body['nbytes']} bytes for {layout.num_groups} groups")
        handle = WantedGroups(body, layout)
    else:
        raise ValueError(f"{path}: unknown kind {body.get('kind')!r}")
    path.unlink(missing_ok=True)
    return handle


class BlockPuncher:
    """The scheduler's handle on the worker's host KV memory (see the module docstring)."""

    def __init__(self, body: dict, layout: BlockLayout) -> None:
        self.layout = layout
        self.fd = open_peer_fd(body)
        # single blocks can be given back where a group is one block
        self.punch = self.release if layout.group_blocks == 1 else None

    def back(self, groups: list[int]) -> None:
        """Nothing to do: a written page of the memfd is resident from its first write."""

    def unback(self, groups: list[int]) -> None:
        self.release(groups)

    def release(self, groups: list[int]) -> None:
        """Give the pages of ``groups`` back to the OS; they read as zeros after."""
        for off, length in self.layout.ranges(groups):
            punch_hole(self.fd, off, length)

    def resident_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def rendezvous_path(instance_id: str, rank: int) -> Path:
    """Where the worker of engine ``instance_id``, rank ``rank``, meets its scheduler: in a
    directory of this user's, 0700, under the temporary directory."""
    if not instance_id.replace("-", "").isalnum() or len(instance_id) > 64:
        raise ValueError(f"unexpected vLLM instance id {instance_id!r}")
    d = Path(tempfile.gettempdir()) / f"vmcache-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{d} must be a directory of this user's, 0700")
    return d / f"vllm-{instance_id}-{int(rank)}.json"


def _read_rendezvous(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_RENDEZVOUS_BYTES + 1)
    except OSError as e:
        raise RuntimeError(
            f"no vmcache KV memory published at {path} ({e.strerror}): start vLLM with "
            "--worker-cls vmcache.vllm.worker.VmcacheCPUWorker"
        ) from None
    if len(raw) > MAX_RENDEZVOUS_BYTES:
        raise ValueError(f"{path} is larger than a rendezvous file may be")
    body = json.loads(raw)
    ints = ("pid", "fd", "nbytes", "num_blocks", "page_bytes")
    if not isinstance(body, dict) or body.get("kind") not in ("host", "groups"):
        raise ValueError(f"{path} is not a vmcache rendezvous file")
    if not isinstance(body, dict) or any(type(body.get(k)) is not int or body[k] < 0 for k in ints):
        raise ValueError(f"{path} is not a vmcache rendezvous file")
    segs = body.get("segments")
    if not isinstance(segs, list) or not all(
        isinstance(s, list) and len(s) == 3 and all(type(v) is int for v in s) for s in segs
    ):
        raise ValueError(f"{path} has malformed segments")
    return body
