"""The disk tier's directory as something read from outside the process: private permissions,
an exclusive owner, a secret key, and opens that only ever read regular files.

    <dir>/            0700, created here (or given: with no key it must be this user's alone)
      .lock           flock'ed by the one PrefixTiers that uses the directory (any process)
      .key            32 random bytes, 0600, created once (exclusive create), read after
      <uuid>.kvt      tier files, 0600, written under <uuid>.kvt.tmp and renamed

Trust: whoever can write the directory can delete or damage files (a miss, counted), but
without the key cannot make a file the tier serves; whoever can read it learns nothing of the
prompts (page digests are keyed). The key file protects only as well as its directory's
permissions; a key given by the caller (``PrefixTiers(key=...)``) protects a shared directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

KEY_BYTES = 32
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class TierDirectoryError(ValueError):
    """The tier directory cannot be used safely (permissions, owner, its key) or is in use by
    another PrefixTiers."""


def private_dir(path: Path, shared_ok: bool) -> None:
    """Create ``path`` (0700) if missing; refuse a symlink, a non-directory, and (unless the
    caller gives a key, ``shared_ok``) a directory another user owns or can write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise TierDirectoryError(f"tier directory {path} is not a directory (or is a symlink)")
    if not shared_ok and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise TierDirectoryError(
            f"tier directory {path} is owned by another user or writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):o}): others could replace its key; give "
            "PrefixTiers(key=...) to use a shared directory"
        )


def lock_dir(path: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``<path>/.lock`` (held until the fd closes):
    one PrefixTiers per directory, in this process or any other."""
    fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise TierDirectoryError(
                f"tier directory {path} is in use by another PrefixTiers (this process or "
                "another): one cache per directory; close() the other or give another "
                "directory"
            ) from None
        raise
    return fd


def dir_key(path: Path) -> bytes:
    """The directory's secret: ``<path>/.key``, created once (random, 0600, published with an
    exclusive link so two creators agree), then read; refused if it is not a private regular
    file of this user."""
    key_path = path / ".key"
    if not os.path.lexists(key_path):
        tmp = path / f".key.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, key_path)  # fails if another process published first: use theirs
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    fd = open_regular(key_path)
    if fd is None:
        raise TierDirectoryError(f"{key_path} is not a regular file")
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != KEY_BYTES:
            raise TierDirectoryError(
                f"{key_path} is not this user's private {KEY_BYTES}-byte key "
                f"(mode {stat.S_IMODE(st.st_mode):o}, {st.st_size} bytes)"
            )
        key = os.pread(fd, KEY_BYTES, 0)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise TierDirectoryError(f"{key_path} is shorter than {KEY_BYTES} bytes")
    return key


def open_regular(path: Path) -> int | None:
    """A read-only fd of ``path`` if it is a regular file (never following a symlink, never
    blocking on a FIFO or device), else None."""
    try:
        fd = os.open(path, _READ)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def write_private(path: Path, data: list) -> None:
    """Write the buffers ``data`` to a new 0600 file ``path`` (never an existing one or a
    link), flushed to disk; on any failure the partial file is removed and the error raised."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)  # fmt: skip
    try:
        try:
            for buf in data:
                view = memoryview(buf).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
