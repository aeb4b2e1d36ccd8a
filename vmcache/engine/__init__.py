"""A continuous-batching serving engine over VMKVCache or PagedKVCache (see engine.py)."""

from vmcache.engine.drafts import DraftModel, NgramDrafter
from vmcache.engine.engine import Engine
from vmcache.engine.request import Request, SamplingParams
from vmcache.engine.runner import ModelRunner, StepCache
from vmcache.engine.scheduler import Scheduler
from vmcache.engine.stats import EngineStats

__all__ = ["Engine", "EngineStats", "Request", "SamplingParams", "ModelRunner", "StepCache",
           "Scheduler", "NgramDrafter", "DraftModel"]  # fmt: skip
