"""What the HTTP layer hands a request's events through: a subscription (engine thread to
the event loop, the client's disconnect watched), a streaming response that aborts its
request however it ends, server-sent events, and OpenAI's error object as a response."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from vmcache.server.protocol import APIError

PING_S = 1.0  # a stream's keep-alive: how soon a vanished client is noticed while waiting


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None  # RFC 6750
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


GONE = object()  # a subscription's event: the client disconnected (its request aborted)


class Subscription:
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


class Stream(StreamingResponse):
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


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
