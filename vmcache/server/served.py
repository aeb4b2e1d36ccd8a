"""One model a server serves: its name and limits, the engine loop that owns its engine, and
its keeper (sleep, wake, its share of a KV budget). The HTTP layer routes a request to one of
these by the OpenAI ``model`` field; sleep and wake run on the model's engine thread.

    served.sleep(level)  ->  bytes given back     409 while it serves requests
    served.wake()                                 (a request wakes it too)
    served.is_sleeping   ->  bool
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from vmcache.memory.ledger_rows import LedgerError
from vmcache.server.keeper import Keeper
from vmcache.server.loop import EngineLoop, InProgress
from vmcache.server.protocol import APIError, Limits

SLEEP_TIMEOUT_S = 120.0  # a sleep or wake waits this long for the engine thread (a reload)


@dataclass(eq=False)
class Served:
    name: str
    loop: EngineLoop
    keeper: Keeper
    source: str = ""  # where its weights come from (a name, a directory, a file)
    created: int = field(default_factory=lambda: int(time.time()))
    sleep_timeout_s: float = SLEEP_TIMEOUT_S  # how long a sleep or wake waits for the thread

    @functools.cached_property
    def limits(self) -> Limits:  # the cache's configuration is frozen: read once
        kv = self.loop.engine.kv
        return Limits(self.name, kv.config.max_seq_len, kv.config.max_seqs,
                      self.loop.engine.vocab)  # fmt: skip

    @property
    def is_sleeping(self) -> bool:
        return self.keeper.asleep

    def card(self) -> dict:
        """Its entry in ``/v1/models``."""
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "vmcache", "root": self.source or self.name, "parent": None,
                "max_model_len": self.limits.max_seq_len}  # fmt: skip

    def sleep(self, level: int) -> int:
        """Sleep at ``level`` on the engine thread; :class:`APIError` 400 for a bad level,
        409 while requests run."""

        def run(engine):
            try:
                return self.keeper.sleep(engine, level)
            except LedgerError as e:  # undone: the model is as it was
                raise APIError(503, f"model {self.name!r}: the sleep was undone: {e}",
                               type="server_error") from None  # fmt: skip
            except RuntimeError as e:
                raise APIError(409, f"model {self.name!r}: {e}", code="model_busy") from None
            except ValueError as e:
                raise APIError(400, f"model {self.name!r}: {e}", param="level") from None

        return self._query(run, "sleep")

    def wake(self) -> None:
        self._query(self.keeper.wake, "wake")

    def _query(self, fn, what: str, timeout_s: float | None = None):
        """``fn`` on the engine thread; a timeout is a 503 that says nothing changed (the
        call is cancelled: a sleep that timed out never sleeps the model later)."""
        try:
            return self.loop.query(fn, timeout_s=timeout_s or self.sleep_timeout_s)
        except InProgress as e:
            raise APIError(504, f"model {self.name!r}: the {what} is still running ({e}); "
                           "ask /is_sleeping", type="server_error",
                           code="in_progress") from None  # fmt: skip
        except TimeoutError as e:
            raise APIError(503, f"model {self.name!r}: the {what} was not begun ({e}); "
                           "nothing changed, try again", type="server_error",
                           code="timeout") from None  # fmt: skip

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop its engine loop; then (once the loop is gone) its cache's memory and its
        holder of the budget back."""
        self.loop.close(timeout_s)
        if self.loop.stopped:
            self.loop.engine.kv.close()
            if self.keeper.budget is not None:
                self.keeper.budget.close()
