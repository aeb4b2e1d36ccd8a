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
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from vmcache.models import chat_ids
from vmcache.server import protocol
from vmcache.server.choices import Choices
from vmcache.server.loop import Delta, Done, EngineLoop, Failed, with_max_tokens
from vmcache.server.metrics import Metrics
from vmcache.server.protocol import APIError, Limits, check_model

PING_S = 1.0  # a stream's keep-alive: how soon a vanished client is noticed while waiting


def _error(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None  # RFC 6750
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


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
                 metrics: Metrics | None = None,
                 cors_origins: tuple[str, ...] = ()) -> None:  # fmt: skip
        """``cors_origins``: the browser origins allowed to call (CORS; none by default,
        ``"*"`` only when named)."""
        self.loop, self.api_key = loop, api_key
        self.cors_origins = tuple(cors_origins)
        self.max_body_bytes, self.request_timeout_s = max_body_bytes, request_timeout_s
        kv = loop.engine.kv
        self.limits = Limits(model_name, kv.config.max_seq_len, kv.config.max_seqs,
                             loop.engine.vocab)  # fmt: skip
        self.metrics = metrics
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/models/{model_id:path}", self.model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/metrics", self.render_metrics)]  # fmt: skip
        handlers = {HTTPException: self._http_error, Exception: self._internal_error}
        middleware = []
        if self.cors_origins:
            cors = dict(allow_origins=list(self.cors_origins), allow_methods=["GET", "POST"],
                        allow_headers=["Authorization", "Content-Type"], max_age=600)  # fmt: skip
            middleware.append(Middleware(CORSMiddleware, **cors))
        return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)

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
            # OpenAI's own 401 body (type invalid_request_error, code invalid_api_key)
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

    def _tokenize(self, job: protocol.Job) -> list[tuple[list[int], str]]:
        """Each prompt's token ids, and its text when the request echoes it."""
        tok = self.loop.tokenizer
        with self.loop.tokenizer_lock:
            if job.kind == "chat":
                try:
                    return [(chat_ids(tok, list(job.messages)), "")]
                except ValueError as e:  # no chat template
                    raise APIError(400, str(e), param="messages") from None
            out = []
            for p in job.prompts:
                if isinstance(p, str):
                    ids = [int(t) for t in tok(p, add_special_tokens=False)["input_ids"]]
                    if not ids:
                        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
                    out.append((ids, p))
                else:
                    out.append((list(p), tok.decode(list(p)) if job.echo else ""))
            return out

    def _submit(self, job: protocol.Job, prompts, sub: _Subscription) -> list[str]:
        """Every prompt queued as an engine request (events tagged with the prompt's place);
        all or none: a refusal aborts those queued before it."""
        silent = job.echo and job.max_tokens == 0  # the prompt's log-probabilities only
        rids: list[str] = []
        try:
            for k, (ids, _) in enumerate(prompts):
                params = with_max_tokens(job.params, job.max_tokens or (1 if silent else None),
                                         len(ids), self.limits.max_seq_len)  # fmt: skip
                sink = lambda ev, k=k: sub.sink((k, ev))  # noqa: E731
                rids.append(self.loop.submit(ids, params, job.stops, sink, silent))
        except APIError:
            for rid in rids:
                self.loop.abort(rid)
            raise
        return rids

    async def _generate(self, request: Request, kind: str) -> Response:
        sub = _Subscription()
        try:
            self._authorize(request)
            self._check_content_type(request)
            job = protocol.parse(await self._body(request), kind, self.limits)
            prompts = await asyncio.to_thread(self._tokenize, job)
            rids = self._submit(job, prompts, sub)
        except APIError as e:
            return _error(e)
        abort = lambda: [self.loop.abort(rid) for rid in rids]  # noqa: E731
        choices = Choices(job, [len(ids) for ids, _ in prompts], [t for _, t in prompts])
        name = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        created = protocol.now_s()
        if job.stream:  # Starlette's stream watches the disconnect and cancels the body
            return _Stream(self._events(job, sub, choices, name, created, abort),
                           lambda: None if sub.finished else abort())  # fmt: skip
        watch = asyncio.create_task(sub.watch(request, abort))
        try:
            return await self._whole(job, sub, choices, name, created, abort)
        finally:
            watch.cancel()

    def _check_content_type(self, request: Request) -> None:
        """A body sent as anything but JSON (a form, text) is refused, as OpenAI's API does;
        a request without a content type is read as JSON."""
        ctype = request.headers.get("content-type")
        if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the request body must be application/json, got {ctype!r}",
                           code="unsupported_media_type")  # fmt: skip

    async def _events(self, job, sub, choices: Choices, name, created, abort):
        model, kind = self.limits.model, job.kind
        chunk = lambda chs, **kw: _sse(protocol.envelope(kind, name, model, created, chs,  # noqa: E731
                                                         chunk=True, **kw))  # fmt: skip
        if kind == "chat":  # the role first, as OpenAI streams it: one chunk per choice
            for i in choices.indices:
                yield chunk([protocol.choice(kind, i, "", None, delta=True, first=True)])
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                ev = await sub.next(deadline)
            except TimeoutError:
                abort()
                yield _sse(APIError(504, "the request timed out", type="server_error").body())
                return
            if ev is None:
                yield ": ping\n\n"  # noticed by a write if the client is gone
                continue
            k, ev = ev
            if isinstance(ev, Delta):
                ch = choices.delta(k, ev)
                extra = {"usage_": choices.usage(so_far=True)} if job.continuous_usage else {}
                yield chunk([ch], **extra)
            elif isinstance(ev, Done):
                if not choices.done(ev):
                    continue
                sub.finished = True
                if job.include_usage:
                    yield chunk([], usage_=choices.usage())
                yield "data: [DONE]\n\n"
                return
            else:  # Failed: the request's other prompts are dropped with it
                sub.finished = True
                abort()
                yield _sse(ev.error.body())
                return

    async def _whole(self, job, sub, choices: Choices, name, created, abort) -> Response:
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                ev = await sub.next(deadline)
            except TimeoutError:
                abort()
                return _error(APIError(504, "the request timed out", type="server_error"))
            if ev is GONE:  # nobody reads an answer: the request is aborted already
                return _error(APIError(499, "the client closed the request"))
            if ev is None:
                continue
            k, ev = ev
            if isinstance(ev, Delta):
                choices.delta(k, ev)
            elif isinstance(ev, Failed):
                abort()
                return _error(ev.error)
            elif choices.done(ev):
                body = protocol.envelope(
                    job.kind,
                    name,
                    self.limits.model,
                    created,
                    choices.whole(),
                    chunk=False,
                    usage_=choices.usage(),
                )
                return JSONResponse(body)  # fmt: skip
