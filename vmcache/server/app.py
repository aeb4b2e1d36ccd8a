"""The HTTP layer (Starlette, served by uvicorn): OpenAI's completions and chat completions,
streamed as server-sent events or answered whole, plus health, models and metrics.

    POST /v1/completions        POST /v1/chat/completions       GET /v1/models
    GET  /health                GET  /metrics                   GET /v1/models/{id}

Every request is bounded: its body (``max_body_bytes``), its fields (:mod:`.protocol`), its
wait (``request_timeout_s``). A client that goes away is noticed when its connection closes,
streaming or not (ASGI's ``http.disconnect``, watched while the request runs), and its request
is aborted at the engine's next step boundary, pages freed. Errors are OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from vmcache.models import chat_ids
from vmcache.server import protocol
from vmcache.server.loop import Delta, Done, EngineLoop, Failed, with_max_tokens
from vmcache.server.metrics import Metrics
from vmcache.server.protocol import APIError, Limits, check_model

PING_S = 1.0  # a stream's keep-alive: how soon a vanished client is noticed while waiting


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


GONE = object()  # a subscription's event: the client disconnected (its request aborted)


class _Subscription:
    """The events of one request, handed from the engine thread to this event loop."""

    def __init__(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def watch(self, request: Request, abort) -> None:
        """Until cancelled: when the client disconnects, ``abort()`` (unless the request
        finished) and :data:`GONE` to the reader. The body is read by now, so the next ASGI
        message is the disconnect: no polling, nothing runs past the step it happened in."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            abort()
            self._queue.put_nowait(GONE)

    def sink(self, event) -> None:  # called on the engine thread
        try:
            self._aloop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    async def next(self, deadline: float):
        """The next event; None after ``PING_S`` without one (time to ping, or to look at
        the client); ``TimeoutError`` past ``deadline`` (``time.monotonic()``)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            return await asyncio.wait_for(self._queue.get(), min(PING_S, left))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
            return None


class _Stream(StreamingResponse):
    """A streaming response that aborts its request however it ends early (the client gone,
    the task cancelled, a write failed)."""

    def __init__(self, body, on_close) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Server:
    """The app's state: the engine loop, the served model's name and limits, settings."""

    def __init__(self, loop: EngineLoop, model_name: str, *, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, request_timeout_s: float = 600.0,
                 metrics: Metrics | None = None) -> None:  # fmt: skip
        self.loop, self.api_key = loop, api_key
        self.max_body_bytes, self.request_timeout_s = max_body_bytes, request_timeout_s
        kv = loop.engine.kv
        self.limits = Limits(model_name, kv.config.max_seq_len, kv.config.max_seqs)
        self.metrics = metrics
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/models/{model_id:path}", self.model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/metrics", self.render_metrics)]  # fmt: skip
        handlers = {HTTPException: self._http_error, Exception: self._internal_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    # --- errors and guards ---------------------------------------------------------------
    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(APIError(exc.status_code, str(exc.detail), code=code))

    async def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        return _error(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        want = f"Bearer {self.api_key}"
        if not hmac.compare_digest(given.encode(), want.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    async def _body(self, request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) >
                                     self.max_body_bytes):  # fmt: skip
            raise APIError(413, f"the request body exceeds {self.max_body_bytes} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise APIError(413, f"the request body exceeds {self.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    # --- routes --------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            return _error(APIError(503, "the engine is not running", type="server_error"))
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``): the served
        model's card, or OpenAI's 404 for any other id."""
        try:
            self._authorize(request)
            check_model(request.path_params["model_id"], self.limits)
        except APIError as e:
            return _error(e)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.limits.model, "object": "model", "created": self.created,
                "owned_by": "vmcache", "max_model_len": self.limits.max_seq_len}  # fmt: skip

    async def render_metrics(self, request: Request) -> Response:
        if self.metrics is None:
            return _error(APIError(404, "metrics are off", code="not_found"))
        body = await asyncio.to_thread(self.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    def _tokenize(self, job: protocol.Job) -> list[int]:
        tok = self.loop.tokenizer
        with self.loop.tokenizer_lock:
            if job.kind == "chat":
                try:
                    return chat_ids(tok, list(job.messages))
                except ValueError as e:  # no chat template
                    raise APIError(400, str(e), param="messages") from None
            if job.prompt is not None:
                return list(job.prompt)
            return [int(t) for t in tok(job.text, add_special_tokens=False)["input_ids"]]

    async def _generate(self, request: Request, kind: str) -> Response:
        sub = _Subscription()
        try:
            self._authorize(request)
            job = protocol.parse(await self._body(request), kind, self.limits)
            prompt = await asyncio.to_thread(self._tokenize, job)
            params = with_max_tokens(job.params, job.max_tokens, len(prompt),
                                     self.limits.max_seq_len)  # fmt: skip
            rid = self.loop.submit(prompt, params, job.stops, sub.sink)
        except APIError as e:
            return _error(e)
        name = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        created = protocol.now_s()
        if job.stream:  # Starlette's stream watches the disconnect and cancels the body
            return _Stream(self._events(job, sub, name, created, params.n),
                           lambda: None if sub.finished else self.loop.abort(rid))  # fmt: skip
        watch = asyncio.create_task(sub.watch(request, lambda: self.loop.abort(rid)))
        try:
            return await self._whole(job, sub, rid, name, created, params.n)
        finally:
            watch.cancel()

    async def _events(self, job, sub: _Subscription, name: str, created: int, n: int):
        model, kind = self.limits.model, job.kind
        if kind == "chat":  # the role first, as OpenAI streams it
            first = [protocol.choice(kind, i, "", None, delta=True, first=True) for i in range(n)]
            yield _sse(protocol.envelope(kind, name, model, created, first, chunk=True))
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                ev = await sub.next(deadline)
            except TimeoutError:
                yield _sse(APIError(504, "the request timed out", type="server_error").body())
                return
            if ev is None:
                yield ": ping\n\n"  # noticed by a write if the client is gone
            elif isinstance(ev, Delta):
                ch = protocol.choice(kind, ev.index, ev.text, ev.finish_reason, delta=True)
                yield _sse(protocol.envelope(kind, name, model, created, [ch], chunk=True))
            elif isinstance(ev, Done):
                sub.finished = True
                if job.include_usage:
                    u = protocol.usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                    yield _sse(protocol.envelope(kind, name, model, created, [], chunk=True,
                                                 usage_=u))  # fmt: skip
                yield "data: [DONE]\n\n"
                return
            else:  # Failed
                sub.finished = True
                yield _sse(ev.error.body())
                return

    async def _whole(self, job, sub, rid, name, created, n) -> Response:
        texts, reasons = [""] * n, [None] * n
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                ev = await sub.next(deadline)
            except TimeoutError:
                self.loop.abort(rid)
                return _error(APIError(504, "the request timed out", type="server_error"))
            if ev is GONE:  # nobody reads an answer: the request is aborted already
                return _error(APIError(499, "the client closed the request"))
            if ev is None:
                continue
            if isinstance(ev, Delta):
                texts[ev.index] += ev.text
                reasons[ev.index] = ev.finish_reason or reasons[ev.index]
            elif isinstance(ev, Failed):
                return _error(ev.error)
            else:
                u = protocol.usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                choices = [protocol.choice(job.kind, i, texts[i], reasons[i], delta=False)
                           for i in range(n)]  # fmt: skip
                return JSONResponse(
                    protocol.envelope(
                        job.kind, name, self.limits.model, created, choices, chunk=False, usage_=u
                    )
                )
