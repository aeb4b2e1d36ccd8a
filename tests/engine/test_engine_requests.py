"""The engine's per-request calls a server drives between steps (``check_request``, ``stop``,
``abort``, and ``records.new_tokens`` / ``prefix_hit`` / ``release``), against a shadow of what each
request was sent: a state machine adds, steps, stops, aborts and releases requests in any
order on both caches with prefix caching on; every stream's deltas add up to its output, a
stopped sequence's siblings run on, nothing released can be reached again, and after the
last release every page not held by the prefix index is back in the pool."""

import copy
import random

import pytest
import torch
from caches import examples, strict_host
from engine_cases import CFG, SPEC
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers import LlamaForCausalLM

from vmcache import VMKVCache
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

torch.manual_seed(0)
MODEL = LlamaForCausalLM(copy.deepcopy(CFG)).eval()
MODEL.generation_config.eos_token_id = 3  # a real stop id, so some sequences end early
SHARED = tuple(random.Random(0).randrange(4, 128) for _ in range(40))  # a common "system prompt"


def cache(kind):
    if kind == "vm":
        return VMKVCache(SPEC, 6, 128, page_size=4096, backend=strict_host(), own_backend=True,
                         pool_bytes=20 * 4096, swap_bytes=1 << 20,
                         prefix_caching=True)  # fmt: skip
    return PagedKVCache(SPEC, num_blocks=10, block_size=16, max_seq_len=128, max_seqs=6,
                        swap_bytes=1 << 20, prefix_caching=True)  # fmt: skip


class RequestsMachine(RuleBasedStateMachine):
    kind = "vm"

    def __init__(self):
        super().__init__()
        self.engine = Engine(MODEL, cache(self.kind), preemption="swap")
        self.n = 0
        self.seen: dict[str, list[list[int]]] = {}  # req_id -> each sequence's streamed tokens
        self.sent: dict[str, Request] = {}

    def _deltas(self, rid):
        seen = self.seen[rid]
        for got, new in zip(seen, self.engine.records.new_tokens(rid, [len(s) for s in seen])):
            got += new

    def _live(self):
        return [r for r in self.sent if None in self.engine.finish_reasons[r]]

    @rule(shared=st.booleans(), tail=st.integers(1, 30), n=st.integers(1, 3),
          new=st.integers(1, 12), seed=st.integers(0, 3))  # fmt: skip
    def add(self, shared, tail, n, new, seed):
        rng = random.Random(f"{self.n}-{seed}")
        prompt = (SHARED if shared else ()) + tuple(rng.randrange(4, 128) for _ in range(tail))
        req = Request(f"r{self.n}", prompt, SamplingParams(max_new_tokens=new, n=n))
        self.n += 1
        self.engine.check_request(req)  # accepted by the check, so by add_request
        self.engine.add_request(req)
        self.sent[req.req_id], self.seen[req.req_id] = req, [[] for _ in range(n)]
        assert self.engine.records.prefix_hit(req.req_id) == 0  # not admitted yet

    @precondition(lambda self: self.engine.scheduler.has_work())
    @rule()
    def step(self):
        self.engine.step()
        for rid in self.sent:
            self._deltas(rid)

    @precondition(lambda self: self.sent)
    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        rid = sorted(self.sent)[pick % len(self.sent)]
        live = None in self.engine.finish_reasons[rid]
        assert self.engine.abort(rid) == live
        assert None not in self.engine.finish_reasons[rid] and not self.engine.records.live(rid)

    @precondition(lambda self: self.sent)
    @rule(pick=st.integers(0, 10**6), index=st.integers(0, 2))
    def stop(self, pick, index):
        rid = sorted(self.sent)[pick % len(self.sent)]
        reasons = list(self.engine.finish_reasons[rid])
        if index >= len(reasons) or index not in self.engine.records.seqs[rid]:
            with pytest.raises(ValueError):
                self.engine.stop(rid, index)
            assert self.engine.finish_reasons[rid] == reasons  # untouched
            return
        ran = reasons[index] is None
        assert self.engine.stop(rid, index) == ran
        after = self.engine.finish_reasons[rid]
        assert after[index] == ("stop" if ran else reasons[index])
        assert [r for i, r in enumerate(after) if i != index] == \
            [r for i, r in enumerate(reasons) if i != index]  # fmt: skip

    @precondition(lambda self: self.sent)
    @rule(pick=st.integers(0, 10**6))
    def release(self, pick):
        rid = sorted(self.sent)[pick % len(self.sent)]
        if rid in self._live():
            with pytest.raises(ValueError):
                self.engine.records.release(rid)
            assert rid in self.engine.outputs  # still there
            return
        self._deltas(rid)
        outputs, reasons = self.engine.records.release(rid)
        assert outputs == self.seen[rid]  # the streamed deltas add up to the answer
        assert None not in reasons and len(outputs) == self.sent[rid].params.n
        limit = self.sent[rid].params.max_new_tokens
        for out, why in zip(outputs, reasons):
            assert len(out) == limit if why == "length" else len(out) <= limit
        records = self.engine.records
        for call in (self.engine.abort, records.prefix_hit, records.release):
            with pytest.raises(KeyError):
                call(rid)
        del self.sent[rid], self.seen[rid]

    @invariant()
    def consistent(self):
        check_invariants(self.engine.kv)
        kv = self.engine.kv
        for rid in self.sent:
            hit = self.engine.records.prefix_hit(rid)
            assert 0 <= hit <= len(self.sent[rid].prompt)
            if hit:
                assert hit % kv.prefix.tokens_per_entry == 0  # whole cached pages only

    def teardown(self):
        for rid in [r for r in self.sent if r in self.engine.outputs]:
            self.engine.abort(rid)
            self.engine.records.release(rid)
        kv = self.engine.kv
        assert not self.engine.scheduler.has_work() and kv.sequences == []
        assert kv.swap.held_bytes == 0
        assert kv._pool.num_used == kv.prefix.index.stats().cached_pages  # every other page back
        assert not self.engine.outputs and not self.engine.records.seqs and not self.engine.times
        check_invariants(kv)
        kv.close()


