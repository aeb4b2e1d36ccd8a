"""vLLM's scheduler with vmcache deciding which blocks hold memory (``--scheduler-cls``).

It is vLLM's own ``Scheduler``; around three of its calls it moves the :class:`Balloon`:

    schedule()            before: let out of the balloon what this step's requests may need
                          (as the budget allows); after: note the blocks handed out (written)
    update_from_output()  after: punch the pages of blocks freed without a prefix hash, take
    finish_requests()     back free blocks past a chunk and the prefix-cache bound

vLLM runs these on its engine core's one thread, between model steps (the CPU build schedules
synchronously), so no block is punched while the model may read it. The KV memory is the
worker's memfd (:mod:`vmcache.vllm.region`), published before vLLM builds this class.
"""

from __future__ import annotations

import logging

import vllm
from vllm.v1.core.sched.scheduler import Scheduler

from vmcache.memory.budget import LocalBudget, ScaledBudget
from vmcache.memory.ledger import UNIT_BYTES, SharedBudget
from vmcache.vllm import check_version
from vmcache.vllm.balloon import Balloon
from vmcache.vllm.config import MIB, VllmKVConfig
from vmcache.vllm.region import open_worker_memory, rendezvous_path
from vmcache.vllm.support import check_kv_groups, check_supported, one_sequence_bytes

check_version(vllm.__version__)
log = logging.getLogger("vllm.vmcache")  # shown by vLLM's log handlers


