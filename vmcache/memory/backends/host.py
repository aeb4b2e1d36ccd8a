"""Host backend: Linux virtual memory through mmap + memfd, the CPU analogue of CUDA VMM.

    reservation  mmap(NULL, R, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)
    page         an offset in one memfd file (the "physical" memory)
    map          mmap(va, P, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, memfd, offset)
    unmap        mmap(va, P, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE|MAP_FIXED)
    release      fallocate(PUNCH_HOLE|KEEP_SIZE): the memory goes back to the OS, reads as 0
    zero page    a memset (scrub on reuse: the page stays resident, it is written next)

The same offset mapped at two addresses really aliases. Adjacent pages whose offsets are
contiguous are mapped with one call, so the kernel keeps one VMA for them
(``vm.max_map_count`` bounds VMAs per process; running out is a :class:`MapLimitError`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import torch

from vmcache.errors import DriverError, MapLimitError
from vmcache.memory.backends.base import round_up, runs

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 1, 2, 0x10, 0x20, 0x4000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]  # fmt: skip
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_hole(fd: int, offset: int, size: int) -> None:
    """Give ``size`` bytes at ``offset`` of file ``fd`` back to the OS; they read as zeros
    after (``fallocate(PUNCH_HOLE|KEEP_SIZE)``; a memfd's pages leave every mapping of it)."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, size) != 0:
        err = ctypes.get_errno()
        raise DriverError("fallocate(PUNCH_HOLE)", errno.errorcode.get(err, str(err)),
                          f"{size} bytes at offset {offset}")  # fmt: skip


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 65530


def process_map_count() -> int:
    """Number of VMAs this process holds now (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


class HostBackend:
    """Real Linux virtual memory; see the module docstring. Use as a context manager."""

    def __init__(self, page_size: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.granularity = os.sysconf("SC_PAGE_SIZE")
        self.default_page_size = round_up(page_size or 64 * 1024, self.granularity)
        self._fd = os.memfd_create("vmcache-pages", os.MFD_CLOEXEC)
        self._file_size = 0  # bytes of the memfd handed out as pages; owned here
        self._free_offsets: list[tuple[int, int]] = []  # (offset, size) of released pages
        self._page_sizes: dict[int, int] = {}  # offset -> size of every page ever created
        self._reservations: dict[int, int] = {}  # va -> nbytes
        self._lock = threading.Lock()  # map calls may come from a mapping thread
        self.closed = False

    # --- reservations ------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        self._check_open()
        nbytes = round_up(nbytes, self.granularity)
        va = _libc.mmap(None, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if va in (None, _MAP_FAILED):
            raise self._error("mmap(PROT_NONE reserve)", f"{nbytes} bytes")
        self._reservations[va] = nbytes
        return va

    def release_reservation(self, va: int, nbytes: int) -> None:
        nbytes = self._reservations.pop(va, round_up(nbytes, self.granularity))
        if _libc.munmap(va, nbytes) != 0:
            raise self._error("munmap", f"{nbytes} bytes at {va:#x}")

    # --- pages -------------------------------------------------------------------------
    def create_page(self, page_size: int) -> int:
        self._check_open()
        with self._lock:
            for i, (off, size) in enumerate(self._free_offsets):
                if size == page_size:
                    del self._free_offsets[i]
                    return off
            off = self._file_size
            try:
                os.ftruncate(self._fd, off + page_size)
            except OSError as exc:
                raise DriverError("ftruncate(memfd)", errno.errorcode.get(exc.errno, "?")) from exc
            self._file_size = off + page_size
            self._page_sizes[off] = page_size
            return off

    def release_page(self, handle: int) -> None:
        size = self._page_sizes[handle]
        self._punch(handle, size)
        with self._lock:
            self._free_offsets.append((handle, size))

    def map(self, va: int, handles: list[int], page_size: int) -> None:
        self._check_open()
        done = 0
        try:
            for start, count in runs(handles, page_size):
                addr = va + start * page_size
                res = _libc.mmap(
                    addr, count * page_size, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_FIXED, self._fd, handles[start],
                )  # fmt: skip
                if res in (None, _MAP_FAILED):
                    raise self._error("mmap(MAP_FIXED page)", f"{count} page(s) at {addr:#x}")
                done = start + count
        except DriverError:
            if done:
                self.unmap(va, done, page_size)
            raise

    def unmap(self, va: int, npages: int, page_size: int) -> None:
        if npages <= 0:
            return
        res = _libc.mmap(
            va, npages * page_size, PROT_NONE,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0,
        )  # fmt: skip
        if res in (None, _MAP_FAILED):
            raise self._error("mmap(PROT_NONE unmap)", f"{npages} page(s) at {va:#x}")

    def zero_page(self, handle: int, view: torch.Tensor) -> None:
        """A memset, as on CUDA: the page stays resident, since a scrubbed page is about to
        be written (scrub on reuse). Punching a hole instead gave the memory back and made
        the next write fault every 4 KiB in again: ~0.5 ms a 64 KiB page against ~0.03 ms
        (what a copy-on-write copy of beam search paid each step)."""
        view.zero_()

    def _punch(self, offset: int, size: int) -> None:
        punch_hole(self._fd, offset, size)

    # --- tensors -----------------------------------------------------------------------
    def view(self, va: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_char * nbytes).from_address(va)
        buf.owner = self  # a live view keeps the backend (and so its mappings) from collection
        return torch.frombuffer(buf, dtype=torch.uint8)

    def synchronize(self) -> None:
        pass

    # --- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        for va, nbytes in list(self._reservations.items()):
            self.release_reservation(va, nbytes)
        os.close(self._fd)
        self.closed = True

    def __enter__(self) -> HostBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this HostBackend is closed")

    def _error(self, call: str, detail: str) -> DriverError:
        err = ctypes.get_errno()
        code = errno.errorcode.get(err, str(err))
        if err == errno.ENOMEM and call.startswith("mmap(MAP_FIXED"):
            return MapLimitError(
                call, code,
                f"{detail}; the process holds {process_map_count()} mappings and "
                f"vm.max_map_count is {max_map_count()}: use larger pages or fewer sequences",
            )  # fmt: skip
        return DriverError(call, code, detail)
