import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # test helpers (caches.py); not the repo root

# Triton kernels run on CPU tensors through the interpreter; it is read when kernels are
# decorated, so it must be set before vmcache.kernels is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vmcache import KVSpec, VMKVCache  # noqa: E402
from vmcache.backends import cuda_vmm_available  # noqa: E402

HAS_CUDA_VMM = cuda_vmm_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA_VMM:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with the CUDA driver")
    for item in items:
        if "gpu" in item.keywords:
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
        cache = VMKVCache(spec, **kw)
        made.append(cache)
        return cache

    yield make
    for c in made:
        c.close()
