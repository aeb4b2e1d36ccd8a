"""Engine.abort: a request dropped while waiting, running, swapped out, with forks of n > 1
made or still to make, or with drafts, gives back everything it held; against the engine's
own state after any mix of finishes and aborts, every page is back in the pool, no swap
bytes are held, the invariants hold, and the requests left alone are answered exactly as
without the aborts."""

import copy
import random

import pytest
import torch
from caches import examples, strict_host
from engine_cases import CFG, SPEC
from transformers import LlamaForCausalLM

from vmcache import VMKVCache
from vmcache.engine import Engine, NgramDrafter, Request, SamplingParams
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(copy.deepcopy(CFG)).eval()
    m.generation_config.eos_token_id = None
    return m


def cache(kind, pages=24, **kw):
    if kind == "vm":
        return VMKVCache(SPEC, 6, 128, page_size=4096, backend=strict_host(), own_backend=True,
                         pool_bytes=pages * 4096, swap_bytes=1 << 20, **kw)  # fmt: skip
    return PagedKVCache(SPEC, num_blocks=pages // 2, block_size=16, max_seq_len=128, max_seqs=6,
                        swap_bytes=1 << 20, **kw)  # fmt: skip


def reqs(seed, count=7):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = tuple(rng.randrange(128) for _ in range(rng.randrange(3, 40)))
        params = SamplingParams(max_new_tokens=rng.randrange(2, 24), n=rng.choice([1, 1, 2, 3]))
        out.append(Request(f"r{i}", prompt, params))
    return out


def drained(engine):
    """Nothing of any request is left in the engine or its cache."""
    kv = engine.kv
    assert not engine.scheduler.has_work()
    assert kv.sequences == []
    assert kv.swap.held_bytes == 0
    check_invariants(kv)
    assert kv._pool.num_used == 0  # no prefix caching here: nothing may hold a page


@pytest.mark.parametrize("policy", ["swap", "recompute"])
@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_aborts_between_steps_give_everything_back(model, kind, policy):
    for seed in range(examples(3)):
        rng = random.Random(f"abort-{seed}")
        requests = reqs(seed)
        want = Engine(model, cache(kind, pages=96), preemption=policy).run(copy.deepcopy(requests))
        engine = Engine(model, cache(kind, pages=16), preemption=policy)  # preemptions
        for r in requests:
            engine.add_request(r)
        aborted = set()
        states = set()
        while engine.scheduler.has_work():
            engine.step()
            live = [r.req_id for r in requests if r.req_id not in aborted
                    and None in engine.finish_reasons[r.req_id]]  # fmt: skip
            if live and rng.random() < 0.3:
                parked = [r for r in live if any(s.status.value != "running"
                                                 for s in engine.records.live(r))]  # fmt: skip
                rid = rng.choice(parked if parked and rng.random() < 0.7 else live)
                states |= {s.status.value for s in engine.records.live(rid)}
                assert engine.abort(rid)
                aborted.add(rid)
                assert not engine.records.live(rid)
                check_invariants(engine.kv)
        drained(engine)
        for r in requests:
            reasons = engine.finish_reasons[r.req_id]
            if r.req_id in aborted:
                assert "abort" in reasons
            else:
                assert engine.outputs[r.req_id] == want[r.req_id]  # untouched by the others
        assert not engine.abort("r0")  # already finished or aborted: nothing to do
    want_states = {"running", "waiting"} | ({"swapped"} if policy == "swap" else set())
    assert want_states <= states, states  # every queue a request can be in, aborted from


def test_abort_of_a_waiting_request_and_of_unknown_ids(model):
    engine = Engine(model, cache("vm"))
    engine.add_request(Request("a", (1, 2, 3), SamplingParams(max_new_tokens=4)))
    assert engine.abort("a")
    assert engine.finish_reasons["a"] == ["abort"] and engine.outputs["a"] == [[]]
    assert not engine.scheduler.has_work()
    with pytest.raises(KeyError):
        engine.abort("nobody")
    drained(engine)


def test_abort_with_forks_still_to_make_and_with_drafts(model):
    engine = Engine(model, cache("vm", pages=96), speculative=NgramDrafter(k=3))
    prompt = tuple([5, 6, 7, 8] * 6)
    engine.add_request(Request("a", prompt, SamplingParams(max_new_tokens=30, n=3)))
    engine.add_request(Request("b", prompt[:10], SamplingParams(max_new_tokens=30)))
    engine.step()  # a's prefill: its two forks made
    engine.step()  # decodes with drafts proposed
    assert len(engine.records.live("a")) == 3
    assert engine.abort("a")
    assert engine.finish_reasons["a"] == ["abort"] * 3
    out = engine.run()
    assert engine.finish_reasons["b"] == ["length"] and len(out["b"][0]) == 30
    drained(engine)
