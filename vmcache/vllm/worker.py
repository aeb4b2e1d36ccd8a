"""vLLM's CPU worker with its KV tensor in a memfd (``--worker-cls
vmcache.vllm.worker.VmcacheCPUWorker``): nothing resident until a block is written, blocks'
pages punched by the scheduler when freed (:mod:`vmcache.vllm.placement`,
:mod:`vmcache.vllm.region`)."""

from __future__ import annotations

import vllm
from vllm.v1.worker.cpu_worker import CPUWorker

from vmcache.vllm import check_version
from vmcache.vllm.placement import KVPlacement, host_region
from vmcache.vllm.support import check_kv_groups, check_supported

check_version(vllm.__version__)


class VmcacheCPUWorker(CPUWorker):
    """vLLM's ``CPUWorker``; only where its KV tensor lives differs (a memfd)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        # checked here, before vLLM loads the model or anything is held: what is not
        # supported stops it at once
        check_supported(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)
        self.kv = KVPlacement(host_region)

    def _maybe_get_memory_pool_context(self, tag: str):
        if tag != "kv_cache":
            return super()._maybe_get_memory_pool_context(tag)
        return self.kv.alloc

    def initialize_from_config(self, kv_cache_config) -> None:
        check_kv_groups(self.vllm_config, kv_cache_config)  # before the memfd is made
        super().initialize_from_config(kv_cache_config)
        self.kv.bind(self, kv_cache_config)