class PagedRequestsMachine(RequestsMachine):
    kind = "paged"


SETTINGS = settings(max_examples=examples(25), stateful_step_count=30, deadline=None)
TestRequestsVM = RequestsMachine.TestCase
TestRequestsVM.settings = SETTINGS
TestRequestsPaged = PagedRequestsMachine.TestCase
TestRequestsPaged.settings = SETTINGS


def test_a_stopped_sequence_leaves_its_siblings_as_they_were():
    prompt = tuple(range(5, 25))
    params = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, seed=7)
    want = Engine(MODEL, cache("vm")).run([Request("a", prompt, params)])["a"]
    engine = Engine(MODEL, cache("vm"))
    engine.add_request(Request("a", prompt, params))
    engine.step()
    engine.step()
    assert engine.stop("a", 1)
    assert not engine.stop("a", 1)  # finished already
    out = engine.run()["a"]
    assert engine.finish_reasons["a"][1] == "stop" and out[1] == want[1][: len(out[1])]
    assert len(out[1]) < len(want[1]) or want[1][-1:] == [3]
    assert [out[0], out[2]] == [want[0], want[2]]  # the others run on, sampled as before


def test_check_request_refuses_what_add_request_refuses_and_changes_nothing():
    engine = Engine(MODEL, cache("paged"))
    engine.add_request(Request("a", (5, 6), SamplingParams(max_new_tokens=2)))
    bad = [Request("a", (5,), SamplingParams()), Request("b", (), SamplingParams()),
           Request("c", (500,), SamplingParams()),
           Request("d", (5,) * 100, SamplingParams(max_new_tokens=100))]  # fmt: skip
    for req in bad:
        with pytest.raises(ValueError):
            engine.check_request(req)
        with pytest.raises(ValueError):
            engine.add_request(req)
    assert list(engine.outputs) == ["a"] and len(engine.scheduler.waiting) == 1


def test_prefix_hit_reports_the_cached_prompt_tokens():
    engine = Engine(MODEL, cache("vm"))
    first = Request("a", SHARED + (9, 9), SamplingParams(max_new_tokens=2))
    engine.run([first])
    engine.run([Request("b", SHARED + (7,), SamplingParams(max_new_tokens=2))])
    page = engine.kv.prefix.tokens_per_entry
    assert engine.records.prefix_hit("a") == 0
    assert engine.records.prefix_hit("b") == len(SHARED) // page * page > 0
