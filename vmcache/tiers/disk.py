"""The disk tier: demoted prefix pages in files under a directory the user gives.

One file per batch that overflows the host tier (one write); a hit reads the file's header and
table, then the span of entries it needs (one read of K/V per run of entries in one file); the
least recently used file goes first over the byte limit. A file is written under a temporary
name and renamed, so no reader ever sees half of one:

    header  magic "VMKVTIER", version u32, n u32, entry_bytes u64, root (16), table sum (16)
    table   n x (digest (16), checksum of the entry's bytes (16))
    data    n x entry_bytes

A file whose size, header, table or entry checksum does not match is corrupt: it is deleted
and every entry in it is a miss (never returned as K/V). Files of other layouts or namespaces
(another root) in the same directory are left alone. Opening a directory indexes the files a
previous cache of the same root left there (a warm restart), oldest modification first out.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .digest import DIGEST_BYTES, checksum

MAGIC, VERSION, SUFFIX = b"VMKVTIER", 1, ".kvt"
_HEAD = struct.Struct(f"<8sIIQ{DIGEST_BYTES}s{DIGEST_BYTES}s")
_ROW = 2 * DIGEST_BYTES


def file_bytes(n: int, entry_bytes: int) -> int:
    """The size of a tier file of ``n`` entries."""
    return _HEAD.size + n * (_ROW + entry_bytes)


@dataclass
class _File:
    digests: list[bytes]
    size: int


@dataclass
class DiskCounters:
    files_written: int = 0
    files_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt_files: int = 0
    files_dropped: int = 0  # by the byte limit
    entries_dropped: int = 0  # entries that left the disk tier by the byte limit


class DiskTier:
    def __init__(self, directory: str | os.PathLike, limit_bytes: int, root: bytes,
                 entry_bytes: int) -> None:  # fmt: skip
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = limit_bytes
        self.root = root
        self.entry_bytes = entry_bytes
        self._files: OrderedDict[str, _File] = OrderedDict()  # owned here; LRU order
        self._where: dict[bytes, tuple[str, int]] = {}  # digest -> (file, index in it)
        self.bytes = 0  # sizes of the indexed files
        self.counters = DiskCounters()
        self._scan()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._where

    def __len__(self) -> int:
        return len(self._where)

    def files(self) -> list[Path]:
        return [self.dir / name for name in self._files]

    def _size(self, n: int) -> int:
        return file_bytes(n, self.entry_bytes)

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                with open(path, "rb") as f:
                    head = f.read(_HEAD.size)
                    magic, version, n, eb, root, tsum = _HEAD.unpack(head)
                    table = f.read(n * _ROW)
                size = path.stat().st_size
            except (OSError, struct.error):
                continue
            if (magic, version, eb, root) != (MAGIC, VERSION, self.entry_bytes, self.root):
                continue  # another layout's or namespace's file: not ours to judge
            if checksum(table) != tsum or size != self._size(n):
                self._drop(path.name, corrupt=True, indexed=False)
                continue
            digests = [table[i * _ROW : i * _ROW + DIGEST_BYTES] for i in range(n)]
            found.append((path.stat().st_mtime_ns, path.name, _File(digests, size)))
        for _, name, file in sorted(found):
            self._index(name, file)
        self._evict()

    def _index(self, name: str, file: _File) -> None:
        self._files[name] = file
        self.bytes += file.size
        for i, d in enumerate(file.digests):
            self._where[d] = (name, i)

    def put(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        """Write ``items`` ((digest, uint8 CPU tensor of ``entry_bytes``), least recently used
        first) not held yet as one file; then drop the oldest files over the byte limit."""
        fresh, seen = [], set()
        for d, blob in items:
            if d in self._where:
                self._files.move_to_end(self._where[d][0])  # used again: keep it longer
            elif d not in seen:
                seen.add(d)
                fresh.append((d, blob))
        while fresh and self._size(len(fresh)) > self.limit_bytes:
            fresh.pop(0)  # the batch alone is over the limit: its oldest go
            self.counters.entries_dropped += 1
        if not fresh:
            return
        datas = [blob.contiguous().view(-1).numpy() for _, blob in fresh]
        table = b"".join(d + checksum(data) for (d, _), data in zip(fresh, datas))
        head = _HEAD.pack(MAGIC, VERSION, len(fresh), self.entry_bytes, self.root,
                          checksum(table))  # fmt: skip
        name = uuid.uuid4().hex + SUFFIX
        tmp = self.dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(head + table + b"".join(memoryview(x) for x in datas))
        os.replace(tmp, self.dir / name)
        file = _File([d for d, _ in fresh], self._size(len(fresh)))
        self._index(name, file)
        self.counters.files_written += 1
        self.counters.bytes_written += file.size
        self._evict()

    def clear(self) -> int:
        """Delete every file of this root (others' files stay); returns how many."""
        names = list(self._files)
        for name in names:
            self._drop(name, corrupt=False)
        return len(names)

    def _evict(self) -> None:
        while self.bytes > self.limit_bytes and self._files:
            name = next(iter(self._files))
            self.counters.entries_dropped += sum(
                self._where.get(d, (None,))[0] == name for d in self._files[name].digests
            )
            self._drop(name, corrupt=False)
            self.counters.files_dropped += 1

    def _drop(self, name: str, *, corrupt: bool, indexed: bool = True) -> None:
        if indexed:
            file = self._files.pop(name)
            self.bytes -= file.size
            for d in file.digests:
                if self._where.get(d, (None,))[0] == name:
                    del self._where[d]
        self.counters.corrupt_files += corrupt
        try:
            os.unlink(self.dir / name)
        except OSError:
            pass

    def get(self, digests: list[bytes]) -> list[torch.Tensor]:
        """The entries of the longest leading run of ``digests`` held on disk and intact
        (uint8 CPU tensors of ``entry_bytes``). Consecutive digests in one file are one run:
        its header and table are read and checked, then the span of entries it needs, in one
        read (a file written by a large eviction is not read whole for a few entries)."""
        out: list[torch.Tensor] = []
        i = 0
        while i < len(digests) and digests[i] in self._where:
            name = self._where[digests[i]][0]
            idx = []
            while i < len(digests) and self._where.get(digests[i], (None,))[0] == name:
                idx.append(self._where[digests[i]][1])
                i += 1
            got = self._read(name, idx)
            out += got
            if len(got) < len(idx):
                break
        return out

    def _read(self, name: str, idx: list[int]) -> list[torch.Tensor]:
        """Entries ``idx`` of file ``name``, as far as they are intact; a file whose size,
        header, table or a needed entry's checksum fails is dropped (counted corrupt)."""
        file, eb = self._files[name], self.entry_bytes
        n = len(file.digests)
        lo, hi = min(idx), max(idx) + 1
        span = bytearray((hi - lo) * eb)
        try:
            with open(self.dir / name, "rb") as f:
                meta = f.read(_HEAD.size + n * _ROW)
                f.seek(_HEAD.size + n * _ROW + lo * eb)
                got = f.readinto(span)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            meta, got, size = b"", 0, -1
        self.counters.files_read += 1
        self.counters.bytes_read += len(meta) + got
        ok = size == file.size and got == len(span) and len(meta) == _HEAD.size + n * _ROW
        if ok:
            table = meta[_HEAD.size :]
            digests = [table[j * _ROW : j * _ROW + DIGEST_BYTES] for j in range(n)]
            want = (MAGIC, VERSION, n, eb, self.root, checksum(table))
            ok = _HEAD.unpack_from(meta) == want and digests == file.digests
        out: list[torch.Tensor] = []
        for k in idx if ok else ():
            data = memoryview(span)[(k - lo) * eb : (k - lo + 1) * eb]
            row = k * _ROW + DIGEST_BYTES
            if checksum(data) != table[row : row + DIGEST_BYTES]:
                break
            out.append(torch.frombuffer(span, dtype=torch.uint8, count=eb, offset=(k - lo) * eb))
        if len(out) < len(idx):
            self._drop(name, corrupt=True)
        else:
            self._files.move_to_end(name)
        return out
