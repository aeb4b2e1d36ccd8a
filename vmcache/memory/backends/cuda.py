"""CUDA backend: the driver's virtual-memory API through cuda-python (``cuda.bindings.driver``).

    reservation  cuMemAddressReserve(size, granularity)
    page         cuMemCreate(page_size, pinned device allocation)  (~200 µs: the pool creates ahead)
    map          cuMemMap(va, page, handle) per page, then one cuMemSetAccess over the range
    unmap        cuMemUnmap per page; the caller synchronises first, once per operation
                 (a kernel may still read the page; see SequenceCache._sync)
    release      cuMemRelease(handle), cuMemAddressFree(va, size)

Every ``CUresult`` is checked; a failure raises :class:`DriverError` with the call's name and
the driver's error name. cuda-python is imported here only, when a CUDA backend is built.
"""

from __future__ import annotations

from typing import Any

import torch

from vmcache.errors import DriverError
from vmcache.memory.backends.base import round_up


def load_driver() -> Any:
    """Import cuda-python's driver module and initialise the driver, or raise DriverError."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise DriverError("import cuda.bindings.driver", "NOT_INSTALLED", str(exc)) from exc
    try:
        (err,) = cu.cuInit(0)
    except Exception as exc:  # cuda.pathfinder raises when libcuda.so is absent
        raise DriverError("cuInit", "NO_DRIVER", f"no CUDA driver: {exc}") from exc
    _check(cu, "cuInit", err)
    return cu


def _check(cu: Any, call: str, err: Any, detail: str = "") -> None:
    if err != cu.CUresult.CUDA_SUCCESS:
        ok, name = cu.cuGetErrorName(err)
        code = name.decode() if ok == cu.CUresult.CUDA_SUCCESS and name else str(err)
        raise DriverError(call, code, detail)


def _call(cu: Any, call: str, *args: Any, detail: str = "") -> Any:
    res = getattr(cu, call)(*args)
    _check(cu, call, res[0], detail)
    return res[1] if len(res) == 2 else res[1:]


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` owner; torch keeps a reference to it."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }
        self.owner = owner


class CudaBackend:
    """Real CUDA VMM on one device; see the module docstring. Use as a context manager."""

    def __init__(self, device: torch.device | str | int = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {device}")
        if not torch.cuda.is_available():
            raise DriverError("torch.cuda.is_available", "NO_DEVICE", "no CUDA device visible")
        self.device = torch.device("cuda", device.index or 0)
        torch.empty(1, device=self.device)  # make torch create and push its primary context
        cu = self._cu = load_driver()
        dev = self.device.index
        ctx = _call(cu, "cuCtxGetCurrent")
        if not int(ctx):
            ctx = _call(cu, "cuDevicePrimaryCtxRetain", _call(cu, "cuDeviceGet", dev))
            _call(cu, "cuCtxSetCurrent", ctx)
        self._ctx = ctx
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = dev
        self._prop = prop
        gran = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(_call(cu, "cuMemGetAllocationGranularity", prop, gran))
        self.default_page_size = self.granularity
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = dev
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]
        self._reservations: dict[int, int] = {}  # va -> bytes; owned here
        self._handles: dict[int, Any] = {}  # id -> CUmemGenericAllocationHandle
        self._mapped: dict[int, int] = {}  # va -> page bytes of every live mapping
        self.closed = False

    def _bind(self) -> None:
        """The current context is per thread: a mapping thread must set it itself."""
        _call(self._cu, "cuCtxSetCurrent", self._ctx)

    def reserve(self, nbytes: int) -> int:
        self._bind()
        nbytes = round_up(nbytes, self.granularity)
        ptr = _call(self._cu, "cuMemAddressReserve", nbytes, self.granularity, 0, 0)
        va = int(ptr)
        self._reservations[va] = nbytes
        return va

    def release_reservation(self, va: int, nbytes: int) -> None:
        nbytes = self._reservations.pop(va, round_up(nbytes, self.granularity))
        _call(self._cu, "cuMemAddressFree", va, nbytes)

    def create_page(self, page_size: int) -> int:
        self._bind()
        if page_size % self.granularity:
            raise ValueError(
                f"page_size {page_size} is not a multiple of the CUDA granularity "
                f"{self.granularity}"
            )
        handle = _call(self._cu, "cuMemCreate", page_size, self._prop, 0)
        key = int(handle)
        self._handles[key] = handle
        return key

    def release_page(self, handle: int) -> None:
        if handle not in self._handles:
            raise ValueError(f"release_page: unknown or released page handle {handle}")
        _call(self._cu, "cuMemRelease", self._handles.pop(handle))

    def map(self, va: int, handles: list[int], page_size: int) -> None:
        cu = self._cu
        unknown = [h for h in handles if h not in self._handles]
        if unknown:
            raise ValueError(f"map: unknown or released page handle(s) {unknown[:4]}")
        self._bind()
        done: list[int] = []
        try:
            for i, h in enumerate(handles):
                addr = va + i * page_size
                _call(cu, "cuMemMap", addr, page_size, 0, self._handles[h], 0)
                done.append(addr)
            _call(cu, "cuMemSetAccess", va, len(handles) * page_size, self._access, 1)
        except DriverError:
            for addr in done:
                cu.cuMemUnmap(addr, page_size)
            raise
        for addr in done:
            self._mapped[addr] = page_size

    def unmap(self, va: int, npages: int, page_size: int) -> None:
        if npages <= 0:
            return
        self._bind()
        for i in range(npages):
            addr = va + i * page_size
            _call(self._cu, "cuMemUnmap", addr, page_size, detail=f"at {addr:#x}")
            self._mapped.pop(addr, None)

    def zero_page(self, handle: int, view: torch.Tensor) -> None:
        view.zero_()

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.as_tensor(_CudaArray(va, nbytes, self), device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self.closed:
            return
        self.synchronize()
        cu = self._cu
        for addr, size in list(self._mapped.items()):
            cu.cuMemUnmap(addr, size)
        self._mapped.clear()
        for h in list(self._handles.values()):
            cu.cuMemRelease(h)
        self._handles.clear()
        for va, nbytes in list(self._reservations.items()):
            cu.cuMemAddressFree(va, nbytes)
        self._reservations.clear()
        self.closed = True

    def __enter__(self) -> CudaBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
