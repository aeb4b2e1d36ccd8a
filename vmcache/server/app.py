"""The HTTP layer (Starlette, served by uvicorn): OpenAI's completions and chat completions,
streamed as server-sent events or answered whole, plus health, models and metrics, for one
model or several (a request picks one by its ``model`` field; each has its own engine loop).

    POST /v1/completions        POST /v1/chat/completions       GET /v1/models
    GET  /health                GET  /metrics                   GET /v1/models/{id}
    POST /sleep?model=M&level=1 POST /wake_up?model=M           GET /is_sleeping?model=M

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
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vmcache.models import chat_ids
from vmcache.server import protocol
from vmcache.server.choices import Choices
from vmcache.server.keeper import Keeper
from vmcache.server.loop import Delta, Done, EngineLoop, Failed, with_max_tokens
from vmcache.server.metrics import Metrics
from vmcache.server.protocol import APIError, Limits
from vmcache.server.served import Served
from vmcache.server.streams import GONE, Stream, Subscription, error_response, sse


class Server:
    """The app's state: the served models (each an engine loop, a name, limits), settings."""

    def __init__(self, models: EngineLoop | list[Served], model_name: str | None = None, *,
                 api_key: str | None = None, max_body_bytes: int = 1 << 20,
                 request_timeout_s: float = 600.0, metrics: Metrics | None = None,
                 cors_origins: tuple[str, ...] = (), ledger=None) -> None:  # fmt: skip
        """``models``: the served models, or one engine loop served as ``model_name``.
        ``cors_origins``: the browser origins allowed to call (CORS; none by default,
        ``"*"`` only when named)."""
        if isinstance(models, EngineLoop):
            models = [Served(model_name, models, Keeper(None, 0))]
        if not models or len({m.name for m in models}) != len(models):
            raise ValueError(f"give one or more models with distinct names, got "
                             f"{[m.name for m in models]}")  # fmt: skip
        self.models = {m.name: m for m in models}
        self.api_key = api_key
        self.cors_origins = tuple(cors_origins)
        self.max_body_bytes, self.request_timeout_s = max_body_bytes, request_timeout_s
        self.metrics = metrics
        self.ledger = ledger  # the models' shared KV budget (vmcache.server.fleet.Ledger)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every model's engine loop and give its memory and budget back."""
        for m in self.models.values():
            m.close(timeout_s)
        if self.ledger is not None:
            self.ledger.close()

    @property
    def loop(self) -> EngineLoop:
        """The first model's engine loop (the only one of a single-model server)."""
        return next(iter(self.models.values())).loop

    @property
    def limits(self) -> Limits:
        return next(iter(self.models.values())).limits

    def served(self, name) -> Served:
        """The model called ``name``, or OpenAI's 404 ``model_not_found``."""
        m = self.models.get(name) if isinstance(name, str) else None
        if m is None:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.models)}", param="model",
                           code="model_not_found")  # fmt: skip
        return m

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/v1/models", self.list_models),
                  Route("/v1/models/{model_id:path}", self.retrieve_model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/metrics", self.render_metrics),
                  Route("/sleep", self.sleep, methods=["POST"]),
                  Route("/wake_up", self.wake_up, methods=["POST"]),
                  Route("/is_sleeping", self.is_sleeping)]  # fmt: skip
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
        return error_response(APIError(exc.status_code, str(exc.detail), code=code))

    async def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
        )

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
        if not all(m.loop.alive for m in self.models.values()):
            return error_response(APIError(503, "the engine is not running", type="server_error"))
        return JSONResponse({"status": "ok"})

    async def list_models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [m.card() for m in self.models.values()]})

    async def retrieve_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``): the served
        model's card, or OpenAI's 404 for any other id."""
        try:
            self._authorize(request)
            served = self.served(request.path_params["model_id"])
        except APIError as e:
            return error_response(e)
        return JSONResponse(served.card())

    # --- sleep and wake (vLLM's endpoints, plus the model) --------------------------------
    def _model_param(self, request: Request) -> Served:
        self._authorize(request)
        name = request.query_params.get("model")
        if name is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        if name is None:
            raise APIError(400, "'model' is required: this server serves several", param="model")
        return self.served(name)

    async def sleep(self, request: Request) -> Response:
        try:
            served = self._model_param(request)
            level = request.query_params.get("level", "1")
            if level not in ("1", "2"):
                raise APIError(400, f"'level' must be 1 or 2, got {level!r}", param="level")
            freed = await asyncio.to_thread(served.sleep, int(level))
        except APIError as e:
            return error_response(e)
        return JSONResponse({"model": served.name, "is_sleeping": True, "freed_bytes": freed})

    async def wake_up(self, request: Request) -> Response:
        try:
            served = self._model_param(request)
            await asyncio.to_thread(served.wake)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"model": served.name, "is_sleeping": False})

    async def is_sleeping(self, request: Request) -> Response:
        try:
            served = self._model_param(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"is_sleeping": served.is_sleeping})

    async def render_metrics(self, request: Request) -> Response:
        if self.metrics is None:
            return error_response(APIError(404, "metrics are off", code="not_found"))
        body = await asyncio.to_thread(self.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    def _tokenize(self, job: protocol.Job, loop: EngineLoop) -> list[tuple[list[int], str]]:
        """Each prompt's token ids, and its text when the request echoes it."""
        tok = loop.tokenizer
        with loop.tokenizer_lock:
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

    def _submit(self, job: protocol.Job, prompts, sub: Subscription, served: Served) -> list[str]:
        """Every prompt queued as an engine request (events tagged with the prompt's place);
        all or none: a refusal aborts those queued before it."""
        silent = job.echo and job.max_tokens == 0  # the prompt's log-probabilities only
        rids: list[str] = []
        loop, max_seq_len = served.loop, served.limits.max_seq_len
        try:
            for k, (ids, _) in enumerate(prompts):
                params = with_max_tokens(job.params, job.max_tokens or (1 if silent else None),
                                         len(ids), max_seq_len)  # fmt: skip
                sink = lambda ev, k=k: sub.sink((k, ev))  # noqa: E731
                rids.append(loop.submit(ids, params, job.stops, sink, silent, job.token_ids))
        except APIError:
            for rid in rids:
                loop.abort(rid)
            raise
        return rids

    async def _generate(self, request: Request, kind: str) -> Response:
        sub = Subscription()
        try:
            self._authorize(request)
            self._check_content_type(request)
            body = await self._body(request)
            served = self._route(body)
            job = protocol.parse(body, kind, served.limits)
            prompts = await asyncio.to_thread(self._tokenize, job, served.loop)
            rids = self._submit(job, prompts, sub, served)
        except APIError as e:
            return error_response(e)
        abort = lambda: [served.loop.abort(rid) for rid in rids]  # noqa: E731
        choices = Choices(job, [len(ids) for ids, _ in prompts], [t for _, t in prompts])
        name = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        created = protocol.now_s()
        if job.stream:  # Starlette's stream watches the disconnect and cancels the body
            return Stream(self._events(job, sub, choices, name, created, abort, served.name),
                           lambda: None if sub.finished else abort())  # fmt: skip
        watch = asyncio.create_task(sub.watch(request, abort))
        try:
            return await self._whole(job, sub, choices, name, created, abort, served.name)
        finally:
            watch.cancel()

    def _check_content_type(self, request: Request) -> None:
        """A body sent as anything but JSON (a form, text) is refused, as OpenAI's API does;
        a request without a content type is read as JSON."""
        ctype = request.headers.get("content-type")
        if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the request body must be application/json, got {ctype!r}",
                           code="unsupported_media_type")  # fmt: skip

    def _route(self, body) -> Served:
        """The model a request body names (a body without a string ``model`` goes to the
        first, whose parse names the missing field)."""
        name = body.get("model") if isinstance(body, dict) else None
        return self.served(name) if isinstance(name, str) else next(iter(self.models.values()))

    async def _events(self, job, sub, choices: Choices, name, created, abort, model: str):
        kind = job.kind
        chunk = lambda chs, **kw: sse(protocol.envelope(kind, name, model, created, chs,  # noqa: E731
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
                yield sse(APIError(504, "the request timed out", type="server_error").body())
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
                yield sse(ev.error.body())
                return

    async def _whole(self, job, sub, choices: Choices, name, created, abort,
                     model: str) -> Response:  # fmt: skip
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                ev = await sub.next(deadline)
            except TimeoutError:
                abort()
                return error_response(APIError(504, "the request timed out", type="server_error"))
            if ev is GONE:  # nobody reads an answer: the request is aborted already
                return error_response(APIError(499, "the client closed the request"))
            if ev is None:
                continue
            k, ev = ev
            if isinstance(ev, Delta):
                choices.delta(k, ev)
            elif isinstance(ev, Failed):
                abort()
                return error_response(ev.error)
            elif choices.done(ev):
                body = protocol.envelope(
                    job.kind,
                    name,
                    model,
                    created,
                    choices.whole(),
                    chunk=False,
                    usage_=choices.usage(),
                )
                return JSONResponse(body)  # fmt: skip
