"""Byte-compile what the project's processes import, into the venv running this script.

`make`'s venvs install with `pip install --no-compile` (pip compiles every file it unpacks
on one core) and then run this: it imports the modules the library, its tests, the harness
and the server load, with bytecode writing on (whatever PYTHONDONTWRITEBYTECODE says), so
each later process reads their cached bytecode instead of compiling them again; the many
files no process imports (the other model families of transformers, most of torch's tools)
are never compiled. A module missing from this venv (an extra it was not installed with) is
skipped; one left out of the list still works, compiled again by each process that imports it.
"""

import importlib
import pkgutil
import sys

sys.dont_write_bytecode = False  # the point of this script, whatever the environment says

MODULES = [
    "numpy", "torch", "torch.distributed", "torch.multiprocessing", "torch.testing",
    "torch._dynamo", "torch._inductor.compile_fx", "triton", "triton.language",
    "transformers", "transformers.modeling_utils", "transformers.masking_utils",
    "transformers.generation.utils", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama",
    "transformers.models.gemma3.modeling_gemma3", "transformers.integrations.ggml", "gguf",
    "matplotlib", "matplotlib.pyplot", "pytest", "xdist", "hypothesis", "hypothesis.stateful",
    "starlette", "uvicorn", "prometheus_client", "openai",
]  # fmt: skip


def _try(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # not installed here (an extra), or needs what this venv lacks
        return False
    return True


def main() -> int:
    done = sum(_try(m) for m in MODULES)
    import vmcache

    ours = [m.name for m in pkgutil.walk_packages(vmcache.__path__, "vmcache.")]
    done += sum(_try(m) for m in ours if not m.endswith("__main__"))
    print(f"bytecode cached for {done} of {len(MODULES) + len(ours)} module trees")
    return 0


if __name__ == "__main__":
    sys.exit(main())
