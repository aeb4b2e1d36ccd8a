"""Where vLLM's KV tensor is allocated, for both vmcache workers (composition, not a mixin).

vLLM's worker allocates its KV tensor inside a memory-pool context it asks of the worker
(``_maybe_get_memory_pool_context("kv_cache")``; vLLM's sleep mode and its KV connectors'
pools plug in there). :class:`KVPlacement`'s context serves vLLM's one backing allocation
(``torch.zeros(size, dtype=int8)``, ``vllm/v1/worker/utils.py:allocate_kv_cache``) from a
vmcache region instead: a memfd on the CPU (:class:`HostKVRegion`), a VMM reservation on CUDA
(:class:`vmcache.vllm.device.DeviceKVRegion`). vLLM then builds its own per-layer views over
it; :meth:`KVPlacement.bind` reads their layout and publishes it for the scheduler. Anything
else allocated under the context, or a layout that cannot be given back in whole pages, is
refused by name. Imports nothing from vLLM.
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

from vmcache.vllm.config import MIB
from vmcache.vllm.region import BlockLayout, HostKVRegion, UnsupportedLayout, rendezvous_path

log = logging.getLogger("vllm.vmcache")  # shown by vLLM's log handlers


class _KVAllocation(TorchFunctionMode):
    """Serves vLLM's KV backing allocation from a region ``make(nbytes, device)`` builds."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make, self.region = make, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros:
            size = args[0] if len(args) == 1 else args
            size = tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,)
            dtype, device = kwargs.get("dtype"), torch.device(kwargs.get("device") or "cpu")
            if len(size) != 1 or dtype is not torch.int8:
                raise UnsupportedLayout(
                    f"vLLM allocated its KV cache as torch.zeros({size}, dtype={dtype}, "
                    f"device={device}); vmcache.vllm knows one 1-D int8 buffer"
                )
            if self.region is not None:
                raise UnsupportedLayout("vLLM allocated a second KV buffer; vmcache.vllm "
                                        "knows one backing buffer for every layer")  # fmt: skip
            self.region = self.make(int(size[0]), device)
            return self.region.tensor(int(size[0]))
        if func in (torch.empty, torch.ones, torch.full, torch.empty_strided):
            raise UnsupportedLayout(f"vLLM allocated its KV cache with {func.__name__}; "
                                    "vmcache.vllm knows torch.zeros")  # fmt: skip
        return func(*args, **kwargs)


class KVPlacement:
    """What both workers do, by composition: the allocation context, then the layout read off
    vLLM's views and published for the scheduler."""

    def __init__(self, make) -> None:
        self.alloc = _KVAllocation(make)

    @property
    def region(self):
        return self.alloc.region

    def bind(self, worker, kv_cache_config) -> None:
        region = self.alloc.region
        if region is None:
            raise UnsupportedLayout("vLLM did not allocate its KV cache under the worker's "
                                    "memory-pool context; vmcache.vllm cannot hold it")  # fmt: skip
        views = [t for t in worker.model_runner.kv_caches if isinstance(t, torch.Tensor)]
        end = region.base + region.nbytes
        for t in views:
            if not region.base <= t.data_ptr() < end:
                raise UnsupportedLayout("a layer's KV view lies outside the vmcache buffer")
        layout = BlockLayout.from_views(views, region.base, kv_cache_config.num_blocks,
                                        region.page_bytes)  # fmt: skip
        if layout.extent > region.nbytes:
            raise UnsupportedLayout("vLLM's KV views address past the buffer it allocated")
        path = rendezvous_path(worker.vllm_config.instance_id, worker.rank)
        if isinstance(region, HostKVRegion):
            region.publish(path, layout)
        else:
            region.bind(layout)
            region.publish(path)
        log.info("vmcache: vLLM's KV tensor (%.0f MiB, %d blocks, groups of %d, %d segments a "
                 "block) is mapped as the scheduler lets blocks out: %.1f MiB resident now",
                 region.nbytes / MIB, layout.num_blocks, layout.group_blocks,
                 len(layout.segments), region.resident_bytes() / MIB)  # fmt: skip


def host_region(nbytes: int, device: torch.device) -> HostKVRegion:
    if device.type != "cpu":
        raise UnsupportedLayout(f"the CPU worker's KV cache was asked on {device}")
    return HostKVRegion(nbytes)
