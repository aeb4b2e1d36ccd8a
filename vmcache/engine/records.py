"""What the engine knows of each request it was given, by id, from ``add_request`` until
``release``: its sequences, what each generated, why each finished, its times. One owner:
the engine's step and a server read and write these tables through this class only.

    req_id ─┬─ seqs            {index: Seq}   sequences made so far (forks join later)
            ├─ outputs         [tokens | None] × n   (None while that sequence runs)
            ├─ finish_reasons  [reason | None] × n   ("stop", "length", "abort")
            ├─ times           [arrival, first token, finish]   (perf_counter seconds)
            └─ pending_forks   sequences of n > 1 not made yet (until the prefill)
"""

from __future__ import annotations

import time

from vmcache.engine.request import Request, Seq, Status


class Records:
    def __init__(self) -> None:
        self.outputs: dict[str, list[list[int] | None]] = {}  # req_id -> n token lists
        self.finish_reasons: dict[str, list[str | None]] = {}  # req_id -> "stop" / "length"
        self.times: dict[str, list] = {}  # req_id -> [arrival, first token, finish]
        self.pending_forks: dict[str, int] = {}  # req_id -> sequences still to create
        self.seqs: dict[str, dict[int, Seq]] = {}  # req_id -> its sequences made so far

    def open(self, req: Request, arrival_s: float | None) -> None:
        """A new request's records (its id checked unused by the engine first)."""
        rid, n = req.req_id, req.params.n
        self.outputs[rid], self.finish_reasons[rid] = [None] * n, [None] * n
        self.times[rid] = [time.perf_counter() if arrival_s is None else arrival_s, None, None]
        self.pending_forks[rid] = n - 1
        self.seqs[rid] = {}

    def adopt(self, req: Request, now_s: float) -> None:
        """Records for a request whose prompt another engine prefilled (its first token
        already sampled there, its forks made by the receiver): once per request."""
        if req.req_id not in self.outputs:
            self.open(req, now_s)
            self.times[req.req_id][1] = now_s
            self.pending_forks[req.req_id] = 0

    def register(self, seq: Seq) -> None:
        self.seqs.setdefault(seq.req.req_id, {})[seq.index] = seq

    def reasons(self, req_id: str) -> list[str | None]:
        """The finish reasons of ``req_id``; ``KeyError`` for an id never added or released."""
        if req_id not in self.outputs:
            raise KeyError(f"no request {req_id!r} was added (or it was released)")
        return self.finish_reasons[req_id]

    def live(self, req_id: str) -> list[Seq]:
        """The sequences of ``req_id`` still queued (running, waiting or swapped)."""
        return [s for s in self.seqs.get(req_id, {}).values() if s.status is not Status.FINISHED]

    def unmade(self, req_id: str) -> list[int]:
        """Indices of ``req_id``'s sequences that were never made and have no finish reason."""
        made = self.seqs[req_id]
        return [i for i, r in enumerate(self.reasons(req_id)) if r is None and i not in made]

    def finish(self, seq: Seq, reason: str) -> None:
        """``seq`` ended with ``reason``: its output and reason kept; the request's finish
        time once every sequence of it has one."""
        rid = seq.req.req_id
        self.finish_reasons[rid][seq.index] = reason
        self.outputs[rid][seq.index] = list(seq.generated)
        self._stamp(rid)

    def give_up(self, req_id: str, indices: list[int], reason: str) -> None:
        """Sequences never made (forks of an aborted request) end with ``reason``, empty."""
        for i in indices:
            self.finish_reasons[req_id][i], self.outputs[req_id][i] = reason, []
        self._stamp(req_id)

    def _stamp(self, rid: str) -> None:
        if all(r is not None for r in self.finish_reasons[rid]):
            self.times[rid][2] = time.perf_counter()

    def new_tokens(self, req_id: str, seen: list[int]) -> list[list[int]]:
        """The tokens each of ``req_id``'s sequences generated after its first ``seen[i]``
        (a streaming server's delta; a fork not made yet has none). Read between steps."""
        self.reasons(req_id)
        seqs = self.seqs[req_id]
        return [seqs[i].generated[k:] if i in seqs else [] for i, k in enumerate(seen)]

    def logprobs(self, req_id: str, index: int, start: int, stop: int) -> list:
        """Sequence ``index`` of ``req_id``: the :class:`~vmcache.engine.logits.TokenLogprob`
        of its generated tokens ``[start, stop)`` (empty unless the request asked for
        ``logprobs``)."""
        self.reasons(req_id)
        seq = self.seqs[req_id].get(index)
        return [] if seq is None else seq.logprobs[start:stop]

    def prompt_logprobs(self, req_id: str) -> list:
        """``req_id``'s prompt tokens' reports (None for the first), once its prefill is
        done; empty unless it asked for ``prompt_logprobs``."""
        self.reasons(req_id)
        first = self.seqs[req_id].get(0)
        return [] if first is None else list(first.prompt_logprobs)

    def prefix_hit(self, req_id: str) -> int:
        """Prompt tokens ``req_id``'s first admission found in the prefix cache (0 before)."""
        self.reasons(req_id)
        first = self.seqs[req_id].get(0)
        return first.prefix_hit or 0 if first is not None else 0

    def release(self, req_id: str) -> tuple[list[list[int]], list[str]]:
        """Forget a finished request (a server's memory stays flat; its id can be used
        again): returns its outputs and finish reasons. ``ValueError`` while it runs."""
        if any(r is None for r in self.reasons(req_id)):
            raise ValueError(f"request {req_id!r} has not finished; abort it first")
        for store in (self.seqs, self.times, self.pending_forks):
            store.pop(req_id, None)
        return self.outputs.pop(req_id), self.finish_reasons.pop(req_id)
