import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # test helpers (caches.py); not the repo root

import torch  # noqa: E402

# Without a GPU, Triton kernels run on CPU tensors through the interpreter; with one they are
# compiled (the interpreter copies each argument's whole storage to the host: for a virtual
# cache, mostly unmapped memory). Read when kernels are decorated: set before importing them.
os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# CI is derandomized (a failure reproduces from the same seed); `make test-long` runs the
# randomized tests with new seeds and ten times the examples (see caches.examples)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("long", derandomize=False, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one thread each
    torch.set_num_threads(1)
from caches import strict_host  # noqa: E402

from vmcache import KVSpec, VMKVCache  # noqa: E402
from vmcache.memory.backends import cuda_vmm_available  # noqa: E402

HAS_CUDA_VMM = cuda_vmm_available()  # raises where a GPU is visible but the driver is not


def pytest_collection_modifyitems(config, items):
    # the end-to-end runs first (a stable sort: each module's tests stay together): with a
    # worker per core they start at once rather than leave one worker running the last of
    # them alone (`make test`'s wall time)
    # (markers, not keywords: a test's keywords hold its folders' names too, tests/gpu/'s "gpu")
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if HAS_CUDA_VMM:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with the CUDA driver")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def small_spec():
    return KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


@pytest.fixture
def make_cache():
    made = []

    def make(spec, **kw):
        kw.setdefault("max_seqs", 8)
        kw.setdefault("max_seq_len", 256)
        kw.setdefault("page_size", 4096)
        if "device" not in kw:
            kw.update(backend=strict_host(), own_backend=True)
        cache = VMKVCache(spec, **kw)
        made.append(cache)
        return cache

    yield make
    for c in made:
        c.close()
