"""vLLM's CPU worker with its KV tensor in vmcache memory (``--worker-cls``).

vLLM's worker allocates its KV tensor inside a memory-pool context it asks of the worker
(``_maybe_get_memory_pool_context("kv_cache")``; vLLM's sleep mode and its KV connectors'
pools plug in there). This worker answers with a context under which vLLM's one backing
allocation (``torch.zeros(size, dtype=int8)``, ``vllm/v1/worker/utils.py:allocate_kv_cache``)
is a view of a :class:`HostKVRegion` (a memfd: nothing resident until written) instead; vLLM
then builds its own per-layer views over it. After vLLM bound them, the worker reads their
layout and publishes it for the scheduler (:class:`vmcache.vllm.scheduler.VmcacheScheduler`).
Anything else allocated under the context, or a layout whose blocks are not whole pages, is
refused by name.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import vllm
from torch.overrides import TorchFunctionMode
from vllm.v1.worker.cpu_worker import CPUWorker

from vmcache.vllm import check_version
from vmcache.vllm.config import MIB, VllmKVConfig
from vmcache.vllm.region import BlockLayout, HostKVRegion, UnsupportedLayout, rendezvous_path

check_version(vllm.__version__)
log = logging.getLogger("vllm.vmcache")  # shown by vLLM's log handlers


class _KVAllocation(TorchFunctionMode):
    """Serves vLLM's KV backing allocation from a :class:`HostKVRegion`."""

    def __init__(self) -> None:
        super().__init__()
        self.region: HostKVRegion | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros:
            size = args[0] if len(args) == 1 else args
            size = tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,)
            dtype, device = kwargs.get("dtype"), torch.device(kwargs.get("device") or "cpu")
            if len(size) != 1 or dtype is not torch.int8 or device.type != "cpu":
                raise UnsupportedLayout(
                    f"vLLM allocated its KV cache as torch.zeros({size}, dtype={dtype}, "
                    f"device={device}); vmcache.vllm knows one 1-D int8 CPU buffer"
                )
            if self.region is not None:
                raise UnsupportedLayout("vLLM allocated a second KV buffer; vmcache.vllm "
                                        "knows one backing buffer for every layer")  # fmt: skip
            self.region = HostKVRegion(int(size[0]))
            return self.region.tensor(int(size[0]))
        if func in (torch.empty, torch.ones, torch.full, torch.empty_strided):
            raise UnsupportedLayout(f"vLLM allocated its KV cache with {func.__name__}; "
                                    "vmcache.vllm knows torch.zeros")  # fmt: skip
        return func(*args, **kwargs)


class VmcacheCPUWorker(CPUWorker):
    """vLLM's ``CPUWorker``; only where its KV tensor lives differs."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        self.vmcache_config = VllmKVConfig.from_additional(vllm_config.additional_config)
        super().__init__(vllm_config, *args, **kwargs)
        self._kv_alloc: _KVAllocation | None = None
        self.kv_region: HostKVRegion | None = None

    def _maybe_get_memory_pool_context(self, tag: str):
        if tag != "kv_cache":
            return super()._maybe_get_memory_pool_context(tag)
        self._kv_alloc = _KVAllocation()
        return self._kv_alloc

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        alloc = self._kv_alloc
        if alloc is None or alloc.region is None:
            raise UnsupportedLayout("vLLM did not allocate its KV cache under the worker's "
                                    "memory-pool context; vmcache.vllm cannot hold it")  # fmt: skip
        region = self.kv_region = alloc.region
        views = [t for t in self.model_runner.kv_caches if isinstance(t, torch.Tensor)]
        end = region.base + region.nbytes
        for t in views:
            if not region.base <= t.data_ptr() < end:
                raise UnsupportedLayout("a layer's KV view lies outside the vmcache buffer")
        layout = BlockLayout.from_views(views, region.base, kv_cache_config.num_blocks,
                                        region.page_bytes)  # fmt: skip
        if layout.extent > region.nbytes:
            raise UnsupportedLayout("vLLM's KV views address past the buffer it allocated")
        region.publish(rendezvous_path(self.vllm_config.instance_id, self.rank), layout)
        log.info("vmcache: vLLM's KV tensor (%.0f MiB, %d blocks, %d segments a block) is a "
                 "memfd mapped shared: resident only where written (%.1f MiB now)",
                 region.nbytes / MIB, layout.num_blocks, len(layout.segments),
                 region.resident_bytes() / MIB)  # fmt: skip

    def shutdown(self) -> None:
        with contextlib.suppress(AttributeError):
            super().shutdown()
