"""One thread owns the engine: requests come in through :meth:`EngineLoop.submit`, text goes
out through each request's sink, aborts and queries are answered between steps.

    HTTP handlers ──submit / abort / query──▶ inbox ──▶ engine thread
                                                          │ admit, step, detokenize,
                  ◀──── sink(Delta | Done | Failed) ──────┘ match stop strings, release

The engine is never touched from another thread (it is not thread-safe): everything goes
through the inbox. It steps while any request is queued and blocks on the inbox otherwise.
A sequence that hits a stop string is stopped before the next step; a finished request is
released from the engine so a long-running server's memory stays flat. A step that raises
fails the requests in flight (each gets :class:`Failed`, their pages freed) and the loop
goes on: one request never takes the server down.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from vmcache.engine.request import Request, Status
from vmcache.server.observe import Finished, Observer
from vmcache.server.protocol import APIError, Logprob, Stopped
from vmcache.server.text import Detokenizer, StopMatcher


@dataclass(frozen=True)
class Delta:
    index: int  # which of the request's n sequences
    text: str  # new text (may be empty on the chunk that carries finish_reason)
    finish_reason: str | None  # "stop" / "length" on its last delta, else None
    tokens: int = 0  # generated tokens this delta covers (text held back included)
    logprobs: tuple[Logprob, ...] | None = None  # of those tokens, if the request asked
    # the prompt's reports (the first token's logprob None), on a sequence's first delta
    # when the request echoes its prompt with log-probabilities
    prompt_logprobs: tuple[Logprob, ...] | None = None
    stopped: Stopped | None = None  # what stopped it, on a "stop" delta


@dataclass(frozen=True)
class Done:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Failed:
    error: APIError


Event = Delta | Done | Failed


@dataclass(eq=False)
class _Live:
    """A request the loop is serving (loop thread only)."""

    req: Request
    sink: Callable[[Event], None]
    detok: list[Detokenizer]
    stops: StopMatcher
    seen: list[int]  # tokens taken from the engine, per sequence
    text: list[str]  # text so far, per sequence
    sent: list[int]  # characters of text already sent
    finish: list[str | None]
    silent: bool = False  # nothing generated is shown (an echo with max_tokens 0)
    token_ids: bool = False  # reports name tokens "token_id:N"
    reported: list[int] = field(default_factory=list)  # tokens whose Logprob was sent
    echoed: list[bool] = field(default_factory=list)  # prompt reports sent, per sequence
    arrival_s: float = field(default_factory=time.perf_counter)
    scheduled_s: float | None = None  # the start of the first step it ran in
    token_s: list[float] = field(default_factory=list)  # its first sequence's tokens' times


class InProgress(RuntimeError):
    """A call :meth:`EngineLoop.query` ran past its deadline after it had begun: it goes on
    and takes effect (unlike a ``TimeoutError``, which means it never ran)."""


class EngineLoop:
    def __init__(self, engine, tokenizer, *, max_waiting: int = 256, idle_s: float = 0.05,
                 observer: Observer | None = None, state_every_s: float = 0.25,
                 keeper=None, threads: int | None = None) -> None:  # fmt: skip
        """``max_waiting``: sequences that may wait beyond the ``max_seqs`` the cache runs;
        a request past that is refused at once (429). ``keeper``: the model's share of a
        shared KV budget (:class:`vmcache.server.keeper.Keeper`), ticked between steps and
        asked to wake the model before a request is added. ``threads``: torch's intra-op
        threads on the loop's thread (None: as the thread finds them)."""
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):  # fmt: skip
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        self.keeper, self.threads = keeper, threads
        self.engine, self.tokenizer = engine, tokenizer
        self.max_waiting, self.idle_s, self.state_every_s = max_waiting, idle_s, state_every_s
        self._observed_s = -float("inf")  # when the observer last saw the engine (loop thread)
        self.observer = observer or Observer()
        self.tokenizer_lock = threading.Lock()  # HTTP threads encode, this thread decodes
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # owned by the loop thread
        self._lock = threading.Lock()
        self._outstanding = 0  # sequences submitted and not finished; under _lock
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vmcache-engine", daemon=True)
        self.failures = 0  # steps that raised (loop thread writes)
        self._counted = 0  # the engine's prompt + generated tokens already reported (loop)

    # --- any thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._closing.set()
        self._inbox.put(("wake",))
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)

    @property
    def stopped(self) -> bool:
        """Whether the loop thread has ended or never started (nothing touches the engine)."""
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing.is_set()

    def submit(self, prompt: list[int], params, stops: tuple[str, ...],
               sink: Callable[[Event], None], silent: bool = False,
               token_ids: bool = False) -> str:  # fmt: skip
        """Queue a request; returns its id. :class:`APIError` (nothing queued) when the
        engine would refuse it (400) or the queue is full (429). Its deltas carry the
        generated tokens' log-probabilities when ``params.logprobs`` is set, and a sequence's
        first delta the prompt's when ``params.prompt_logprobs`` is; ``silent``: no generated
        text at all, only each sequence's end (an echo with ``max_tokens`` 0)."""
        if not self.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        req = Request(f"req-{uuid.uuid4().hex}", tuple(prompt), params)
        try:
            self.engine.check_request(req)  # reads configuration only
        except (TypeError, ValueError) as e:  # the protocol checked all but the length
            raise APIError(400, str(e), param="max_tokens",
                           code="context_length_exceeded") from None  # fmt: skip
        with self._lock:
            if self._outstanding + params.n > self.engine.kv.config.max_seqs + self.max_waiting:
                raise APIError(429, "the server is at its queue limit; retry later",
                               type="server_overloaded", code="queue_full")  # fmt: skip
            self._outstanding += params.n
        n = params.n
        live = _Live(req, sink, [Detokenizer(self.tokenizer, prompt) for _ in range(n)],
                     StopMatcher(stops), [0] * n, [""] * n, [0] * n, [None] * n, silent,
                     token_ids, [0] * n, [False] * n)  # fmt: skip
        self._inbox.put(("add", live))
        return req.req_id

    def abort(self, req_id: str) -> None:
        """Drop ``req_id`` at the next step boundary (its pages freed); no-op once finished."""
        self._inbox.put(("abort", req_id))

    def query(self, fn: Callable, timeout_s: float = 5.0):
        """``fn(engine)`` run on the loop thread between steps; its result. ``TimeoutError``
        when the loop has not begun it within ``timeout_s``: it is cancelled then, never run
        later; once begun, its outcome is awaited another ``timeout_s``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if fut.cancel():  # not begun: it never runs (a timed-out sleep does not sleep)
                raise TimeoutError(f"the engine thread did not take it within {timeout_s} s; "
                                   "it was cancelled") from None  # fmt: skip
        # begun on the loop thread: its outcome is the answer, whatever it is
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise InProgress(f"begun on the engine thread, not done within {2 * timeout_s} s; "
                             "it goes on") from None  # fmt: skip

    # --- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)  # this thread's OpenMP team, first made here
        while not self._closing.is_set():
            self._drain(block=not engine.scheduler.has_work())
            if self.keeper is not None:
                try:
                    self.keeper.tick(engine, engine.scheduler.has_work())
                except Exception:  # a ledger that cannot be read now: the next tick retries
                    self.failures += 1
            if time.perf_counter() - self._observed_s >= self.state_every_s:
                self.observer.engine_state(engine)
                self._observed_s = time.perf_counter()
            if not engine.scheduler.has_work():
                continue
            try:
                started = time.perf_counter()
                engine.step()
                st = engine.stats
                done = st.prefill_tokens + st.generated_tokens
                self.observer.step_finished(done - self._counted)
                self._counted = done
                self._publish(started)
            except Exception as e:  # a failed step fails what is in flight, not the server
                self.failures += 1
                self._fail_all(APIError(500, f"the engine failed: {type(e).__name__}: {e}",
                                        type="server_error"))  # fmt: skip
        self._fail_all(APIError(503, "the server is shutting down", type="server_error"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self.idle_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            live = cmd[1]
            try:
                if self.keeper is not None:
                    self.keeper.admit(self.engine)  # wakes a sleeping model
            except Exception as e:
                self._forget(live, None)
                live.sink(Failed(APIError(503, f"the model could not wake: {e}",
                                          type="server_error")))  # fmt: skip
                return
            try:
                self.engine.add_request(live.req, live.arrival_s)
            except (TypeError, ValueError) as e:
                self._forget(live, None)
                live.sink(Failed(APIError(400, str(e))))
                return
            self._live[live.req.req_id] = live
        elif kind == "abort":
            live = self._live.get(cmd[1])
            if live is not None:
                self.engine.abort(live.req.req_id)
                self._end(live, "abort")
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            if not fut.set_running_or_notify_cancel():
                return  # its caller timed out and cancelled it
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _publish(self, started_s: float) -> None:
        """After a step (begun at ``started_s``): every live request's new text to its sink;
        stop strings applied; finished requests released."""
        engine = self.engine
        for rid, live in list(self._live.items()):
            if live.scheduled_s is None and any(
                s.status is not Status.WAITING for s in engine.records.seqs[rid].values()
            ):
                live.scheduled_s = started_s  # fmt: skip
            new = engine.records.new_tokens(rid, live.seen)
            reasons = engine.finish_reasons[rid]
            for i, toks in enumerate(new):
                if live.finish[i] is None and (toks or reasons[i] is not None):
                    self._advance(live, i, toks, reasons[i])
            if all(f is not None for f in live.finish):
                self._end(live, live.finish[0])

    def _advance(self, live: _Live, i: int, toks: list[int], reason: str | None) -> None:
        live.seen[i] += len(toks)
        if i == 0 and toks:
            live.token_s += [time.perf_counter()] * len(toks)
        if live.silent:  # nothing generated is shown: only the end is reported
            if reason is not None:
                live.finish[i] = reason
                live.sink(Delta(i, "", reason, 0, None, self._echo(live, i)))
            return
        with self.tokenizer_lock:
            piece = live.detok[i].push(toks, final=reason is not None)
        start = len(live.text[i])
        text = live.text[i] = live.text[i] + piece
        hit = live.stops.find(text, start)
        stopped = None
        if hit is not None:
            matched = live.stops.which(text, hit)
            text = live.text[i] = text[:hit]
            if reason is None:
                self.engine.stop(live.req.req_id, i)
            reason, stopped = "stop", Stopped(matched, matched)
        elif reason == "stop":  # a stop token id, or the model's end of sequence
            stopped = self._stopped_by_token(live, i)
        upto = len(text) if reason is not None else live.stops.safe(text)
        delta, live.sent[i] = text[live.sent[i] : upto], max(live.sent[i], upto)
        live.finish[i] = reason
        if delta or reason is not None:
            covered, live.reported[i] = live.seen[i] - live.reported[i], live.seen[i]
            live.sink(Delta(i, delta, reason, covered, self._reports(live, i, covered),
                            self._echo(live, i), stopped))  # fmt: skip

    def _stopped_by_token(self, live: _Live, i: int) -> Stopped | None:
        """What stopped sequence ``i`` at a token: one of the request's stop ids (vLLM's
        stop_reason), else the model's end of sequence (no stop_reason; SGLang's
        matched_stop is the id)."""
        out = self.engine.outputs.get(live.req.req_id)
        tokens = out[i] if out is not None else None
        if not tokens:
            return None
        last = tokens[-1]
        return Stopped(last if last in live.req.params.stop_token_ids else None, last)

    def _reports(self, live: _Live, i: int, count: int) -> tuple[Logprob, ...] | None:
        """The Logprob of sequence ``i``'s last ``count`` generated tokens (if asked)."""
        if live.req.params.logprobs is None:
            return None
        seen, rid = live.seen[i], live.req.req_id
        return self._wire(self.engine.records.logprobs(rid, i, seen - count, seen),
                          live.token_ids)  # fmt: skip

    def _echo(self, live: _Live, i: int) -> tuple[Logprob, ...] | None:
        """The prompt's reports, once per sequence (if the request echoes them)."""
        if live.req.params.prompt_logprobs is None or live.echoed[i]:
            return None
        live.echoed[i] = True
        reports = self.engine.records.prompt_logprobs(live.req.req_id)
        with self.tokenizer_lock:
            head = (f"token_id:{live.req.prompt[0]}" if live.token_ids
                    else self.tokenizer.decode([live.req.prompt[0]]))  # fmt: skip
        return (Logprob(head, None, ()), *self._wire(reports[1:], live.token_ids))

    def _wire(self, reports: list, token_ids: bool = False) -> tuple[Logprob, ...]:
        """Engine reports (token ids) as text: every token decoded alone, or named
        ``token_id:N`` (``token_ids``: vLLM's ``return_tokens_as_token_ids``)."""
        with self.tokenizer_lock:
            text = ((lambda ids: f"token_id:{ids[0]}") if token_ids
                    else self.tokenizer.decode)  # fmt: skip
            return tuple(Logprob(text([r.token]), r.logprob,
                                 tuple((text([t]), lp) for t, lp in r.top))
                         for r in reports)  # fmt: skip

    def _end(self, live: _Live, reason: str | None) -> None:
        """A request is done (finished, aborted or failed): usage to its sink, released."""
        rid = live.req.req_id
        generated = 0 if live.silent else sum(live.seen)
        done = Done(len(live.req.prompt), generated, self.engine.records.prefix_hit(rid))
        self._forget(live, rid)
        # observed before the client hears: a scrape after the answer sees the request
        self.observer.request_finished(self._record(live, done.completion_tokens, reason))
        if reason != "abort":
            live.sink(done)

    def _record(self, live: _Live, generated: int, reason: str | None) -> Finished:
        p = live.req.params
        return Finished(len(live.req.prompt), generated, reason or "error", p.n,
                        p.max_new_tokens, live.arrival_s, live.scheduled_s,
                        time.perf_counter(), tuple(live.token_s))  # fmt: skip

    def _forget(self, live: _Live, rid: str | None) -> None:
        if rid is not None:
            self._live.pop(rid, None)
            self.engine.records.release(rid)
        with self._lock:
            self._outstanding -= live.req.params.n

    def _fail_all(self, error: APIError) -> None:
        for live in list(self._live.values()):
            try:
                self.engine.abort(live.req.req_id)
            except Exception:  # the engine's state may be what failed: drop it regardless
                pass
            self._live.pop(live.req.req_id, None)
            try:
                self.engine.records.release(live.req.req_id)
            except Exception:
                pass
            with self._lock:
                self._outstanding -= live.req.params.n
            live.sink(Failed(error))
            self.observer.request_finished(self._record(live, sum(live.seen), "error"))


def with_max_tokens(params, max_tokens: int | None, prompt_len: int, max_seq_len: int):
    """``params`` with ``max_new_tokens`` = the request's ``max_tokens``, or what the
    context leaves after the prompt when it gave none (chat's default)."""
    room = max_seq_len - prompt_len
    if max_tokens is None:
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the context holds "
                           f"{max_seq_len}", param="messages",
                           code="context_length_exceeded")  # fmt: skip
        max_tokens = room
    return dataclasses.replace(params, max_new_tokens=max_tokens)
