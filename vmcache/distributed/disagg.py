"""Disaggregated serving: a prefill worker and a decode worker, each an :class:`Engine` over
its own cache in its own process, joined by ``torch.distributed``. The prefill worker runs
prompts; a sequence whose prompt is in its cache and whose first token is sampled is handed
to the decode worker whole (:func:`~vmcache.distributed.handoff.send_sequence`: one message
per table on VMKVCache), which decodes it to the end. Greedy outputs equal one engine's.

Each round, in lockstep:

    prefill rank                                  decode rank
    one engine step (prefill chunks)              one engine step (decodes; and prefills
    announce int64[2]: (k ready, done?) ------->   of its own recompute preemptions)
    hand-off 1..k, oldest first         ------->  receive each while its pool has room for
      (stops at the first refusal; the              it and the running sequences' next
       rest wait in the outbox, pages held)         token; the first refusal ends the round

A request with ``n > 1`` is prefilled once: its siblings forked on the prefill side travel as
one hand-off (the shared prompt once) and are forked again on arrival, sharing its pages.
When the prefill worker is done it announces ``done``; both ranks then exchange outputs.
The decode worker's pool must hold any one sequence with the headroom its running ones need.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from vmcache.distributed.handoff import recv_sequence, send_sequence
from vmcache.engine.request import Request, SamplingParams, Seq
from vmcache.errors import CacheFull


@dataclass
class HandoffLog:
    handoffs: int = 0
    refused: int = 0  # hand-offs the decode worker had no room for (retried later)
    data_messages: int = 0
    data_bytes: int = 0
    seconds: float = 0.0

    def add(self, st) -> None:
        self.handoffs += 1
        self.data_messages += st.data_messages
        self.data_bytes += st.data_bytes
        self.seconds += st.seconds

    def as_dict(self) -> dict:
        return asdict(self)


def serve_disaggregated(
    engine,
    requests: list[Request],
    *,
    prefill_rank: int = 0,
    decode_rank: int = 1,
    group=None,
    packed: bool = False,
) -> dict:
    """Run ``requests`` with this rank's ``engine`` in its role (by its rank in ``group``);
    every rank gets back all outputs (``{req_id: n token lists}``) once both are done.
    Requests are submitted on the prefill rank (the decode rank's list is ignored)."""
    rank = dist.get_rank(group)
    t0 = time.perf_counter()
    if rank == prefill_rank:
        log, mine = _prefill(engine, requests, decode_rank, group, packed)
    elif rank == decode_rank:
        log, mine = _decode(engine, prefill_rank, group)
    else:
        raise ValueError(f"rank {rank} is neither the prefill ({prefill_rank}) nor the decode "
                         f"rank ({decode_rank})")  # fmt: skip
    engine.handoff_log = log
    engine.stats.elapsed_s += time.perf_counter() - t0
    both: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(both, mine, group=group)
    merged: dict = {}
    for part in both:
        for rid, outs in (part or {}).items():
            slot = merged.setdefault(rid, [None] * len(outs))
            for i, o in enumerate(outs):
                slot[i] = o if o is not None else slot[i]
    return merged


def _prefill(engine, requests, dst, group, packed):
    log, outbox = HandoffLog(), []
    sched, kv = engine.scheduler, engine.kv
    room = torch.zeros(1, dtype=torch.int64)
    dist.recv(room, dst, group)  # the decode worker's pool, in pages
    for r in requests:
        need = kv.capacity.pages_for_tokens(len(r.prompt)) + 2 * kv.capacity.pages_for_tokens(1)
        if need > int(room):
            raise ValueError(f"request {r.req_id!r}: its prompt needs {need} pages on the "
                             f"decode worker, whose pool has {int(room)}")  # fmt: skip

    def hand_off(seq: Seq, kids: list[Seq]) -> None:
        for s in (seq, *kids):
            sched.hand_off(s)  # finished here; it goes on in the decode worker
        outbox.append((seq, kids))

    engine.on_prefilled = hand_off
    for r in requests:
        engine.add_request(r)
    ctrl = torch.zeros(2, dtype=torch.int64)
    while True:
        if sched.has_work():
            try:
                engine.step()
            except CacheFull:
                if not outbox:  # nothing will ever free pages here
                    raise
        done = not sched.has_work() and not outbox
        ctrl[0], ctrl[1] = len(outbox), int(done)
        dist.send(ctrl, dst, group)
        if done:
            return log, _outputs(engine)
        while outbox:
            seq, kids = outbox[0]
            try:
                log.add(send_sequence(engine.kv, seq.slot, dst, group, packed=packed,
                                      extra=_describe(seq, kids)))  # fmt: skip
            except CacheFull:
                log.refused += 1
                break
            outbox.pop(0)
            for s in (seq, *kids):
                sched.release(s)


def _describe(seq: Seq, kids: list[Seq]) -> dict:
    """What the decode worker needs to continue these sequences of one request, as JSON
    (the hand-off carries no pickle): the request, and per sequence its index, tokens,
    generated tokens and sampler state."""
    r = seq.req
    return {"req": {"req_id": r.req_id, "prompt": list(r.prompt), "salt": r.salt,
                    "params": asdict(r.params)},
            "cached": seq.cached,
            "seqs": [(s.index, s.tokens, s.generated,
                      base64.b64encode(s.generator.get_state().numpy().tobytes()).decode())
                     for s in (seq, *kids)]}  # fmt: skip


def _described(extra) -> tuple[Request, int, list]:
    """:func:`_describe`'s JSON back as a request, its cached length and its sequences;
    ``ValueError`` / ``TypeError`` for anything that is not one (checked before use)."""
    if not isinstance(extra, dict) or not isinstance(extra.get("req"), dict):
        raise ValueError("the hand-off's extra is not a request description")
    r = extra["req"]
    req = Request(str(r["req_id"]), tuple(_ints(r["prompt"])), SamplingParams(**r["params"]),
                  None if r["salt"] is None else str(r["salt"]))  # fmt: skip
    cached = extra["cached"]
    seqs = []
    for index, tokens, generated, state in extra["seqs"]:
        seqs.append((_ints([index])[0], _ints(tokens), _ints(generated),
                     torch.frombuffer(bytearray(base64.b64decode(state, validate=True)),
                                      dtype=torch.uint8)))  # fmt: skip
    if not seqs or not isinstance(cached, int) or len(seqs) > req.params.n:
        raise ValueError("the hand-off's extra describes no sequence")
    return req, cached, seqs


def _ints(xs) -> list[int]:
    if not isinstance(xs, list) or not all(type(x) is int and x >= 0 for x in xs):
        raise ValueError("expected a list of non-negative ints")
    return xs


def _decode(engine, src, group):
    log = HandoffLog()
    sched, kv = engine.scheduler, engine.kv
    ctrl = torch.zeros(2, dtype=torch.int64)
    dist.send(torch.tensor([kv.capacity.num_pages]), src, group)
    done = False
    while not done or sched.has_work():
        if not done:
            dist.recv(ctrl, src, group)
            k, done = int(ctrl[0]), bool(ctrl[1])
            for _ in range(k):
                headroom = (len(sched.running) + 1) * kv.capacity.pages_for_tokens(1)
                try:
                    arrival = recv_sequence(kv, src, group, headroom_pages=headroom)
                except CacheFull:
                    log.refused += 1
                    break
                log.add(arrival.stats)
                _admit(engine, arrival)
        if sched.has_work():
            engine.step()
    return log, _outputs(engine)


def _admit(engine, arrival) -> None:
    """The arrived sequence (and its siblings, forked here) join the running batch; a
    description that does not decode frees it and raises ``ValueError``."""
    kv = engine.kv
    try:
        req, cached, entries = _described(arrival.extra)
    except (ValueError, TypeError, KeyError, binascii.Error) as exc:
        kv.free(arrival.slot)
        raise ValueError(f"the prefill worker's request description is invalid: {exc}") from exc
    forks = min(len(entries) - 1, kv.capacity.free_slots)
    slots = [arrival.slot] + (kv.fork(arrival.slot, forks) if forks else [])
    engine.records.adopt(req, time.perf_counter())
    for i, (index, tokens, generated, state) in enumerate(entries):
        seq = engine._seq(req, index, tokens)
        seq.generator.set_state(state)
        seq.generated = list(generated)
        if i < len(slots):
            engine.scheduler.join(seq, slots[i], cached, engine.stats.steps)
        else:  # no slot to fork into: prefilled here later, as a recompute preemption is
            engine.scheduler.add(seq)


def _outputs(engine) -> dict:
    return {rid: list(outs) for rid, outs in engine.outputs.items()}
