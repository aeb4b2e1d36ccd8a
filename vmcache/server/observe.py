"""What the engine loop reports as it goes, for metrics: each step's tokens, the engine's
state between steps, and each request's end with its timeline.

    arrival ──queue──▶ scheduled ──prefill──▶ first token ──decode──▶ end
            └──────────────────────── e2e ────────────────────────────┘
                       └────────────── inference ──────────────────────┘

``scheduled`` is the start of the first step the request ran in; token times are the ends
of the steps that produced its first sequence's tokens (so inter-token latencies are step
to step, as vLLM measures them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    """One request's end (``time.perf_counter()`` seconds)."""

    prompt_tokens: int
    completion_tokens: int  # every sequence's
    reason: str  # its first sequence's: "stop", "length", "abort", "error"
    n: int  # sequences asked for
    max_tokens: int  # new tokens allowed per sequence
    arrival_s: float
    scheduled_s: float | None  # None: it never ran (aborted or failed while waiting)
    end_s: float
    token_s: tuple[float, ...]  # when each token of its first sequence came

    @property
    def first_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None

    @property
    def ttft_s(self) -> float:
        """Time to first token (to the end, when none came)."""
        return (self.first_s if self.first_s is not None else self.end_s) - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None under two tokens)."""
        t = self.token_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def inter_token_s(self) -> list[float]:
        t = self.token_s
        return [b - a for a, b in zip(t, t[1:]) if b > a]  # tokens of one step: one gap

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        """Arrival to its first step (all of it, when it never ran)."""
        return (self.scheduled_s if self.scheduled_s is not None else self.end_s) - self.arrival_s

    @property
    def phases_s(self) -> tuple[float, float, float] | None:
        """(prefill, decode, inference) seconds; None when it never ran or made no token."""
        if self.scheduled_s is None or self.first_s is None:
            return None
        s, f, e = self.scheduled_s, self.first_s, self.end_s
        return f - s, e - f, e - s


class Observer:
    """What the loop reports as it goes (metrics); the default records nothing. Every call
    comes from the loop thread."""

    def request_finished(self, record: Finished) -> None:
        """A request ended (finished, aborted or failed)."""

    def step_finished(self, tokens: int) -> None:
        """A step ran: the prompt tokens it computed plus the tokens it generated."""

    def engine_state(self, engine) -> None:
        """Called between steps, at most every ``state_every_s`` (and when idle): a scrape
        reads what this keeps instead of waiting for a long step."""
