"""Which of vLLM's blocks may hold memory: a balloon of blocks held out of vLLM's free pool.

vLLM's block pool counts every block of its KV space as usable. The balloon takes the blocks
the budget does not back out of the pool, with the pool's own calls (``get_new_blocks``,
``free_blocks``), as a virtual machine's balloon driver takes pages from its guest: the pool's
free count is then what the budget backs, and when it runs out vLLM preempts or queues as it
does at a full cache. Nothing of vLLM's is patched or replaced.

    pool blocks = null block + in use by requests + free in the pool + in the balloon
    budget held = in use + free in the pool                          (blocks, scaled to units)
    resident    = in use + free blocks kept for their prefix hash     (the rest are punched)

``grow(need)`` (before vLLM schedules) lets out of the balloon what the step may need, in
chunks, as the budget allows; ``trim()`` (after a step and after aborts) takes back free
blocks beyond a chunk and the prefix-cache bound and gives their pages and budget back. The
pool hands out uncached free blocks first and then its least recently used cached ones, so the
balloon takes those first, as vLLM's own eviction would. ``sweep`` punches the pages of blocks
freed without a hash (their contents are dead) while keeping them in the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Balloon:
    """The balloon over ``pool`` (a vLLM ``BlockPool``); ``budget`` counts blocks (a
    :class:`vmcache.memory.budget.ScaledBudget` over bytes); ``release(ids)`` gives the pages
    of blocks back. ``keep_cached`` blocks with a prefix hash may stay free and resident."""

    def __init__(self, pool, budget, release: Callable[[list[int]], None], *,
                 chunk_blocks: int, keep_cached: int) -> None:  # fmt: skip
        self.pool, self.budget, self._release = pool, budget, release
        self.chunk, self.keep_cached = chunk_blocks, keep_cached
        self.held: list = []  # the balloon's blocks (ref_cnt 1, no hash, no pages)
        self.dirty: dict[int, int] = {}  # block -> step last handed out, since last punched
        self.step = 0
        self.refused = 0  # grows the budget could not (fully) give
        self.held += pool.get_new_blocks(pool.get_num_free_blocks())
        self.backed = 0  # blocks the budget gave: pool blocks outside the balloon, null excluded

    @property
    def usable(self) -> int:
        """Blocks vLLM may hand out beyond those in use: the pool's free count."""
        return self.pool.get_num_free_blocks()

    def in_use(self) -> int:
        return self.backed - self.pool.get_num_free_blocks()

    def grow(self, need: int) -> int:
        """Let out of the balloon so that ``need`` blocks are free, as the budget allows (in
        chunks). Returns the blocks let out."""
        short = need - self.pool.get_num_free_blocks()
        if short <= 0 or not self.held:
            return 0
        n = min(len(self.held), -(-short // self.chunk) * self.chunk)
        if not self.budget.acquire(n):
            self.refused += 1
            n = min(n, self.budget.available())
            if n <= 0 or not self.budget.acquire(n):
                return 0
        out, self.held = self.held[-n:], self.held[:-n]
        self.backed += n
        self.pool.free_blocks(out)
        return n

    def trim(self) -> int:
        """Punch freed blocks' pages (evicting the least recently used cached ones past the
        bound first), then take back free blocks beyond a chunk and the cached ones (and
        beyond the budget's limit, when it was lowered). Returns the blocks taken."""
        cached = self._evict_cached()
        self.sweep()
        free = self.pool.get_num_free_blocks()
        excess = max(free - self.chunk - cached, 0)
        over = self.budget.excess()
        if over:
            excess = max(excess, min(over, free))
        if excess <= 0:
            return 0
        taken = self.pool.get_new_blocks(excess)  # uncached first, then LRU cached (evicted)
        ids = [b.block_id for b in taken if b.block_id in self.dirty]
        if ids:
            self._release(ids)
            for b in ids:
                del self.dirty[b]
        self.held += taken
        self.backed -= excess
        self.budget.release(excess)
        return excess

    def written(self, block_ids: Iterable[int]) -> None:
        """Blocks a step's requests hold (new ones will be written; prefix hits are used)."""
        self.step += 1
        for b in block_ids:
            self.dirty[b] = self.step

    def _evict_cached(self) -> int:
        """Drop the prefix hash of the least recently used free cached blocks past
        ``keep_cached`` (their pages are punched by the sweep); returns those kept."""
        blocks = self.pool.blocks
        free = [b for b in self.dirty
                if blocks[b].ref_cnt == 0 and blocks[b].block_hash is not None]  # fmt: skip
        if len(free) <= self.keep_cached:
            return len(free)
        free.sort(key=self.dirty.__getitem__)
        self.pool.evict_blocks(set(free[: len(free) - self.keep_cached]))
        return self.keep_cached

    def sweep(self) -> int:
        """Punch the pages of free blocks without a prefix hash (dead contents)."""
        blocks = self.pool.blocks
        dead = [b for b in self.dirty if blocks[b].ref_cnt == 0 and blocks[b].block_hash is None]
        if dead:
            self._release(dead)
            for b in dead:
                del self.dirty[b]
        return len(dead)

    def lend_all(self) -> list:
        """Return every balloon block to the pool without budget (for a call that needs the
        pool whole, e.g. resetting the prefix cache); :meth:`take_back` ends it."""
        out, self.held = self.held, []
        self.pool.free_blocks(out)
        return out

    def take_back(self, n: int) -> None:
        self.held += self.pool.get_new_blocks(n)  # they were put first in the queue

    def close(self) -> None:
        if self.backed:
            self.budget.release(self.backed)
            self.backed = 0
