"""The OpenAI wire format: a request body checked field by field into a :class:`Job`, errors
as OpenAI's error object, and the response and stream-chunk objects. Pure Python: no web
framework here, so every rule is testable on its own.

A request is untrusted: every field is type- and range-checked before anything is queued,
unknown fields are ignored (clients send extras), features we do not serve (log
probabilities, penalties, echo, several prompts in one request) are refused by name.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from vmcache.engine.request import SamplingParams

MAX_STOPS = 4  # OpenAI's bound on stop strings
MAX_STOP_CHARS = 256


class APIError(Exception):
    """An error answered in OpenAI's format with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """What the served engine can take (checked before a request is queued)."""

    model: str  # the one name /v1/models lists and requests must use
    max_seq_len: int  # prompt + new tokens, one sequence
    max_n: int  # sequences one request may ask for (the cache's slots)


@dataclass(frozen=True)
class Job:
    """One checked request: what the engine loop needs and what the response echoes."""

    kind: str  # "chat" or "completion"
    prompt: tuple[int, ...] | None  # token ids (a completion given ids), else None
    text: str | None  # a completion's prompt text
    messages: tuple[dict, ...] | None  # a chat's messages, {"role", "content": str}
    params: SamplingParams
    max_tokens: int | None  # None: as many as the context leaves (chat's default)
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _opt(body: dict, name: str, kinds: tuple, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise _bad(f"'{name}' must be {kinds[0].__name__}, got a bool", name)
    if not isinstance(value, kinds):
        raise _bad(f"'{name}' must be {kinds[0].__name__}, got {type(value).__name__}", name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float, open_lo=False):
    value = float(_opt(body, name, (float, int), default))
    if not math.isfinite(value) or value > hi or value < lo or (open_lo and value == lo):
        side = "(" if open_lo else "["
        raise _bad(f"'{name}' must be in {side}{lo}, {hi}], got {value}", name)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"'stop' takes at most {MAX_STOPS} non-empty strings of at most "
                   f"{MAX_STOP_CHARS} characters", "stop")  # fmt: skip
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
        if body.get(name) not in (None, False, 0, [], ""):
            raise _bad(f"'{name}' is not supported by this server", name, "unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _bad(f"'{name}' is not supported by this server", name, "unsupported")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise _bad("'best_of' other than n is not supported", "best_of", "unsupported")


def _messages(body: dict) -> tuple[dict, ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                            "assistant"):  # fmt: skip
            raise _bad(f"messages[{i}] needs a role of system, developer, user or assistant",
                       "messages")  # fmt: skip
        content = m.get("content")
        if isinstance(content, list):  # parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):  # fmt: skip
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or text parts", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return tuple(out)


def _prompt(body: dict) -> tuple[tuple[int, ...] | None, str | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        return None, prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):  # fmt: skip
        return tuple(prompt), None
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("one prompt per request is supported; send several requests", "prompt",
                   "unsupported")  # fmt: skip
    raise _bad("'prompt' must be a non-empty string or list of token ids", "prompt")


def check_model(model: str, limits: Limits) -> None:
    """OpenAI's 404 ``model_not_found`` unless ``model`` is the one this server serves."""
    if model != limits.model:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{limits.model}'", param="model", code="model_not_found")  # fmt: skip


def parse(body, kind: str, limits: Limits) -> Job:
    """A :class:`Job` from a decoded JSON ``body`` of a ``kind`` ("chat" / "completion")
    request, or :class:`APIError` (400; 404 for another model) naming the field."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("'model' is required (a string)", "model")
    check_model(model, limits)
    _refuse_unsupported(body)
    prompt = text = messages = None
    if kind == "chat":
        messages = _messages(body)
    else:
        prompt, text = _prompt(body)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
        "max_tokens"  # fmt: skip
    max_tokens = _opt(body, name, (int,), None if kind == "chat" else 16)
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_seq_len:
        raise _bad(f"'{name}' must be in [1, {limits.max_seq_len}], got {max_tokens}", name)
    n = _opt(body, "n", (int,), 1)
    if not 1 <= n <= limits.max_n:
        raise _bad(f"'n' must be in [1, {limits.max_n}], got {n}", "n")
    top_k = _opt(body, "top_k", (int,), 0)
    if top_k < -1:
        raise _bad(f"'top_k' must be >= 0 (or -1: off), got {top_k}", "top_k")
    seed = _opt(body, "seed", (int,), None)  # none: sampled afresh, as vLLM does
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise _bad("'seed' must be a 64-bit int", "seed")
    stream = _opt(body, "stream", (bool,), False)
    options = _opt(body, "stream_options", (dict,), {})
    if options and not stream:  # vLLM's answer too: the options only shape a stream
        raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be a bool", "stream_options")
    stop_ids = _opt(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
        raise _bad("'stop_token_ids' must hold non-negative ints", "stop_token_ids")
    params = SamplingParams(
        max_new_tokens=max_tokens or 1, n=n, top_k=max(top_k, 0), seed=seed,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0), stop_token_ids=tuple(stop_ids),
        ignore_eos=_opt(body, "ignore_eos", (bool,), False))  # fmt: skip
    return Job(kind, prompt, text, messages, params, max_tokens, _stops(body), stream,
               include_usage)  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def choice(kind: str, index: int, text: str, finish: str | None, *, delta: bool,
           first: bool = False) -> dict:  # fmt: skip
    """One choice of a response (``delta``: of a stream chunk)."""
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    if delta:
        msg = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": msg if text or first else {}, "logprobs": None,
                "finish_reason": finish}  # fmt: skip
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish}  # fmt: skip


def envelope(kind: str, rid: str, model: str, created: int, choices: list, *, chunk: bool,
             usage_: dict | None = None) -> dict:  # fmt: skip
    obj = "text_completion" if kind == "completion" else \
        ("chat.completion.chunk" if chunk else "chat.completion")  # fmt: skip
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out


def now_s() -> int:
    return int(time.time())
