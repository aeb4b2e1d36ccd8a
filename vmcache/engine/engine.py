"""Continuous batching over either cache: requests in, token lists out, nothing dropped.

    engine = Engine(model, VMKVCache(spec, max_seqs=32, max_seq_len=2048, pool_bytes=...))
    outputs = engine.run([Request("a", prompt_ids, SamplingParams(max_new_tokens=64))])
    outputs["a"]  # n lists of generated token ids

A step has three stages, as vLLM's ``schedule`` / ``update_from_output``:

    schedule      drafts proposed → Scheduler: grows (the map phase), preemption if the
                  pool is short, admissions; drafts left out dropped
    run           one packed model call (prefills, decodes and drafts) → logits rows
    postprocess   next pages mapped ahead; drafts verified; tokens sampled; finished
                  sequences freed, forks of ``n > 1`` made; free pages trimmed

A request with ``n > 1`` is prefilled once; its other sequences are forks (copy-on-write).
The scheduler writes its counters into :class:`EngineStats`, the speculation its own
(``stats.speculation``). Each stage is a torch.profiler scope (``vmcache: schedule`` / ``run``
/ ``postprocess``; the model's call is ``vmcache: model``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from vmcache.engine.compiled import make_runner
from vmcache.engine.drafts import DraftModel, NgramDrafter
from vmcache.engine.logits import pick, record_prompt_logprobs
from vmcache.engine.records import Records
from vmcache.engine.request import Request, Seq, Status, model_eos_ids
from vmcache.engine.scheduler import Scheduler
from vmcache.engine.speculation import Speculation
from vmcache.engine.stats import EngineStats
from vmcache.errors import CacheFull


@dataclass
class _StepWork:
    """What the run stage hands postprocessing: logits rows and how they map to ``batch``."""

    logits: torch.Tensor  # [Σ rows, V] fp32: a verified draft's every row, else its last
    starts: list[int]  # batch entry i's rows are logits[starts[i] : starts[i + 1]]
    verifies: list[bool]  # entry i verifies drafts
    decodes: list[bool]  # entry i decodes (else it fed a prompt chunk)
    prompt_rows: list[bool]  # entry i's prompt chunk has a row per token (prompt logprobs)
    forks: dict  # entry i -> its token tree's forks (kids, their batch entries, rows each)


class Engine:
    def __init__(self, model, cache, *, preemption: str = "recompute", victim: str = "last",
                 max_batch_tokens: int = 2048, map_ahead: bool = True,
                 keep_free_pages: int | None = None,
                 speculative: NgramDrafter | DraftModel | None = None,
                 compile: bool | str = False,
                 compile_cache: str | os.PathLike | None = None,
                 ) -> None:  # fmt: skip
        """``keep_free_pages``: after each step, give back the memory of free pages beyond
        that many (elastic memory: an engine sharing a device's budget returns what it does
        not use); None keeps every page it created. ``speculative``: draft tokens for every
        decoding sequence and verify them in the next step
        (:mod:`vmcache.engine.drafts`); a sliding-window cache must keep
        ``rollback_tokens`` ≥ its ``k`` (a rejected draft is truncated away). ``compile``:
        run the model's forward compiled (:mod:`vmcache.engine.compiled`: warmed up here,
        ``runner.startup_s`` long; ``ValueError`` with the reason where it cannot; ``"auto"``:
        compiled where it can, eager otherwise; :attr:`compile_choice` says which and why);
        ``compile_cache``: a directory to keep it in (created private), so that later
        engines on the same model load it instead of compiling (CPU: seconds instead of
        minutes); None compiles for this engine only.

        Sequences stop at the model's end-of-sequence ids (:attr:`eos_token_ids`, read from
        its ``generation_config`` here) unless a request says ``ignore_eos``; why each
        finished is in :attr:`finish_reasons`."""
        self.kv, self.map_ahead, self.keep_free_pages = cache, map_ahead, keep_free_pages
        # on a shared budget: how long nothing may run before CacheFull (None: no bound, as a
        # server whose requests carry deadlines of their own runs it)
        self.max_wait_s: float | None = 60.0
        self._stalled_since: float | None = None
        self.runner, self.compile_choice = make_runner(model, cache, compile, compile_cache)
        self.vocab = model.config.get_text_config().vocab_size
        self.eos_token_ids = model_eos_ids(model)  # stop ids of every request but ignore_eos
        self.stats = EngineStats()  # the scheduler and the speculation write their parts
        self.scheduler = Scheduler(cache, preemption, victim, max_batch_tokens, self.stats)
        self.speculation = None  # drafts proposed before scheduling, verified after
        if speculative is not None:
            self.speculation = Speculation(speculative, cache, self.vocab, self.stats.speculation)
        # every request's sequences, outputs, finish reasons and times, until released
        self.records = Records()
        # called with (seq, its forked siblings) once a prompt is prefilled and sampled, for
        # those still running (vmcache.distributed.disagg hands them to a decode worker)
        self.on_prefilled: Callable[[Seq, list[Seq]], None] | None = None

    @property
    def outputs(self) -> dict[str, list[list[int] | None]]:
        """req_id -> its n token lists (None while that sequence runs)."""
        return self.records.outputs

    @property
    def finish_reasons(self) -> dict[str, list[str | None]]:
        """req_id -> why each sequence finished ("stop", "length", "abort"; None: running)."""
        return self.records.finish_reasons

    @property
    def times(self) -> dict[str, list]:
        """req_id -> [arrival, first token, finish] (``time.perf_counter()`` seconds)."""
        return self.records.times

    def check_request(self, req: Request) -> None:
        """Raise what :meth:`add_request` would for ``req`` (``TypeError`` / ``ValueError``:
        a bad prompt, stop ids past the vocabulary, more tokens than the cache can ever hold
        for one sequence, an id in use); changes nothing."""
        if not isinstance(req, Request):
            raise TypeError(f"add_request takes a Request, got {type(req).__name__}")
        if req.req_id in self.outputs:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        prompt = req.prompt
        if not prompt or not all(isinstance(t, int) and 0 <= t < self.vocab for t in prompt):
            raise ValueError(f"request {req.req_id!r}: prompt must be a non-empty list of token "
                             f"ids in [0, {self.vocab})")  # fmt: skip
        p = req.params
        for what, ids in (("stop_token_ids", p.stop_token_ids),
                          ("logit_bias", [t for t, _ in p.logit_bias])):  # fmt: skip
            if any(t >= self.vocab for t in ids):
                raise ValueError(f"request {req.req_id!r}: {what} must be below the "
                                 f"vocabulary size {self.vocab}")  # fmt: skip
        if self.speculation is not None and (p.processes_logits or p.logprobs is not None
                                             or p.prompt_logprobs is not None):  # fmt: skip
            raise ValueError(f"request {req.req_id!r}: log-probabilities, logit bias and "
                             "penalties are not served with speculative decoding")  # fmt: skip
        total = len(prompt) + req.params.max_new_tokens
        if total > self.kv.config.max_seq_len:
            raise ValueError(f"request {req.req_id!r}: {total} tokens exceed the cache's "
                             f"max_seq_len {self.kv.config.max_seq_len}")  # fmt: skip
        # a sliding window holds only its last pages: the peak of a grow by one step (a whole
        # prefill or re-prefill chunk) is what must fit
        peak = self.kv.capacity.peak_pages(total, min(total, self.scheduler.max_batch_tokens))
        if peak > self.kv.capacity.num_pages:
            raise ValueError(f"request {req.req_id!r}: {total} tokens need {peak} pages at "
                             f"once, the pool has {self.kv.capacity.num_pages}")  # fmt: skip

    def add_request(self, req: Request, arrival_s: float | None = None) -> None:
        """Queue a request (arrived at ``arrival_s``, a ``time.perf_counter()`` value; now by
        default); bad input raises here (:meth:`check_request`), before anything changes."""
        self.check_request(req)
        self.records.open(req, arrival_s)
        self.scheduler.add(self._seq(req, 0, list(req.prompt)))

    def _seq(self, req: Request, index: int, tokens: list[int]) -> Seq:
        p = req.params
        g = torch.Generator()
        if p.seed is None:  # fresh randomness, from the operating system
            g.seed()
        else:  # sequence `index` of a seeded request: its own stream, any int seed
            g.manual_seed((p.seed * 1_000_003 + index) % 2**64)
        stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        seq = Seq(req, index, list(tokens), g, stop_ids=stops)
        self.records.register(seq)
        return seq

    def _append(self, seq: Seq, token: int, in_tokens: bool = False) -> None:
        """``token`` generated for ``seq`` (``in_tokens``: an accepted draft, already at the
        end of its tokens); a finished sequence is freed."""
        if not in_tokens:
            seq.tokens.append(token)
        seq.generated.append(token)
        self.stats.generated_tokens += 1
        reason = seq.done()
        if reason is not None:
            self._drop(seq, reason)

    def _fork_siblings(self, seq: Seq, logits: torch.Tensor) -> list[Seq]:
        """After a request's prefill: its other n−1 sequences share the prompt's pages
        (returned: those that got a slot)."""
        rid = seq.req.req_id
        want = self.records.pending_forks.pop(rid, 0)
        if not want:
            return []
        sched = self.scheduler
        free_slots = self.kv.capacity.free_slots
        kids = self.kv.fork(seq.slot, min(want, free_slots)) if free_slots else []
        forked = []
        for i in range(1, want + 1):
            sib = self._seq(seq.req, i, seq.tokens)
            if i <= len(kids):  # shares the prompt's pages, samples from the same logits
                sched.join(sib, kids[i - 1], seq.cached, seq.admitted_at)
                forked.append(sib)
                self._append(sib, pick(sib, logits))
            else:  # no slot left: it waits and is prefilled on its own later
                sched.add(sib)
        return forked

    def step(self) -> None:
        """One engine step in three stages: schedule (drafts proposed, pages mapped, who runs
        and with how many tokens), run (one packed model call), postprocess (verify drafts,
        sample, finish, fork; pages mapped ahead for the next step)."""
        t0 = time.perf_counter()
        batch = self._schedule()
        t1 = time.perf_counter()
        if not batch:
            self._stall(t0)
            return
        self._stalled_since = None
        work = self._run(batch)
        premap = self._postprocess(batch, work)
        t2 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.map_s += t1 - t0
        st.premap_s += premap
        st.model_s += t2 - t1 - premap
        st.step_s.append(t2 - t0)
        st.max_running = max(st.max_running, len(self.scheduler.running))

    # --- stage 1: schedule ---------------------------------------------------------------
    @record_function("vmcache: schedule")
    def _schedule(self) -> list[Seq]:
        """Drafts for decoding sequences, then the scheduler's batch (its grows map pages;
        it may preempt); drafts of sequences left out are dropped."""
        sched, speculation = self.scheduler, self.speculation
        if speculation is not None:
            speculation.propose(sched.running)
        batch = sched.schedule(self.stats.steps)
        if speculation is not None:
            speculation.drop_unscheduled(sched.running, batch)
        return batch

    def _stall(self, t0: float) -> None:
        """Nothing could run: on a budget shared with other processes wait for them to free
        memory (up to ``max_wait_s``), else ``CacheFull``."""
        self._stalled_since = t0 if self._stalled_since is None else self._stalled_since
        waited = t0 - self._stalled_since
        if not self.kv.elastic.shared_budget or (
            self.max_wait_s is not None and waited > self.max_wait_s
        ):
            raise CacheFull("nothing can run: the pool cannot hold the next waiting request",
                            wanted=1, free=0)  # fmt: skip
        self.stats.budget_waits += 1
        time.sleep(0.002)

    # --- stage 2: run --------------------------------------------------------------------
    @record_function("vmcache: run")
    def _run(self, batch: list[Seq]) -> _StepWork:
        """One packed model call over ``batch`` (and a token tree's forks): the logits rows
        each sequence needs (all of a verified draft's, else its last)."""
        verifies = [bool(s.draft) for s in batch]  # verifying drafts: every position's logits
        decodes = [sp or (bool(s.generated) and s.chunk == 1 and s.cached == len(s.tokens) - 1)
                   for s, sp in zip(batch, verifies)]  # fmt: skip
        self.stats.prefill_tokens += sum(s.chunk for s, d in zip(batch, decodes) if not d)
        prompt_rows = [not d and s.needs_prompt_logprobs for s, d in zip(batch, decodes)]
        rows = [s.chunk if sp or pr else 1 for s, sp, pr in zip(batch, verifies, prompt_rows)]
        args = ([s.slot for s in batch], [s.cached for s in batch], [s.scheduled for s in batch])
        forks = self.speculation.fork_branches(batch, args, rows) if any(verifies) else {}
        trees = [s.tree[: s.chunk] if sp and s.tree else None for s, sp in zip(batch, verifies)]
        trees += [None] * (len(args[0]) - len(batch))  # the forks' chains
        logits = (self.runner.step(*args, rows=rows, trees=trees) if any(r > 1 for r in rows)
                  else self.runner.step(*args))  # fmt: skip
        starts = [0, *torch.tensor(rows).cumsum(0).tolist()]
        return _StepWork(logits, starts, verifies, decodes, prompt_rows, forks)

    # --- stage 3: postprocess ------------------------------------------------------------
    @record_function("vmcache: postprocess")
    def _postprocess(self, batch: list[Seq], work: _StepWork) -> float:
        """Pages of the next step mapped ahead (returns the seconds it took), then per
        sequence: verify its drafts, or take its prompt chunk / decode's token; finished
        sequences freed, forks of ``n > 1`` made; free pages given back past
        ``keep_free_pages``."""
        premap = self._map_ahead(batch)
        now = time.perf_counter()
        logits, starts = work.logits, work.starts
        # greedy sequences' tokens: one argmax over every row (not one call per sequence), as
        # max(-1)'s indices: the same (the first maximum; a NaN wins), a third of the time
        greedy = (logits.max(-1).indices.tolist()
                  if any(s.req.params.temperature == 0 for s in batch) else None)  # fmt: skip
        for i, seq in enumerate(batch):
            if work.verifies[i]:
                mine, branches = logits[starts[i] : starts[i + 1]], None
                if i in work.forks:  # a token tree verified in forks: their rows too
                    kids, at, n = work.forks[i]
                    branches = (kids, [logits[starts[j] : starts[j] + r] for j, r in zip(at, n)])
                self.speculation.verify(seq, mine, branches, self._append,
                                        self.scheduler.rewind)  # fmt: skip
                continue
            if work.prompt_rows[i]:
                record_prompt_logprobs(seq, logits[starts[i] : starts[i + 1]])
            self.scheduler.advance(seq)
            if not work.decodes[i]:
                self.kv.prefix.publish(seq.slot)  # its prompt's full pages, for later requests
            if seq.cached < len(seq.tokens):
                continue  # a prompt chunk: the rest comes in later steps, no token yet
            row = logits[starts[i + 1] - 1]
            times = self.times[seq.req.req_id]
            times[1] = now if times[1] is None else times[1]
            kids = self._fork_siblings(seq, row)  # before the parent's token joins its context
            argmax = greedy[starts[i + 1] - 1] if seq.req.params.temperature == 0 else None
            self._append(seq, pick(seq, row, argmax))
            if self.on_prefilled is not None and seq.status is Status.RUNNING:
                self.on_prefilled(seq, [k for k in kids if k.status is Status.RUNNING])
        keep = self.keep_free_pages
        if keep is not None:
            pb = self.kv.config.page_bytes
            self.stats.released_pages += self.kv.elastic.trim(keep * pb) // pb
        return premap

    def _map_ahead(self, batch: list[Seq]) -> float:
        """On a GPU the step is still running: map the next step's pages now (``map_ahead``);
        returns the seconds it took."""
        if not self.map_ahead:
            return 0.0
        tp = time.perf_counter()
        for seq in batch:
            if seq.draft:  # its length changes once the drafts are verified
                continue
            if len(seq.generated) + 1 < seq.req.params.max_new_tokens:  # (a stop frees it)
                self.stats.premapped_pages += self.kv.allocate(seq.slot, 0, ahead=1).ahead
        return time.perf_counter() - tp

    def _drop(self, seq: Seq, reason: str) -> None:
        """Take ``seq`` out of whichever queue holds it (running: its pages freed; swapped: its
        host copy dropped) and record it finished with ``reason`` and what it generated."""
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        self.records.finish(seq, reason)

    def abort(self, req_id: str) -> bool:
        """Drop request ``req_id`` now (between steps): its running sequences freed (pages
        back to the pool, pages mapped ahead with them), its waiting ones dequeued, its
        swapped ones' host copies dropped, forks of ``n > 1`` not made yet cancelled, a
        draft model's slots freed. What it generated so far stays in :attr:`outputs`, with
        the finish reason ``"abort"``. Returns False when nothing of it was left (finished
        or aborted before); ``KeyError`` for an id never added."""
        live, unmade = self.records.live(req_id), self.records.unmade(req_id)
        self.records.pending_forks.pop(req_id, None)
        if not live and not unmade:
            return False
        for seq in live:
            self._drop(seq, "abort")
        self.records.give_up(req_id, unmade, "abort")
        if self.speculation is not None:
            self.speculation.finish(self.scheduler.running)  # a draft model's slots of these freed
        self.stats.aborted_requests += 1
        return True

    def preempt_one(self) -> bool:  # between steps; False when nothing runs
        return self.scheduler.preempt_one()

    def stop(self, req_id: str, index: int = 0) -> bool:
        """Finish sequence ``index`` of ``req_id`` now with the finish reason ``"stop"`` (a
        server matched a stop string in its text): freed as :meth:`abort` frees; the
        request's other sequences run on. False if it had finished already; ``KeyError`` /
        ``ValueError`` for an unknown request or an index whose sequence is not made yet."""
        self.records.reasons(req_id)
        seq = self.records.seqs[req_id].get(index)
        if seq is None:
            raise ValueError(f"request {req_id!r} has no sequence {index} (yet)")
        if seq.status is Status.FINISHED:
            return False
        self._drop(seq, "stop")
        if self.speculation is not None:
            self.speculation.finish(self.scheduler.running)
        return True

    def serve(self, requests: list[Request], arrivals_s: list[float]) -> dict:
        """Open loop: request ``i`` is added ``arrivals_s[i]`` seconds (wall clock) after the
        start, whether or not earlier ones finished; steps run while anything is queued and
        the engine sleeps until the next arrival when nothing is. Returns the outputs."""
        if len(arrivals_s) != len(requests) or sorted(arrivals_s) != list(arrivals_s):
            raise ValueError("arrivals_s must be one sorted time per request")
        t0 = time.perf_counter()
        i = 0
        while i < len(requests) or self.scheduler.has_work():
            now = time.perf_counter() - t0
            while i < len(requests) and arrivals_s[i] <= now:
                self.add_request(requests[i], t0 + arrivals_s[i])
                i += 1
            if not self.scheduler.has_work():
                time.sleep(max(arrivals_s[i] - now, 0))
                continue
            self.step()
        self.stats.elapsed_s += time.perf_counter() - t0
        return {rid: out for rid, out in self.outputs.items()}

    def latency_records(self) -> list[tuple[float, float, float, int]]:
        """(arrival, first token, finish, tokens per sequence) of every finished request."""
        return [(a, f, e, len(self.outputs[rid][0])) for rid, (a, f, e) in self.times.items()
                if e is not None]  # fmt: skip

    def run(self, requests: list[Request] = ()) -> dict[str, list[list[int]]]:
        """Add ``requests``, step until every queued request finished; returns the outputs."""
        for r in requests:
            self.add_request(r)
        t0 = time.perf_counter()
        while self.scheduler.has_work():
            self.step()
        if self.speculation is not None:
            self.speculation.finish(self.scheduler.running)  # a draft model's slots
        self.stats.elapsed_s += time.perf_counter() - t0
        return {rid: out for rid, out in self.outputs.items()}
