"""The balloon (vmcache/vllm/balloon.py) over vLLM's real ``BlockPool`` with prefix hashes, as
vLLM's scheduler drives it: requests whose full blocks are cached by their real block hashes
(later requests hit them and touch them), finishes, preemptions, aborts, blocks released to
stay readable (``unpin_blocks``), prefix-cache resets and budget changes. On every step: no
block whose contents a request, a prefix hit or an unpinned reader may still read has been
punched; the balloon holds whole groups that no one holds, without a hash; the budget counts
exactly the groups outside it. Needs vLLM (``make test-vllm``); no model is started."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.block_pool")  # (not tests/vllm, a folder without vLLM)

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vmcache.memory.budget import LocalBudget  # noqa: E402
from vmcache.vllm.balloon import Balloon  # noqa: E402

BS = 4  # tokens a block
BLOCKS = 64


class Shadow:
    """What may be read: the blocks each live request holds, the prefix cache's blocks, the
    unpinned blocks not yet handed out again; and which blocks' pages were punched since
    their last write."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.punched: set[int] = set()  # contents gone since the block was last handed out
        self.unpinned: set[int] = set()

    def punch(self, ids: list[int]) -> None:
        for i in ids:
            b = self.pool.blocks[i]
            assert b.ref_cnt == 0, f"punched block {i}, which a request holds"
            assert b.block_hash is None, f"punched block {i}, which the prefix cache holds"
            assert i not in self.unpinned, f"punched block {i}, released to stay readable"
        self.punched.update(ids)

    def handed_out(self, blocks) -> None:
        ids = {b.block_id for b in blocks}
        self.punched -= ids
        self.unpinned -= ids

    def check(self, live: dict[str, list]) -> None:
        for blocks in live.values():
            for b in blocks:
                assert b.block_id not in self.punched, f"a live request's block {b.block_id}"
        for b in self.pool.blocks:
            if b.block_hash is not None:
                assert b.block_id not in self.punched, f"cached block {b.block_id} punched"


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BS, sha256))  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_no_block_that_may_be_read_is_ever_punched(seed):
    rng = random.Random(seed)
    init_none_hash(sha256)
    pool = BlockPool(BLOCKS, enable_caching=True, hash_block_size=BS)
    budget = LocalBudget(40)
    backed: set[int] = set()
    shadow = Shadow(pool)

    def back(gs):
        assert not backed & set(gs)
        backed.update(gs)

    def unback(gs):
        assert backed >= set(gs) and 0 not in gs
        for g in gs:
            assert pool.blocks[g].ref_cnt == 1 and pool.blocks[g].block_hash is None
            assert g not in shadow.unpinned
        backed.difference_update(gs)
        shadow.punched.update(gs)  # its pages given back: contents gone

    b = Balloon(pool, budget, group_blocks=1, chunk_blocks=2, keep_cached=6, back=back,
                unback=unback, punch=shadow.punch)  # fmt: skip
    prefixes = [[rng.randrange(1000) for _ in range(BS * 3)] for _ in range(3)]
    live: dict[str, list] = {}
    n = resets = unpins = preempts = hits = 0
    for _ in range(500):
        op = rng.random()
        if op < 0.35:  # a new request: a shared prefix (maybe cached) and its own tokens
            tokens = rng.choice(prefixes)[: BS * rng.randint(0, 3)]
            tokens = tokens + [rng.randrange(1000) for _ in range(rng.randint(1, 3 * BS))]
            req = request(f"r{n}", tokens)
            n += 1
            cached = []
            for h in req.block_hashes:
                got = pool.get_cached_block(h, [0])
                if got is None:
                    break
                cached.append(got[0])
            need = -(-len(tokens) // BS) - len(cached)
            b.grow(need)
            if need > pool.get_num_free_blocks() - sum(1 for c in cached if c.ref_cnt == 0):
                continue  # vLLM would leave it waiting
            pool.touch(cached)
            hits += len(cached)
            new = pool.get_new_blocks(need)
            shadow.handed_out(new)
            b.written(x.block_id for x in cached + new)
            blocks = cached + new
            pool.cache_full_blocks(req, blocks, len(cached), len(tokens) // BS, BS, 0)
            live[req.request_id] = blocks
        elif op < 0.7 and live:  # finished, preempted or aborted: freed, tail first
            rid = rng.choice(sorted(live))
            preempts += op < 0.5
            pool.free_blocks(reversed(live.pop(rid)))
            b.trim()
        elif op < 0.78 and live:  # a block released to stay readable until reused
            rid = rng.choice(sorted(live))
            blocks = live[rid]
            if blocks and blocks[-1].ref_cnt == 1 and blocks[-1].block_hash is None:
                last = blocks.pop()
                pool.unpin_blocks([last], lambda blk: shadow.unpinned.discard(blk.block_id))
                shadow.unpinned.add(last.block_id)
                unpins += 1
                b.trim()
        elif op < 0.85:
            ok = b.reset_prefix_cache(pool.reset_prefix_cache)
            resets += ok
            assert ok == (not live)  # vLLM's pool refuses while a request holds blocks
        else:
            budget.set_limit(rng.randint(4, 50))
            b.trim()
        shadow.check(live)
        in_balloon = {x.block_id for x in b.blocks_of(b.held)}
        assert not in_balloon & {x.block_id for bl in live.values() for x in bl}
        assert all(pool.blocks[i].block_hash is None and pool.blocks[i].ref_cnt == 1
                   for i in in_balloon)  # fmt: skip
        assert backed == set(range(BLOCKS)) - b.held
        assert b.backed == len(backed) == budget.held
    assert hits and resets and unpins and preempts  # every path was taken


def test_a_reset_with_requests_running_changes_nothing_and_the_balloon_stays_whole():
    init_none_hash(sha256)
    pool = BlockPool(32, enable_caching=True, hash_block_size=BS)
    budget = LocalBudget(10)
    b = Balloon(pool, budget, group_blocks=1, chunk_blocks=2, keep_cached=4,
                back=lambda gs: None, unback=lambda gs: None, punch=lambda ids: None)  # fmt: skip
    b.grow(6)
    req = request("a", list(range(5 * BS)))
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(req, blocks, 0, 5, BS, 0)
    held, free = set(b.held), pool.get_num_free_blocks()
    assert not b.reset_prefix_cache(pool.reset_prefix_cache)  # a request holds blocks
    assert b.held == held and pool.get_num_free_blocks() == free and budget.held == b.backed
    assert pool.get_cached_block(req.block_hashes[0], [0]) is not None
    pool.free_blocks(reversed(blocks))
    assert b.reset_prefix_cache(pool.reset_prefix_cache)
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert budget.held == b.backed and all(pool.blocks[g].ref_cnt == 1 for g in b.held)
    assert pool.get_num_free_blocks() == b.backed - 1  # every backed block but the null one
