"""The OpenAI wire format: a request body checked field by field into a :class:`Job`, errors
as OpenAI's error object, and the response and stream-chunk objects. Pure Python: no web
framework here, so every rule is testable on its own.

A request is untrusted: every field is type- and range-checked before anything is queued,
unknown fields are ignored (clients send extras), features we do not serve (a completion's
``suffix``, tools, ``best_of`` above ``n``, chat ``echo``, and any field of
:data:`NO_OP_ONLY` at a value that would change the output: ``response_format``, guided
decoding, ``min_tokens``, ...) are refused by name.

Log-probabilities (completions' ``logprobs``: k; chat's ``logprobs`` and ``top_logprobs``)
are the model's own distribution, before temperature, penalties and bias (vLLM's default);
a completion's ``echo`` returns the prompt first, its tokens' log-probabilities computed by
the same prefill (the first token's null, as OpenAI sends it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from vmcache.engine.request import MAX_LOGPROBS, SamplingParams, logit_bias_pairs

MAX_STOPS = 4  # OpenAI's bound on stop strings
MAX_STOP_CHARS = 256
MAX_PROMPTS = 256  # prompts one completions request may batch
MAX_ROLE_CHARS = 64  # a chat message's role: any name the model's template knows


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
class Logprob:
    """One token's report on the wire: its text, log-probability, the alternatives."""

    token: str  # the token decoded alone (special tokens kept)
    logprob: float | None  # None: a prompt's first token (nothing before it)
    top: tuple[tuple[str, float], ...]  # the k most likely tokens, most likely first


@dataclass(frozen=True)
class Limits:
    """What the served engine can take (checked before a request is queued)."""

    model: str  # the one name /v1/models lists and requests must use
    max_seq_len: int  # prompt + new tokens, one sequence
    max_n: int  # sequences one request may ask for (the cache's slots)
    vocab_size: int | None = None  # token ids a prompt or logit_bias may use (None: unchecked)


@dataclass(frozen=True)
class Job:
    """One checked request: what the engine loop needs and what the response echoes."""

    kind: str  # "chat" or "completion"
    prompts: tuple[tuple[int, ...] | str, ...]  # a completion's prompts (ids or text); chat: ()
    messages: tuple[dict, ...] | None  # a chat's messages, {"role", "content": str}
    params: SamplingParams  # logprobs set when reported, prompt_logprobs for an echo's
    max_tokens: int | None  # None: as many as the context leaves (chat's default); 0: echo only
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # every stream chunk carries the usage so far
    echo: bool = False  # a completion's text (and log-probabilities) start with its prompt
    token_ids: bool = False  # log-probabilities name tokens "token_id:N" (vLLM's flag)


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


# fields OpenAI and vLLM clients send that would change the output: served only at the value
# that changes nothing (None is always fine), refused by name otherwise, never ignored
NO_OP_ONLY = {
    "response_format": [{"type": "text"}], "tool_choice": ["none", "auto"],
    "function_call": ["none", "auto"], "modalities": [["text"]], "audio": [],
    "min_tokens": [0], "include_stop_str_in_output": [False], "skip_special_tokens": [True],
    "spaces_between_special_tokens": [True], "bad_words": [[]], "allowed_token_ids": [],
    "truncate_prompt_tokens": [], "prompt_logprobs": [], "guided_json": [], "guided_regex": [],
    "guided_choice": [], "guided_grammar": [], "structured_outputs": [],
}  # fmt: skip


def _refuse_unsupported(body: dict, kind: str) -> None:
    names = ("suffix", "tools", "functions") + (("echo",) if kind == "chat" else ())
    for name in names:
        if body.get(name) not in (None, False, [], ""):
            raise _bad(f"'{name}' is not supported by this server", name, "unsupported")
    for name, no_op in NO_OP_ONLY.items():
        if body.get(name) is not None and body[name] not in no_op:
            allowed = ", ".join(map(repr, no_op)) or "null"
            raise _bad(f"'{name}' is not supported by this server (only {allowed})", name,
                       "unsupported")  # fmt: skip
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise _bad("'best_of' other than n is not supported", "best_of", "unsupported")


