"""Which of vLLM's blocks may hold memory: a balloon of blocks held out of vLLM's free pool.

vLLM's block pool counts every block of its KV space as usable. The balloon takes the blocks
the budget does not back out of the pool, with the pool's own calls (``free_blocks``,
``touch``, ``evict_blocks``), as a virtual machine's balloon driver takes pages from its
guest: the pool's free count is then what the budget backs, and when it runs out vLLM preempts
or queues as it does at a full cache. Nothing of vLLM's is patched or replaced.

Memory comes in *groups*: ``group_blocks`` consecutive block ids whose bytes are whole pages in
every layer (1 on the CPU's 4 KiB pages; on CUDA's 2 MiB pages, as many blocks as share them).
Group 0 holds vLLM's null block and is always backed.

    pool blocks = in use by requests + free in the pool + in the balloon (whole groups)
    budget held = groups outside the balloon                            (scaled to units)
    resident    = backed groups' written pages, less punched dead blocks (on the CPU)

``grow(need)`` (before vLLM schedules) lets groups out of the balloon so that the step's
requests find ``need`` free blocks, in chunks, as the budget allows; ``trim()`` (after a step
and after aborts) takes back wholly free groups beyond a chunk and the prefix-cache bound and
gives their pages and budget back, uncached groups first, then the least recently used. On the
CPU (one block a group) ``sweep`` also punches each block freed without a prefix hash while it
stays in the pool (its contents are dead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Balloon:
    """The balloon over ``pool`` (a vLLM ``BlockPool``). ``budget`` counts groups (a
    :class:`vmcache.memory.budget.ScaledBudget` over bytes). ``back(groups)`` is called before
    groups are let out (map them: CUDA) and ``unback(groups)`` after they are taken (give their
    pages back); ``punch(block_ids)`` gives single dead blocks' pages back (None: groups only).
    ``keep_cached`` freed blocks with a prefix hash may stay resident."""

    def __init__(self, pool, budget, *, group_blocks: int, chunk_blocks: int, keep_cached: int,
                 back: Callable[[list[int]], None], unback: Callable[[list[int]], None],
                 punch: Callable[[list[int]], None] | None) -> None:  # fmt: skip
        if pool.num_gpu_blocks % group_blocks:
            raise ValueError(f"{pool.num_gpu_blocks} blocks are not whole groups of "
                             f"{group_blocks}")  # fmt: skip
        self.pool, self.budget, self.g = pool, budget, group_blocks
        self.chunk, self.keep_cached = chunk_blocks, keep_cached
        self._back, self._unback, self._punch = back, unback, punch
        self.groups = pool.num_gpu_blocks // group_blocks
        self.dirty: dict[int, int] = {}  # block -> step last handed out, since last punched
        self.step = 0
        if not budget.acquire(1):
            raise ValueError("the budget cannot give one group of blocks (vLLM's null block's)")
        self.backed = 1  # groups outside the balloon; group 0 always
        self._back([0])
        everything = pool.get_new_blocks(pool.get_num_free_blocks())
        ours = [b for b in everything if b.block_id < group_blocks]
        pool.free_blocks(ours)  # group 0's other blocks stay usable
        self.held: set[int] = set(range(1, self.groups))  # the balloon's groups

    def blocks_of(self, groups: Iterable[int]) -> list:
        return [self.pool.blocks[i] for g in groups for i in range(g * self.g, (g + 1) * self.g)]

    def in_use(self) -> int:
        """Blocks requests hold (vLLM's null block excluded)."""
        return self.backed * self.g - 1 - self.pool.get_num_free_blocks()

    def grow(self, need: int) -> int:
        """Let groups out so that ``need`` blocks are free, as the budget allows (in chunks).
        Returns the groups let out."""
        short = need - self.pool.get_num_free_blocks()
        if short <= 0 or not self.held:
            return 0
        n = min(len(self.held), -(-max(short, self.chunk) // self.g))
        if not self.budget.acquire(n):
            n = min(n, self.budget.available())
            if n <= 0 or not self.budget.acquire(n):
                return 0
        out = sorted(self.held)[:n]  # low ids first: memory stays compact
        self._back(out)
        self.held.difference_update(out)
        self.backed += n
        self.pool.free_blocks(self.blocks_of(out))
        return n

    def trim(self) -> int:
        """Evict cached blocks past the bound, punch dead ones, then take back wholly free
        groups beyond a chunk and the cached blocks (and beyond the budget's limit, when it
        was lowered). Returns the groups taken."""
        cached = self._evict_cached()
        self.sweep()
        free = self.pool.get_num_free_blocks()
        excess = (free - self.chunk - cached) // self.g
        over = self.budget.excess()
        if over:
            excess = max(excess, over)
        if excess <= 0:
            return 0
        blocks, n = self.pool.blocks, self.g
        readable = self._readable()
        candidates = []
        for g in range(1, self.groups):
            if g in self.held:
                continue
            members = blocks[g * n:(g + 1) * n]  # fmt: skip
            if all(b.ref_cnt == 0 and b.block_id not in readable for b in members):
                hashed = [b.block_id for b in members if b.block_hash is not None]
                last = max((self.dirty.get(b, 0) for b in hashed), default=0)
                candidates.append((len(hashed), last, g))
        take = [g for _, _, g in sorted(candidates)[:excess]]  # uncached, then LRU
        if not take:
            return 0
        members = self.blocks_of(take)
        self.pool.evict_blocks({b.block_id for b in members if b.block_hash is not None})
        self.pool.touch(members)  # out of the free queue, ref_cnt 1, no hash: the balloon's
        self._unback(take)
        for b in members:
            self.dirty.pop(b.block_id, None)
        self.held.update(take)
        self.backed -= len(take)
        self.budget.release(len(take))
        return len(take)

    def written(self, block_ids: Iterable[int]) -> None:
        """Blocks a step's requests hold (new ones will be written; prefix hits are used)."""
        self.step += 1
        for b in block_ids:
            self.dirty[b] = self.step

    def _evict_cached(self) -> int:
        """Drop the prefix hash of the least recently used free cached blocks past
        ``keep_cached``; returns those kept."""
        blocks = self.pool.blocks
        free = [b for b in self.dirty
                if blocks[b].ref_cnt == 0 and blocks[b].block_hash is not None]  # fmt: skip
        if len(free) <= self.keep_cached:
            return len(free)
        free.sort(key=self.dirty.__getitem__)
        self.pool.evict_blocks(set(free[: len(free) - self.keep_cached]))
        return self.keep_cached

    def _readable(self):
        """Blocks released with vLLM's ``unpin_blocks``: free in the pool but read until the
        pool hands them out again (it keeps a reuse watcher for each, the pool's
        ``_reuse_watchers``: an internal, named in the guide and checked by version)."""
        return self.pool._reuse_watchers  # (an AttributeError, not a silent {}, if it goes)

    def sweep(self) -> int:
        """Punch the pages of free blocks without a prefix hash (dead contents) and not
        released to stay readable, where single blocks can be given back (one block a
        group)."""
        if self._punch is None:
            return 0
        blocks = self.pool.blocks
        readable = self._readable()
        dead = [b for b in self.dirty
                if blocks[b].ref_cnt == 0 and blocks[b].block_hash is None
                and b not in readable]  # fmt: skip
        if dead:
            self._punch(dead)
            for b in dead:
                del self.dirty[b]
        return len(dead)

    def reset_prefix_cache(self, reset: Callable[[], bool]) -> bool:
        """Run ``reset`` (vLLM's pool's or scheduler's ``reset_prefix_cache``, which refuses
        unless every block but the null one is free) with the balloon's groups lent to the
        pool for the call and taken back after it, whatever it does; then trim. The budget
        is untouched: the lent groups are never handed out (nothing is scheduled meanwhile,
        on the engine core's one thread). Returns what ``reset`` returned."""
        lent = sorted(self.held)
        self.pool.free_blocks(self.blocks_of(lent))
        try:
            return reset()
        finally:
            members = self.blocks_of(lent)
            self.pool.evict_blocks({b.block_id for b in members if b.block_hash is not None})
            self.pool.touch(members)
            self.trim()

    def close(self) -> None:
        if self.backed:
            self.budget.release(self.backed)
            self.backed = 0
