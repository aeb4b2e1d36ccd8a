"""The engine's counters: one object the scheduler and the speculation write their parts of."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vmcache.engine.scheduler import SchedulerStats
from vmcache.engine.speculation import SpeculationStats


@dataclass
class EngineStats(SchedulerStats):
    """The engine's counters; the scheduler writes its own (:class:`SchedulerStats`, the
    fields this class inherits) and the speculation its :class:`SpeculationStats`
    (``speculation``)."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens fed in prefills (recomputed ones included)
    generated_tokens: int = 0
    map_s: float = 0.0  # time in the schedule phase (grows map what was not mapped ahead)
    premap_s: float = 0.0  # time mapping next-step pages while the step runs (map_ahead)
    premapped_pages: int = 0
    model_s: float = 0.0  # time in model steps
    elapsed_s: float = 0.0
    max_running: int = 0
    released_pages: int = 0  # free pages' memory given back (keep_free_pages)
    budget_waits: int = 0  # steps with nothing to run while a shared budget was taken
    aborted_requests: int = 0  # requests dropped by abort() before they finished
    speculation: SpeculationStats = field(default_factory=SpeculationStats)  # by the speculation
    step_s: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        """Every counter, flat (the speculation's as ``spec_*`` / ``tree_*``), and rates."""
        d = asdict(self)
        d.pop("step_s")
        for name, value in d.pop("speculation").items():
            d[name if name.startswith("tree_") else f"spec_{name}"] = value
        steps = max(self.steps, 1)
        rate = self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0
        d.update(map_ms_per_step=1e3 * self.map_s / steps, step_ms=1e3 * self.model_s / steps,
                 premap_ms_per_step=1e3 * self.premap_s / steps, tok_per_s=rate,
                 spec_acceptance=self.speculation.acceptance)  # fmt: skip
        return d
