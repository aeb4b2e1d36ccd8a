"""The disk tier: demoted prefix pages in files under a directory the user gives.

One file per batch that overflows the host tier (one write); a hit reads the file's header and
table, then the span of entries it needs (one read of K/V per run of entries in one file); the
least recently used file goes first over the byte limit. A file is written under a temporary
name (0600, exclusive create) and renamed, so no reader ever sees half of one:

    header  magic "VMKVTIER", version u32, n u32, entry_bytes u64, root tag (16), table MAC (16)
    table   n x (digest (16), MAC of digest + the entry's bytes (16))
    data    n x entry_bytes

Every MAC is keyed (:mod:`vmcache.prefix.tiers.digest`): a file planted or edited by anyone without
the key fails its checks. A file whose size, header, table or entry MAC does not match is
corrupt: it is deleted and every entry in it is a miss (never returned as K/V). Anything that
is not a regular file is never opened for reading (a FIFO cannot block the cache), skipped and
counted. Files of other layouts or namespaces (another root) are left alone. Opening a
directory (see :mod:`~vmcache.prefix.tiers.files`: private, one user of it at a time) removes
temporary files a crashed writer left and indexes the files a previous cache of the same root
left there (a warm restart), oldest modification first out. A write that fails (disk full, a
quota) removes its temporary file, drops its entries (a later miss) and is counted; it never
raises into the eviction that demoted them.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from vmcache.prefix.tiers import files
from vmcache.prefix.tiers.digest import DIGEST_BYTES, mac, mac_key, root_tag

MAGIC, VERSION, SUFFIX = b"VMKVTIER", 2, ".kvt"
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
    failed_writes: int = 0  # demotions the disk refused (full, quota): their entries dropped
    entries_lost: int = 0  # entries of failed writes (a later miss; their pages were freed)
    skipped_files: int = 0  # names like a tier file that are no regular file: never opened
    stale_temporaries: int = 0  # temporary files of a crashed writer, removed at open


class DiskTier:
    def __init__(self, directory: str | os.PathLike, limit_bytes: int, root: bytes,
                 entry_bytes: int, key: bytes, shared_ok: bool = False) -> None:  # fmt: skip
        self.dir = Path(directory)
        self._lock = -1
        files.private_dir(self.dir, shared_ok)
        self._lock = files.lock_dir(self.dir)  # held until close(): this tier's directory
        self.limit_bytes = limit_bytes
        self.root = root
        self._tag = root_tag(root)
        self._mac = mac_key(key)
        self.entry_bytes = entry_bytes
        self._files: OrderedDict[str, _File] = OrderedDict()  # owned here; LRU order
        self._where: dict[bytes, tuple[str, int]] = {}  # digest -> (file, index in it)
        self.bytes = 0  # sizes of the indexed files
        self.counters = DiskCounters()
        self._scan()

    def close(self) -> None:
        """Give the directory up (its files stay, for the next cache)."""
        if getattr(self, "_lock", -1) >= 0:
            os.close(self._lock)
            self._lock = -1

    def __del__(self) -> None:
        self.close()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._where

    def __len__(self) -> int:
        return len(self._where)

    def files(self) -> list[Path]:
        return [self.dir / name for name in self._files]

    def _size(self, n: int) -> int:
        return file_bytes(n, self.entry_bytes)

    def _table_mac(self, head: bytes, table: bytes) -> bytes:
        return mac(self._mac, head[: _HEAD.size - DIGEST_BYTES], table)

    def _scan(self) -> None:
        found = []
        for path in self.dir.iterdir():
            if path.name.endswith(SUFFIX + ".tmp"):
                self._unlink(path.name)  # a writer died mid-file (we own the directory)
                self.counters.stale_temporaries += 1
                continue
            if not path.name.endswith(SUFFIX):
                continue
            got = self._read_meta(path.name)
            if got is None:
                continue
            (n, size, mtime), table = got
            digests = [table[i * _ROW : i * _ROW + DIGEST_BYTES] for i in range(n)]
            found.append((mtime, path.name, _File(digests, size)))
        for _, name, file in sorted(found):
            self._index(name, file)
        self._evict()

    def _read_meta(self, name: str):
        """((n, size, mtime), table) of our file ``name``, checked; None for another root's
        file (left alone) or a non-regular one (skipped); a damaged one is deleted."""
        fd = files.open_regular(self.dir / name)
        if fd is None:
            self.counters.skipped_files += 1
            return None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, _HEAD.size, 0)
            if len(head) < _HEAD.size:
                return self._damaged(name)
            magic, version, n, eb, tag, tmac = _HEAD.unpack(head)
            if (magic, version, eb, tag) != (MAGIC, VERSION, self.entry_bytes, self._tag):
                return None  # another layout's or namespace's file: not ours to judge
            if st.st_size != self._size(n):  # checked before reading n rows
                return self._damaged(name)
            table = os.pread(fd, n * _ROW, _HEAD.size)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(table) != n * _ROW or self._table_mac(head, table) != tmac:
            return self._damaged(name)
        return (n, st.st_size, st.st_mtime_ns), table

    def _damaged(self, name: str) -> None:
        self.counters.corrupt_files += 1
        self._unlink(name)

    def _index(self, name: str, file: _File) -> None:
        self._files[name] = file
        self.bytes += file.size
        for i, d in enumerate(file.digests):
            self._where[d] = (name, i)

    def put(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        """Write ``items`` ((digest, uint8 CPU tensor of ``entry_bytes``), least recently used
        first) not held yet as one file; then drop the oldest files over the byte limit. A
        failed write drops the items (counted) and raises nothing."""
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
        table = b"".join(d + mac(self._mac, d, data) for (d, _), data in zip(fresh, datas))
        head = _HEAD.pack(MAGIC, VERSION, len(fresh), self.entry_bytes, self._tag, bytes(16))
        head = head[:-DIGEST_BYTES] + self._table_mac(head, table)
        name = uuid.uuid4().hex + SUFFIX
        try:
            files.write_private(self.dir / (name + ".tmp"), [head, table, *datas])
            os.replace(self.dir / (name + ".tmp"), self.dir / name)
        except OSError:
            self._unlink(name + ".tmp")
            self.counters.failed_writes += 1
            self.counters.entries_lost += len(fresh)
            return
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

    def _drop(self, name: str, *, corrupt: bool) -> None:
        file = self._files.pop(name)
        self.bytes -= file.size
        for d in file.digests:
            if self._where.get(d, (None,))[0] == name:
                del self._where[d]
        self.counters.corrupt_files += corrupt
        self._unlink(name)

    def _unlink(self, name: str) -> None:
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
        header, table or a needed entry's MAC fails (or that is no longer a regular file) is
        dropped (counted corrupt)."""
        file, eb = self._files[name], self.entry_bytes
        n = len(file.digests)
        lo, hi = min(idx), max(idx) + 1
        span = bytearray((hi - lo) * eb)
        meta, got = b"", 0
        fd = files.open_regular(self.dir / name)
        if fd is not None:
            try:
                if os.fstat(fd).st_size == file.size:
                    meta = os.pread(fd, _HEAD.size + n * _ROW, 0)
                    got = os.preadv(fd, [span], _HEAD.size + n * _ROW + lo * eb)
            except OSError:
                meta, got = b"", 0
            finally:
                os.close(fd)
        self.counters.files_read += 1
        self.counters.bytes_read += len(meta) + got
        ok = got == len(span) and len(meta) == _HEAD.size + n * _ROW
        if ok:
            head, table = meta[: _HEAD.size], meta[_HEAD.size :]
            digests = [table[j * _ROW : j * _ROW + DIGEST_BYTES] for j in range(n)]
            want = (MAGIC, VERSION, n, eb, self._tag, self._table_mac(head, table))
            ok = _HEAD.unpack(head) == want and digests == file.digests
        out: list[torch.Tensor] = []
        for k in idx if ok else ():
            data = memoryview(span)[(k - lo) * eb : (k - lo + 1) * eb]
            row = k * _ROW + DIGEST_BYTES
            if mac(self._mac, file.digests[k], data) != table[row : row + DIGEST_BYTES]:
                break
            out.append(torch.frombuffer(span, dtype=torch.uint8, count=eb, offset=(k - lo) * eb))
        if len(out) < len(idx):
            self._drop(name, corrupt=True)
        else:
            self._files.move_to_end(name)
        return out
