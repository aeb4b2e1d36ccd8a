"""What a user submits (a prompt and sampling parameters) and what the engine tracks per
sequence while it runs (tokens, slot, swap handle, status)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``n`` sequences share the prompt (forked after one
    prefill). A sequence finishes after ``max_new_tokens`` (``"length"``) or on a stop token
    (``"stop"``, the token kept as its last): one of ``stop_token_ids``, or one of the
    model's end-of-sequence ids (its ``generation_config.eos_token_id``) unless
    ``ignore_eos``. Sampling filters: ``top_k`` (0: off), ``top_p`` (1: off), ``min_p``
    (0: off), in transformers' order after the temperature. ``seed`` (any int) makes a
    sampled request reproducible; None (the default) samples afresh every time.

    Before sampling (:mod:`vmcache.engine.logits`): ``logit_bias`` ({token id: bias in
    [-100, 100]}, OpenAI's) added to the logits, then ``repetition_penalty`` (1: off; over
    prompt and generated tokens), ``frequency_penalty`` and ``presence_penalty`` (0: off;
    in [-2, 2], over generated tokens). Reported: ``logprobs`` (None: off; k in
    [0, :data:`MAX_LOGPROBS`]) records each generated token's log-probability with its k
    most likely alternatives; ``prompt_logprobs`` the same for every prompt token after the
    first (the prefill computes them; such a prompt is not served from the prefix cache).
    Both are the model's own distribution, before bias, penalties and temperature.

    (``stop_token_id``, the single stop id of earlier versions, is gone: pass
    ``stop_token_ids=[id]``.)"""

    max_new_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    top_k: int = 0  # 0 = the whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: fresh randomness for every sequence (vLLM's default)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per generated token (None: not reported)
    prompt_logprobs: int | None = None  # alternatives per prompt token (None: not reported)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "n", "top_k", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if name in ("seed", "logprobs", "prompt_logprobs") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if value != value:
                raise ValueError(f"{name} must not be NaN")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {ids!r}")
        ids = tuple(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise TypeError(f"stop_token_ids must hold non-negative ints, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.max_new_tokens < 1 or self.n < 1 or self.top_k < 0:
            raise ValueError(f"need max_new_tokens >= 1, n >= 1, top_k >= 0; got {self}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got "
                             f"{self.repetition_penalty}")  # fmt: skip
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))

    @property
    def processes_logits(self) -> bool:
        """Whether a logit bias or a penalty changes the logits before sampling."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(
            self.presence_penalty or self.frequency_penalty)  # fmt: skip


MAX_LOGPROBS = 20  # alternatives one position may report (vLLM's default bound, OpenAI's)
MAX_LOGIT_BIAS = 300  # entries of one logit_bias (OpenAI's bound)


def logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias ({id: bias} or (id, bias) pairs) as (id, bias) pairs, ids ascending."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
        raise TypeError(f"logit_bias must map token ids to numbers, got {bias!r}")
    out = {}
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or len(pair) != 2:
            raise TypeError(f"logit_bias must map token ids to numbers, got {bias!r}")
        token, value = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise TypeError(f"logit_bias keys must be non-negative ints, got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"logit_bias values must be numbers, got {value!r}")
        if not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        out[token] = float(value)
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(out)}")
    return tuple(sorted(out.items()))


def model_eos_ids(model) -> frozenset[int]:
    """The model's end-of-sequence ids, every request's default stops:
    ``generation_config.eos_token_id`` (an int, a list, or None: none)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else (int(t) for t in eos))


@dataclass(frozen=True)
class Request:
    req_id: str
    prompt: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    salt: str | None = None  # tenant: cached prefixes are shared only under the same salt


class Status(enum.Enum):
    WAITING = "waiting"  # not prefilled yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # K/V on the host tier
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    """One sequence of a request (``index`` < n). ``tokens`` = prompt + generated; the cache
    holds K/V for ``tokens[:cached]``; the next step feeds ``tokens[cached:]``."""

    req: Request
    index: int
    tokens: list[int]
    generator: torch.Generator
    status: Status = Status.WAITING
    slot: int | None = None  # sequence id in the cache while RUNNING
    cached: int = 0
    swap: object | None = None  # SwapHandle while SWAPPED
    admitted_at: int = -1  # engine step of the last admission (victim order)
    generated: list[int] = field(default_factory=list)
    chunk: int = 0  # tokens scheduled this step (chunked prefill: maybe fewer than pending)
    draft: int = 0  # speculative draft tokens at the end of ``tokens`` (not generated yet)
    branches: list = field(default_factory=list)  # extra chains to verify in forks
    tree: list[int] | None = None  # parents of tokens[cached:] when they are a token tree
    mapped_at_draft: int = 0  # its mapped pages when its drafts were proposed
    spec_k: int | None = None  # drafts it may propose next (adaptive speculation)
    spec_accepted: int | None = None  # drafts its last verification accepted
    stop_ids: frozenset[int] = frozenset()  # its stop tokens: the request's and the model's EOS
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    prefix_hit: int | None = None  # prompt tokens its first admission found in the prefix cache
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token (if asked)
    prompt_logprobs: list = field(default_factory=list)  # per prompt token (first: None)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt log-probabilities not all computed yet (its prefill must run
        over every prompt token: no prefix-cache hit)."""
        return (self.index == 0 and self.req.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.req.prompt))  # fmt: skip

    def drop_draft(self) -> None:
        """Forget the draft tokens (not verified: a preemption, or no room this step)."""
        if self.draft:
            del self.tokens[len(self.tokens) - self.draft :]
            self.draft = 0
        self.branches, self.tree = [], None

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cached :]

    @property
    def scheduled(self) -> list[int]:
        """The tokens this step feeds: ``tokens[cached : cached + chunk]``."""
        return self.tokens[self.cached : self.cached + self.chunk]

    def done(self) -> str | None:
        """Why it is finished (``"stop"``: its last token is a stop token, ``"length"``:
        ``max_new_tokens`` reached), None while it runs."""
        if self.generated and self.generated[-1] in self.stop_ids:
            return "stop"
        return "length" if len(self.generated) >= self.req.params.max_new_tokens else None
