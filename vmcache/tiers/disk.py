"""The disk tier: demoted prefix pages in files under a directory the user gives.

One file per batch that overflows the host tier (one write), read whole on a hit (one read),
least recently used file first out over the byte limit. A file is written under a temporary
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
        (uint8 CPU tensors of ``entry_bytes``); each file read once, whole (one I/O)."""
        out: list[torch.Tensor] = []
        opened: dict[str, bytes | None] = {}
        for d in digests:
            if d not in self._where:
                break
            name, i = self._where[d]
            if name not in opened:
                opened[name] = self._read(name)
            raw = opened[name]
            if raw is None:
                break
            n = len(self._files[name].digests)
            start = _HEAD.size + n * _ROW + i * self.entry_bytes
            row = _HEAD.size + i * _ROW + DIGEST_BYTES
            data = memoryview(raw)[start : start + self.entry_bytes]
            if checksum(data) != raw[row : row + DIGEST_BYTES]:
                self._drop(name, corrupt=True)
                opened[name] = None
                break
            self._files.move_to_end(name)
            out.append(torch.frombuffer(raw, dtype=torch.uint8, count=self.entry_bytes,
                                        offset=start))  # fmt: skip
        return out

    def _read(self, name: str) -> bytearray | None:
        """The whole file (one read) if its size, header and table check out (else the file
        is dropped: None)."""
        file = self._files[name]
        raw = bytearray(file.size)
        try:
            with open(self.dir / name, "rb") as f:
                got = f.readinto(raw)
                ok = got == file.size and not f.read(1)  # neither truncated nor grown
        except OSError:
            got, ok = 0, False
        self.counters.files_read += 1
        self.counters.bytes_read += got
        n = len(file.digests)
        if ok:
            head = _HEAD.unpack_from(raw)
            table = bytes(raw[_HEAD.size : _HEAD.size + n * _ROW])
            digests = [table[j * _ROW : j * _ROW + DIGEST_BYTES] for j in range(n)]
            want = (MAGIC, VERSION, n, self.entry_bytes, self.root, checksum(table))
            ok = head == want and digests == file.digests
        if not ok:
            self._drop(name, corrupt=True)
            return None
        return raw
