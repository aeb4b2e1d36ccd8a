"""Tensor-parallel serving: the model is sharded by transformers' own tensor-parallel loading
(``from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))``: attention
heads and MLP columns split across the ranks of the default process group, its hooks doing the
all-reduce / gather), and each rank holds the KV heads of its shard in its own cache
(:func:`shard_spec`).

Every rank runs the same :class:`~vmcache.engine.Engine` over the same requests, so the
scheduler sees the same queue, lengths and pool on every rank; the one thing computed per rank
is the logits, and those are decided once: rank 0's are broadcast each step
(:class:`TPRunner`), so every rank samples the same tokens, grows the same sequences and maps
the same page tables (the tests compare them step by step). Wall-clock arrivals
(``Engine.serve``) would differ between ranks: use ``Engine.run``.

    rank r of R:  q_proj / k_proj / v_proj columns of heads [r·H/R, (r+1)·H/R)  -> its KV heads
                  o_proj rows of the same heads, summed across ranks (all-reduce)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from vmcache.engine import Engine
from vmcache.engine.runner import ModelRunner
from vmcache.sequences.spec import KVSpec


def shard_spec(spec: KVSpec, world_size: int) -> KVSpec:
    """The KV one rank of ``world_size`` stores: ``N_KV / world_size`` heads (and as many of
    the query heads). Heads are not replicated: ``N_KV`` must divide evenly."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if spec.num_kv_heads % world_size or spec.q_heads % world_size:
        raise ValueError(f"{spec.num_kv_heads} KV heads ({spec.q_heads} query heads) do not "
                         f"split evenly over {world_size} ranks")  # fmt: skip
    return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world_size,
                               num_q_heads=spec.q_heads // world_size)  # fmt: skip


def load_tp_model(path, dtype: torch.dtype = torch.float32, **kwargs):
    """transformers' tensor-parallel load of a saved checkpoint over the default process
    group (``torch.distributed`` initialised first; gloo on CPUs). Needs ``accelerate``."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed (gloo or nccl) before load_tp_model")
    cfg = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=cfg, dtype=dtype, **kwargs
    )
    if dist.get_world_size() > 1 and not any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError("transformers loaded the model unsharded: set RANK, LOCAL_RANK and "
                           "WORLD_SIZE in the environment, as torchrun does")  # fmt: skip
    return model.eval()


class TPRunner(ModelRunner):
    """A :class:`ModelRunner` whose logits are rank ``src``'s on every rank of ``group``."""

    def __init__(self, model, kv, group=None, src: int = 0) -> None:
        super().__init__(model, kv)
        self.group, self.src = group, src

    def step(self, slots, starts, tokens, rows=None) -> torch.Tensor:
        logits = super().step(slots, starts, tokens, rows).contiguous()
        dist.broadcast(logits, dist.get_global_rank(self.group, self.src) if self.group
                       else self.src, group=self.group)  # fmt: skip
        return logits


def tensor_parallel_engine(model, cache, group=None, **engine_kw) -> Engine:
    """An :class:`Engine` for one rank: ``model`` sharded (:func:`load_tp_model`), ``cache``
    built for :func:`shard_spec` of the model's spec."""
    world = dist.get_world_size(group)
    want = shard_spec(KVSpec.from_hf_config(model.config, cache.spec.dtype), world)
    if (cache.spec.num_kv_heads, cache.spec.q_heads) != (want.num_kv_heads, want.q_heads):
        raise ValueError(f"the cache stores {cache.spec.num_kv_heads} KV heads; one of {world} "
                         f"ranks holds {want.num_kv_heads}: build it with shard_spec")  # fmt: skip
    engine = Engine(model, cache, **engine_kw)
    engine.runner = TPRunner(model, cache, group)
    return engine
