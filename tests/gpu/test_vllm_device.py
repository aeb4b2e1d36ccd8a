"""vmcache.vllm's device path on a GPU: the scenario tests/vllm/test_device.py checks against
the CUDA page rules on the CPU, on CudaBackend (tensors on the device, a real cudaDeviceSynchronize
before unmapping). Skipped cleanly without a GPU."""

import pytest
from vllm_cases import groups_follow_the_wants

pytestmark = pytest.mark.gpu


def test_groups_are_mapped_while_wanted_on_cuda_vmm():
    from vmcache.memory.backends.cuda import CudaBackend

    backend = CudaBackend("cuda")
    try:
        groups_follow_the_wants(backend, backend.granularity)
    finally:
        backend.close()
