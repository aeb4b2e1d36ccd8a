"""PrefixTiers: where the prefix index's evicted pages go, and where a miss looks next.

    device (PrefixIndex)  --evict-->  host RAM (HostTier)  --overflow-->  disk (DiskTier)
          ^                              |                                  |
          +------ promote on a hit ------+---------------------------------+

An entry is one full page of tokens: one page per table, ``entry_bytes`` in all, named by its
digest (:mod:`vmcache.prefix.tiers.digest`). Eviction demotes (one device-to-host copy for all the
entries one reclaim evicts; the host tier's overflow goes to disk as one file); a lookup that
runs past the device index promotes the longest run of consecutive pages the tiers hold (each
disk file read once, one host-to-device copy). The host tier gives a promoted entry up (its
bytes are on the device again); the disk keeps its copy, so evicting the entry again costs
no write. Each tier has its own byte limit and least-recently-used order.

A tiers object serves one cache (``bind`` once): the cache passes it as ``prefix_tiers=``,
and ``close()`` of the cache gives the disk tier's directory up. A directory serves one
PrefixTiers at a time, in any process (a second one is refused with
:class:`~vmcache.prefix.tiers.files.TierDirectoryError`): one byte limit and one LRU order per
directory, and no process deletes files another is serving. Its files are authenticated with a
secret key (``key=``, else the directory's own private key file): see
:mod:`vmcache.prefix.tiers.files` for what that protects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vmcache.errors import check_int
from vmcache.prefix.tiers.digest import root_digest
from vmcache.prefix.tiers.disk import DiskTier
from vmcache.prefix.tiers.files import KEY_BYTES, dir_key, private_dir
from vmcache.prefix.tiers.host import HostTier


@dataclass(frozen=True)
class TierStats:
    demoted_pages: int  # entries x tables sent down from the device
    promoted_host_pages: int  # brought back to the device from host RAM
    promoted_disk_pages: int  # brought back from disk
    host_bytes: int  # held now
    disk_bytes: int  # held now (file sizes)
    dropped_pages: int  # left the last tier (byte limits)
    disk_files_written: int
    disk_files_read: int
    disk_bytes_written: int
    disk_bytes_read: int
    corrupt_files: int  # failed a size or MAC test, or vanished: deleted, a miss
    device_copies: int  # device <-> host transfers (one per demotion or promotion batch)
    failed_disk_writes: int = 0  # demotions the disk refused (full, quota): entries dropped
    skipped_files: int = 0  # tier-file names that were no regular file: never opened


class PrefixTiers:
    def __init__(self, host_bytes: int = 0, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0, *, namespace: str = "",
                 key: bytes | None = None) -> None:  # fmt: skip
        """``host_bytes``: the host-RAM tier's limit (0: none). ``disk_dir`` and
        ``disk_bytes``: the disk tier's directory (created 0700 if missing; files a previous
        cache of the same layout, ``namespace`` and key left there are used) and limit.
        ``namespace`` names the model weights: give one whenever two models could share a
        directory. ``key`` (at least 16 bytes): the secret that authenticates tier files and
        keys page digests; without one the directory keeps its own (``.key``, 0600), and must
        then belong to this user alone."""
        if check_int("host_bytes", host_bytes) < 0 or check_int("disk_bytes", disk_bytes) < 0:
            raise ValueError("tier byte limits must be >= 0")
        if (disk_dir is None) != (disk_bytes == 0):
            raise ValueError("give disk_dir and disk_bytes > 0 together, or neither")
        if not host_bytes and disk_dir is None:
            raise ValueError("no tier: give host_bytes > 0, or disk_dir and disk_bytes")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        if key is not None:
            if not isinstance(key, bytes):
                raise TypeError(f"key must be bytes, got {type(key).__name__}")
            if not 16 <= len(key) <= 64:
                raise ValueError(f"key must be 16 to 64 bytes, got {len(key)}")
        self._key = key
        self.host = HostTier(host_bytes)
        self.disk: DiskTier | None = None
        self._disk_args = (disk_dir, disk_bytes)
        self.namespace = namespace
        self.root: bytes | None = None  # set by bind: the digest chain's start
        self.entry_bytes = 0
        self._demoted = self._from_host = self._from_disk = self._dropped = self._copies = 0

    def bind(self, layout: dict, entry_bytes: int) -> bytes:
        """Attach to one cache (its layout fields, the bytes of one entry); returns the
        digest chain's root. Opens the disk tier (indexing files already there)."""
        if self.root is not None:
            raise ValueError("these PrefixTiers already serve a cache (one cache each)")
        disk_dir, disk_bytes = self._disk_args
        key = self._key
        if key is None and disk_dir is not None:
            private_dir(Path(disk_dir), shared_ok=False)
            key = dir_key(Path(disk_dir))
        elif key is None:  # RAM only: nothing outlives the process, any secret will do
            key = os.urandom(KEY_BYTES)
        root = root_digest({**layout, "namespace": self.namespace}, key)
        if disk_dir is not None:
            self.disk = DiskTier(disk_dir, disk_bytes, root, entry_bytes, key,
                                 shared_ok=self._key is not None)  # fmt: skip
        self.root, self.entry_bytes = root, entry_bytes
        return self.root

    def close(self) -> None:
        """Give the disk tier's directory up (its files stay for the next cache); the cache's
        ``close()`` calls this."""
        if self.disk is not None:
            self.disk.close()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.host or (self.disk is not None and digest in self.disk)

    def demote(self, digests: list[bytes], data: torch.Tensor, tables: int) -> None:
        """Entries the device index evicts, least recently used first: ``data`` is uint8
        ``[len(digests) * tables, page_bytes]`` on the host, entry i in rows i*tables...
        (one device copy made it)."""
        self._copies += 1
        self._demoted += len(digests) * tables
        blobs = data.view(len(digests), -1)
        items = [(d, blobs[i].clone()) for i, d in enumerate(digests)]  # own their bytes
        over = self.host.put(items) if self.host.limit_bytes else items
        if self.disk is not None and over:
            self.disk.put(over)
        else:
            self._dropped += len(over)

    def fetch(self, digests: list[bytes]) -> list[torch.Tensor]:
        """The bytes (uint8 CPU, ``entry_bytes`` each) of the longest leading run of
        ``digests`` the tiers hold intact. Host entries leave the host tier; a corrupt disk
        file ends the run (and is deleted)."""
        out: list[torch.Tensor] = []
        i = 0
        while i < len(digests):
            blob = self.host.take(digests[i])
            if blob is not None:
                out.append(blob.view(-1))
                self._from_host += 1
                i += 1
                continue
            if self.disk is None:
                break
            j = i
            while j < len(digests) and digests[j] in self.disk and digests[j] not in self.host:
                j += 1
            got = self.disk.get(digests[i:j])
            out += got
            self._from_disk += len(got)
            if len(got) < j - i or j == i:
                break
            i = j
        return out

    def clear(self) -> None:
        """Empty both tiers: the host tier's tensors go, and the disk tier's files of this
        layout and namespace are deleted (e.g. once the weights they came from changed)."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def promoted(self, count: int) -> None:
        """``count`` fetched entries went to the device (one copy)."""
        self._copies += 1 if count else 0

    def stats(self, tables: int) -> TierStats:
        c = self.disk.counters if self.disk is not None else None
        return TierStats(
            demoted_pages=self._demoted,
            promoted_host_pages=self._from_host * tables,
            promoted_disk_pages=self._from_disk * tables,
            host_bytes=self.host.bytes,
            disk_bytes=self.disk.bytes if self.disk is not None else 0,
            dropped_pages=(self._dropped + (c.entries_dropped + c.entries_lost if c else 0))
            * tables,
            disk_files_written=c.files_written if c else 0,
            disk_files_read=c.files_read if c else 0,
            disk_bytes_written=c.bytes_written if c else 0,
            disk_bytes_read=c.bytes_read if c else 0,
            corrupt_files=c.corrupt_files if c else 0,
            device_copies=self._copies,
            failed_disk_writes=c.failed_writes if c else 0,
            skipped_files=c.skipped_files if c else 0,
        )
