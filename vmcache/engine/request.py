"""What a user submits (a prompt and sampling parameters) and what the engine tracks per
sequence while it runs (tokens, slot, swap handle, status)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``n`` sequences share the prompt (forked after one
    prefill); generation stops after ``max_new_tokens`` or at ``stop_token_id``."""

    max_new_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    top_k: int = 0  # 0 = the whole vocabulary
    seed: int = 0
    stop_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "n", "top_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.max_new_tokens < 1 or self.n < 1 or self.top_k < 0:
            raise ValueError(f"need max_new_tokens >= 1, n >= 1, top_k >= 0; got {self}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


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

    def done(self) -> bool:
        p = self.req.params
        return len(self.generated) >= p.max_new_tokens or (
            p.stop_token_id is not None and bool(self.generated)
            and self.generated[-1] == p.stop_token_id
        )  # fmt: skip
