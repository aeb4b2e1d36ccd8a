"""A continuous-batching serving engine over VMKVCache or PagedKVCache (see engine.py)."""

from .engine import Engine, EngineStats
from .request import Request, SamplingParams
from .runner import ModelRunner, StepCache
from .scheduler import Scheduler

__all__ = ["Engine", "EngineStats", "Request", "SamplingParams", "ModelRunner", "StepCache",
           "Scheduler"]  # fmt: skip
