"""One response's choices, built as its engine requests' events arrive: a completions request
may batch several prompts, each run as its own engine request with ``n`` sequences.

    prompt k, sequence j  ──▶  choice index k·n + j         (OpenAI's order, as vLLM's)

    choice text  = [the prompt's text, if echo] + every delta's text
    logprobs     = [the prompt's reports, if echo] + every generated token's report

Owned by one HTTP handler on the event loop: nothing here is shared or touches the engine.
"""

from __future__ import annotations

from vmcache.server import protocol
from vmcache.server.loop import Delta, Done


class Choices:
    def __init__(self, job: protocol.Job, prompt_lens: list[int], echo_texts: list[str]) -> None:
        """``prompt_lens[k]``: prompt k's tokens; ``echo_texts[k]``: its text (echo only)."""
        self.kind, self.echo, self.n = job.kind, job.echo, job.params.n
        self.reports_logprobs = job.params.logprobs is not None
        self.echo_texts, self.prompts = echo_texts, len(prompt_lens)
        total = self.n * self.prompts
        self.texts, self.reasons = [""] * total, [None] * total
        self.stops: list[protocol.Stopped | None] = [None] * total
        self.reports: list[list[protocol.Logprob]] = [[] for _ in range(total)]
        self.offsets = [0] * total  # characters of each choice's text streamed so far
        self.started = [False] * total
        self.prompt_tokens, self.generated = sum(prompt_lens), 0
        self.completion_tokens = self.cached_tokens = self.finished = 0

    @property
    def indices(self) -> range:
        return range(self.n * self.prompts)

    def delta(self, k: int, ev: Delta) -> dict:
        """Prompt ``k``'s ``ev`` taken in; returns its stream chunk's choice."""
        i = k * self.n + ev.index
        text, reports = ev.text, list(ev.logprobs or ())
        if not self.started[i]:
            self.started[i] = True
            if self.echo:
                text = self.echo_texts[k] + text
                reports = [*(ev.prompt_logprobs or ()), *reports]
        self.texts[i] += text
        self.reasons[i] = ev.finish_reason or self.reasons[i]
        self.stops[i] = ev.stopped or self.stops[i]
        self.generated += ev.tokens
        logprobs = None
        if self.reports_logprobs:
            self.reports[i] += reports
            logprobs = self._logprobs(reports, self.offsets[i])
        self.offsets[i] += len(text)
        return protocol.choice(self.kind, i, text, ev.finish_reason, delta=True,
                               logprobs=logprobs, stop=ev.stopped)  # fmt: skip

    def done(self, ev: Done) -> bool:
        """A prompt's request ended: its usage added; True once every prompt's has."""
        self.completion_tokens += ev.completion_tokens
        self.cached_tokens += ev.cached_tokens
        self.finished += 1
        return self.finished == self.prompts

    def usage(self, so_far: bool = False) -> dict:
        """The response's usage (``so_far``: tokens streamed until now, for a chunk)."""
        done = self.generated if so_far else self.completion_tokens
        return protocol.usage(self.prompt_tokens, done, self.cached_tokens)

    def whole(self) -> list[dict]:
        """Every choice, whole (a non-streamed response)."""
        return [protocol.choice(self.kind, i, self.texts[i], self.reasons[i], delta=False,
                                logprobs=self._logprobs(self.reports[i], 0)
                                if self.reports_logprobs else None, stop=self.stops[i])
                for i in self.indices]  # fmt: skip

    def _logprobs(self, reports: list, offset: int) -> dict:
        if self.kind == "completion":
            return protocol.completion_logprobs(reports, offset)
        return protocol.chat_logprobs(reports)