class VmcacheScheduler(Scheduler):
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        cfg = check_supported(vllm_config)  # (the workers refused these before anything)
        check_kv_groups(vllm_config, kv_cache_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.memory = open_worker_memory(rendezvous_path(vllm_config.instance_id, 0))
        try:
            self._start(cfg, vllm_config)
        except BaseException:
            self.memory.close()  # its memfd's descriptor and its rendezvous gone with it
            raise

    def _start(self, cfg: VllmKVConfig, vllm_config) -> None:
        layout = self.memory.layout
        pool = self.kv_cache_manager.block_pool
        if layout.num_blocks != pool.num_gpu_blocks:
            raise ValueError(f"the worker's KV memory holds {layout.num_blocks} blocks, the "
                             f"scheduler's pool {pool.num_gpu_blocks}")  # fmt: skip
        self.block_bytes, self.group_bytes = layout.block_bytes, layout.group_bytes
        space = layout.num_blocks * self.block_bytes
        self.budget = self._budget(cfg, space, vllm_config.model_config.max_model_len)
        keep = cfg.blocks(cfg.prefix_cache_mib if cfg.prefix_cache_mib is not None
                          else space / 10 / MIB, self.block_bytes)  # fmt: skip
        m = self.memory
        self.balloon = Balloon(pool, self.budget, group_blocks=layout.group_blocks,
                               chunk_blocks=cfg.chunk_blocks, keep_cached=keep,
                               back=m.back, unback=m.unback, punch=m.punch)  # fmt: skip
        log.info("vmcache: vLLM's KV space of %.0f MiB (%d blocks of %.2f MiB, given back in "
                 "groups of %d) is mapped as it is used; budget: %s; prefix-cache blocks kept "
                 "resident: at most %d (%.0f MiB)", space / MIB, layout.num_blocks,
                 self.block_bytes / MIB, layout.group_blocks, self._budget_text(cfg), keep,
                 keep * self.block_bytes / MIB)  # fmt: skip

    # --- the budget ------------------------------------------------------------------------
    def _budget(self, cfg: VllmKVConfig, space: int, max_model_len: int):
        if cfg.budget_mib is not None and cfg.budget_mib * MIB < self.group_bytes:
            raise ValueError(f"vmcache.budget_mib {cfg.budget_mib} is below one block of every "
                             f"layer ({self.group_bytes / MIB:.2f} MiB: the memory is given in "
                             "groups of blocks that fill whole pages)")  # fmt: skip
        total = int(cfg.budget_mib * MIB) // UNIT_BYTES if cfg.budget_mib is not None else None
        if cfg.ledger is None:
            inner = LocalBudget(total if total is not None else -(-space // UNIT_BYTES))
        else:
            inner = SharedBudget(
                cfg.ledger,
                total,
                name=cfg.name,
                unit_bytes=UNIT_BYTES,
                lock_timeout_s=cfg.lock_timeout_s,
                lease_s=cfg.lease_s,
                keepalive=True,
            )
        budget = ScaledBudget(inner, unit_bytes=UNIT_BYTES)
        budget.bind_page_bytes(self.group_bytes)  # budget.k: the units of one group
        if cfg.ledger is not None:
            one_seq = one_sequence_bytes(max_model_len, self.block_size, self.block_bytes)
            floor_bytes = cfg.floor_mib * MIB if cfg.floor_mib is not None else one_seq
            floor = -(-int(floor_bytes) // self.group_bytes) * budget.k
            try:
                inner.set_limits(min_pages=floor)
            except BaseException as e:
                inner.close()  # its row, its keepalive thread
                if not isinstance(e, ValueError):
                    raise
                raise ValueError(f"vmcache: a floor of {floor * UNIT_BYTES / MIB:.1f} MiB does not "
                                 f"fit the ledger beside the others' ({e}): lower "
                                 "vmcache.floor_mib") from None  # fmt: skip
        return budget

    def _budget_text(self, cfg: VllmKVConfig) -> str:
        if cfg.ledger is None:
            return f"{self.budget.inner.limit * UNIT_BYTES / MIB:.0f} MiB of this process's own"
        return f"the ledger {cfg.ledger} as {cfg.name!r}"

    # --- around vLLM's calls ---------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        self.balloon.grow(self._blocks_wanted())
        out = super().schedule(*args, **kwargs)
        ids = [b for req in out.scheduled_new_reqs for b in req.block_ids[0]]
        ids += [b for new in out.scheduled_cached_reqs.new_block_ids if new for b in new[0]]
        self.balloon.written(ids)
        return out

    def update_from_output(self, *args, **kwargs):
        out = super().update_from_output(*args, **kwargs)
        self.balloon.trim()
        return out

    def finish_requests(self, *args, **kwargs):
        out = super().finish_requests(*args, **kwargs)
        self.balloon.trim()
        return out

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        # it passed the count of lent groups where the list was wanted: the TypeError was
        # swallowed by vLLM's utility call and the balloon's blocks stayed in the pool
        return self.balloon.reset_prefix_cache(lambda: super(VmcacheScheduler, self)
                                               .reset_prefix_cache(*args, **kwargs))  # fmt: skip

    def get_kv_cache_usage(self) -> float:
        """The fraction of vLLM's KV space requests hold (the balloon's blocks are not used)."""
        return self.balloon.in_use() / max(self.balloon.pool.num_gpu_blocks - 1, 1)

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            stats.kv_cache_usage = self.get_kv_cache_usage()
        return stats

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            try:
                self.balloon.close()
                close = getattr(self.budget.inner, "close", None)
                if close is not None:
                    close()
            finally:
                self.memory.close()

    def _blocks_wanted(self) -> int:
        """Blocks the next step may allocate: each running request's next tokens, then the
        waiting ones' prompts in order, within the step's token budget (an upper bound: a
        prefix-cache hit needs fewer)."""
        bs, left = self.block_size, self.max_num_scheduled_tokens
        extra = self.num_spec_tokens + self.num_lookahead_tokens
        need = 0
        for group in (self.running, self.waiting):
            for req in group:
                if left <= 0:
                    return need
                done = req.num_computed_tokens
                new = min(max(req.num_tokens_with_spec - done, 1), left)
                left -= new
                need += max(0, -(-(done + new + extra) // bs) - -(-done // bs))
        return need