def _logprobs(body: dict, kind: str) -> int | None:
    """Alternatives per token to report (None: none): a completion's ``logprobs`` k, or a
    chat's ``top_logprobs`` when its ``logprobs`` is true."""
    if kind == "completion":
        k = _opt(body, "logprobs", (int,), None)
        name = "logprobs"
    else:
        on = _opt(body, "logprobs", (bool,), False)
        k = _opt(body, "top_logprobs", (int,), None)
        name = "top_logprobs"
        if k is not None and not on:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        k = (k or 0) if on else None
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise _bad(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def _logit_bias(body: dict, limits: Limits) -> tuple[tuple[int, float], ...]:
    """JSON's string keys as token ids below the vocabulary; the values and the count checked
    by the engine's own rule (:func:`~vmcache.engine.request.logit_bias_pairs`)."""
    bias = _opt(body, "logit_bias", (dict,), {})
    ids = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None or (limits.vocab_size is not None and token >= limits.vocab_size):
            raise _bad(f"'logit_bias' keys must be token ids below {limits.vocab_size}, got "
                       f"{key!r}", "logit_bias")  # fmt: skip
        ids[token] = value
    try:
        return logit_bias_pairs(ids)
    except (TypeError, ValueError) as e:
        raise _bad(f"'logit_bias': {e}", "logit_bias") from None


def _messages(body: dict) -> tuple[dict, ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_CHARS:
            raise _bad(f"messages[{i}] needs a role: a string (system, developer, user, "
                       f"assistant, or any role the model's template knows) of at most "
                       f"{MAX_ROLE_CHARS} characters", "messages")  # fmt: skip
        content = m.get("content")
        if isinstance(content, list):  # parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):  # fmt: skip
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or text parts", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)  # fmt: skip


def _prompts(body: dict, limits: Limits) -> tuple[tuple[int, ...] | str, ...]:
    """A completion's prompts: a string, token ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    batch = [prompt] if isinstance(prompt, str) or _ids(prompt) else prompt
    if not isinstance(batch, list) or not batch or not all(
            (isinstance(p, str) and p) or _ids(p) for p in batch):  # fmt: skip
        raise _bad("'prompt' must be a non-empty string, a list of token ids, or a list of "
                   "either", "prompt")  # fmt: skip
    if len(batch) > MAX_PROMPTS:
        raise _bad(f"'prompt' batches at most {MAX_PROMPTS} prompts", "prompt")
    vocab = limits.vocab_size
    for p in batch:
        if not isinstance(p, str) and vocab is not None and not all(0 <= t < vocab for t in p):
            raise _bad(f"'prompt' token ids must be in [0, {vocab})", "prompt")
    return tuple(p if isinstance(p, str) else tuple(p) for p in batch)


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
    _refuse_unsupported(body, kind)
    prompts, messages = (), None
    if kind == "chat":
        messages = _messages(body)
    else:
        prompts = _prompts(body, limits)
    echo = kind == "completion" and _opt(body, "echo", (bool,), False)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
        "max_tokens"  # fmt: skip
    max_tokens = _opt(body, name, (int,), None if kind == "chat" else 16)
    least = 0 if echo else 1  # an echo may generate nothing (its prompt's logprobs only)
    if max_tokens is not None and not least <= max_tokens <= limits.max_seq_len:
        raise _bad(f"'{name}' must be in [{least}, {limits.max_seq_len}], got {max_tokens}",
                   name)  # fmt: skip
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
    continuous = options.get("continuous_usage_stats", False)
    if not isinstance(include_usage, bool) or not isinstance(continuous, bool):
        raise _bad("'stream_options.include_usage' and '.continuous_usage_stats' must be "
                   "bools", "stream_options")  # fmt: skip
    logprobs = _logprobs(body, kind)
    stop_ids = _opt(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
        raise _bad("'stop_token_ids' must hold non-negative ints", "stop_token_ids")
    params = SamplingParams(
        max_new_tokens=max_tokens or 1, n=n, top_k=max(top_k, 0), seed=seed,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0), stop_token_ids=tuple(stop_ids),
        ignore_eos=_opt(body, "ignore_eos", (bool,), False), logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, open_lo=True),
        logit_bias=_logit_bias(body, limits))  # fmt: skip
    token_ids = _opt(body, "return_tokens_as_token_ids", (bool,), False)
    return Job(kind, prompts, messages, params, max_tokens, _stops(body), stream,
               include_usage, continuous, echo, token_ids)  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def completion_logprobs(reports, offset: int) -> dict:
    """A completion choice's ``logprobs`` (OpenAI's legacy object) for ``reports``
    (:class:`Logprob`), the first at character ``offset`` of the choice's text. Each
    ``top_logprobs`` entry holds the k alternatives and the token itself (as vLLM's)."""
    tokens, values, tops, offsets = [], [], [], []
    for r in reports:
        tokens.append(r.token)
        values.append(r.logprob)
        tops.append(None if r.logprob is None else {**dict(r.top), r.token: r.logprob})
        offsets.append(offset)
        offset += len(r.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(reports) -> dict:
    """A chat choice's ``logprobs``: ``content``, one entry per token with its UTF-8 bytes
    and its ``top_logprobs`` (the k most likely, most likely first)."""

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, v) for t, v in
                                                                       r.top]}
                        for r in reports]}  # fmt: skip


def choice(kind: str, index: int, text: str, finish: str | None, *, delta: bool,
           first: bool = False, logprobs: dict | None = None, stop=None) -> dict:  # fmt: skip
    """One choice of a response (``delta``: of a stream chunk). ``stop``: what stopped it
    (:class:`Stopped`), said as vLLM's ``stop_reason`` and SGLang's ``matched_stop``."""
    ends = {"finish_reason": finish, "stop_reason": stop.reason if stop else None,
            "matched_stop": stop.matched if stop else None}  # fmt: skip
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, **ends}
    if delta:
        msg = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": msg if text or first else {}, "logprobs": logprobs,
                **ends}  # fmt: skip
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, **ends}  # fmt: skip


@dataclass(frozen=True)
class Stopped:
    """What ended a sequence that finished with ``"stop"``: ``reason`` the stop string or
    stop token id (None at the model's end-of-sequence id, as vLLM says it), ``matched``
    the same or the end-of-sequence id (SGLang's)."""

    reason: str | int | None
    matched: str | int | None


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
