"""What vmcache.vllm supports of vLLM's configuration, refused before anything is held: the
workers call :func:`check_supported` first in their ``__init__`` (before vLLM loads the
weights) and :func:`check_kv_groups` before their KV memory exists (before a memfd or a
reservation is made or published), so an unsupported setting stops vLLM at once, with the
reason, and leaves no rendezvous file or memory behind.

    tensor / pipeline parallel   one worker: the scheduler meets one rank's memory
    data parallel                the rendezvous key (instance, rank) is the same for every
                                 replica on a node under vLLM's default launcher
    async scheduling             blocks are given back between steps on the engine core's
                                 thread: a step scheduled before the last one's blocks were
                                 taken back could still read them
    several KV cache groups      one block table a request (vLLM's hybrid manager makes one
                                 group a layer type: pass --disable-hybrid-kv-cache-manager)
    a budget or floor below one  vLLM admits a request against its whole KV space, so a
    max_model_len sequence       request the budget cannot hold would wait for good; the
                                 sequence's blocks plus vLLM's null block
"""

from __future__ import annotations

import math

from vmcache.memory.ledger_rows import check_ledger_path
from vmcache.vllm.config import MIB, VllmKVConfig


def check_supported(vllm_config) -> VllmKVConfig:
    """``ValueError`` naming what is not supported and the way out; else the settings."""
    cfg = VllmKVConfig.from_additional(vllm_config.additional_config)
    par, sched = vllm_config.parallel_config, vllm_config.scheduler_config
    if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
        raise ValueError(
            f"vmcache.vllm runs one worker: tensor_parallel_size {par.tensor_parallel_size}, "
            f"pipeline_parallel_size {par.pipeline_parallel_size} are not supported"
        )
    if par.data_parallel_size != 1:
        raise ValueError(
            f"vmcache.vllm does not support data parallelism (data_parallel_size "
            f"{par.data_parallel_size}): the replicas' KV memories would meet under one key; "
            "run one vLLM per replica on one ledger instead"
        )
    if getattr(sched, "async_scheduling", False):
        raise ValueError(
            "vmcache.vllm gives blocks' memory back between steps, which async scheduling "
            "overlaps (the next step may still read a finished request's blocks): pass "
            "--no-async-scheduling"
        )
    if _layer_types(vllm_config) > 1 and not sched.disable_hybrid_kv_cache_manager:
        raise ValueError(_groups_message("several attention types (its hybrid layers)"))
    if cfg.ledger is not None:
        check_ledger_path(cfg.ledger)
    block_bytes = _block_bytes_estimate(vllm_config)
    if block_bytes:
        check_one_sequence(cfg, block_bytes, vllm_config)
    return cfg


def check_kv_groups(vllm_config, kv_cache_config) -> None:
    """With vLLM's KV cache configuration, before the worker makes its KV memory: one group,
    and the budget or floor holds one sequence at the exact block size."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(_groups_message(f"{len(groups)} KV cache groups"))
    cfg = VllmKVConfig.from_additional(vllm_config.additional_config)
    total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
    if kv_cache_config.num_blocks:
        block_size = groups[0].kv_cache_spec.block_size
        check_one_sequence(cfg, total // kv_cache_config.num_blocks, vllm_config, block_size)


def one_sequence_bytes(max_model_len: int, block_size: int, block_bytes: int) -> int:
    """What one ``max_model_len`` sequence needs of the budget: its blocks and vLLM's null
    block (its group is always held)."""
    return (math.ceil(max_model_len / block_size) + 1) * block_bytes


def check_one_sequence(cfg: VllmKVConfig, block_bytes: int, vllm_config, block_size=None):
    block_size = block_size or vllm_config.cache_config.block_size
    need = one_sequence_bytes(vllm_config.model_config.max_model_len, block_size, block_bytes)
    for key, mib in (("budget_mib", cfg.budget_mib), ("floor_mib", cfg.floor_mib)):
        if mib is not None and mib * MIB < need:
            raise ValueError(
                f"vmcache.{key} {mib} MiB is below one max_model_len sequence "
                f"({vllm_config.model_config.max_model_len} tokens: {need / MIB:.1f} MiB with "
                "vLLM's null block): vLLM admits requests against its whole KV space, so such "
                "a request would wait for good; raise it or lower --max-model-len"
            )


def _groups_message(what: str) -> str:
    return (
        f"vmcache.vllm handles one KV cache group; this model has {what}: pass "
        "--disable-hybrid-kv-cache-manager (one block table for every layer)"
    )


def _layer_types(vllm_config) -> int:
    """Attention types among the model's layers, where its config names them (Gemma 2/3,
    gpt-oss, Qwen with windows: ``layer_types``); 1 where it does not."""
    text = vllm_config.model_config.hf_text_config
    types = getattr(text, "layer_types", None)
    if not types:
        return 1
    return len({t for t in types if isinstance(t, str)})


def _block_bytes_estimate(vllm_config) -> int | None:
    """One block's bytes over every layer (K and V), from the model's shape and the cache's
    dtype, where vLLM has set the block size (the exact figure is checked again at
    :func:`check_kv_groups`); None where it cannot be told yet."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if not cc.block_size:
        return None
    try:
        layers = mc.get_num_layers(vllm_config.parallel_config)
        heads = mc.get_num_kv_heads(vllm_config.parallel_config)
        dim = mc.get_head_size()
        itemsize = mc.dtype.itemsize if cc.cache_dtype == "auto" else 1
    except (AttributeError, TypeError, ValueError):
        return None
    return 2 * layers * heads * dim * itemsize * cc.block_size
