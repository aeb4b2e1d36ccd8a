"""vLLM's GPU worker with its KV tensor on CUDA VMM (``--worker-cls
vmcache.vllm.gpu_worker.VmcacheGPUWorker``): one reservation, 2 MiB pages mapped under a group
of blocks only while the scheduler wants it (:mod:`vmcache.vllm.device`).

Written against vLLM 0.32.0's GPU ``Worker`` and checked on the CPU against the CUDA page rules
(:class:`vmcache.memory.backends.strict.StrictBackend`); **not yet run on a GPU**.

    determine_available_memory  vLLM's figure, rounded down to whole groups of blocks (so that
                                every layer starts on a page)
    the KV allocation           a :class:`DeviceKVRegion` over :class:`CudaBackend`
    execute_model, sample_tokens  the mapped groups made to match the wanted ones first, and
                                nothing unmapped until they return (``DeviceKVRegion.step``)
    between steps               the same every ``IDLE_S``, so that an idle engine's pages go back
    async scheduling            refused (:mod:`vmcache.vllm.support`): a step scheduled before
                                the last one's blocks were taken back could read them
"""

from __future__ import annotations

import math
import threading

import vllm
from vllm.v1.worker.gpu_worker import Worker

from vmcache.vllm import check_version
from vmcache.vllm.device import DeviceKVRegion
from vmcache.vllm.placement import KVPlacement
from vmcache.vllm.region import UnsupportedLayout
from vmcache.vllm.support import check_kv_groups, check_supported

check_version(vllm.__version__)
IDLE_S = 0.2
CUDA_PAGE = 2 << 20  # cuMemGetAllocationGranularity on current GPUs (checked at allocation)


def _device_region(nbytes: int, device):
    from vmcache.memory.backends.cuda import CudaBackend

    if device.type != "cuda":
        raise UnsupportedLayout(f"the GPU worker's KV cache was asked on {device}")
    return DeviceKVRegion(CudaBackend(device), nbytes)


def group_blocks(block_bytes_a_layer: int, page: int = CUDA_PAGE) -> int:
    """Blocks a group needs so that a layer's part of it is whole pages, K and V split or not."""
    half = block_bytes_a_layer // 2
    return math.lcm(page // math.gcd(page, block_bytes_a_layer), page // math.gcd(page, half))


class VmcacheGPUWorker(Worker):
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        # checked here, before vLLM loads the model or anything is held: what is not
        # supported stops it at once
        check_supported(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)
        self.kv = KVPlacement(_device_region)
        self._stop = threading.Event()

    def _maybe_get_memory_pool_context(self, tag: str):
        if tag != "kv_cache":
            return super()._maybe_get_memory_pool_context(tag)
        return self.kv.alloc

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        specs = list(self.model_runner.get_kv_cache_spec().values())
        per_block = sum(s.page_size_bytes for s in specs)
        g = math.lcm(*(group_blocks(s.page_size_bytes) for s in specs)) if specs else 1
        return available // (per_block * g) * per_block * g if per_block else available

    def initialize_from_config(self, kv_cache_config) -> None:
        check_kv_groups(self.vllm_config, kv_cache_config)  # before the KV memory is made
        super().initialize_from_config(kv_cache_config)
        self.kv.bind(self, kv_cache_config)
        threading.Thread(target=self._idle_sync, name="vmcache-kv-sync", daemon=True).start()

    def _idle_sync(self) -> None:
        while not self._stop.wait(IDLE_S):
            self.kv.region.sync()

    def execute_model(self, *args, **kwargs):
        region = self.kv.region
        if region is None:
            return super().execute_model(*args, **kwargs)
        with region.step():  # the idle thread unmaps nothing while the step runs
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        region = self.kv.region
        if region is None:
            return super().sample_tokens(*args, **kwargs)
        with region.step():
            return super().sample_tokens(*args, **kwargs)

    def shutdown(self) -> None:
        self._stop.set()
        try:
            super().shutdown()
        finally:
            if self.kv.region is not None:
                self.kv.region.close()
