"""Physical memory behind one small protocol, chosen once at construction."""

from __future__ import annotations

import torch

from vmcache.memory.backends.base import Backend, round_up
from vmcache.memory.backends.host import HostBackend


def make_backend(device: torch.device | str) -> Backend:
    """The real backend for ``device``: host mmap for ``cpu``, CUDA VMM for ``cuda``."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return HostBackend()
    if dev.type == "cuda":
        from vmcache.memory.backends.cuda import CudaBackend

        return CudaBackend(dev)
    raise ValueError(f"no virtual-memory backend for device {dev}; expected 'cpu' or 'cuda'")


def cuda_vmm_available() -> bool:
    """True when a CUDA device is visible and the driver's VMM API loads; False without a
    device. With a device, a driver binding that cannot be loaded (cuda-python missing, say)
    raises :class:`DriverError`: GPU tests must fail there, not skip."""
    if not torch.cuda.is_available():
        return False
    from vmcache.memory.backends.cuda import load_driver

    load_driver()
    return True


__all__ = ["Backend", "HostBackend", "make_backend", "cuda_vmm_available", "round_up"]
