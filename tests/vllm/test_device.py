"""vmcache.vllm's device path without a GPU: vLLM's GPU layout (K and V outermost in every
layer's view) on a reservation whose pages follow the CUDA driver's rules (StrictBackend at 2
MiB over the host's memory), the scheduler's wanted-groups bytes read by the worker through
/proc, groups mapped before use and unmapped (after a device sync) when not wanted, every
page released. Not measured on a GPU (tests/gpu runs the same on CudaBackend there)."""

import os

import pytest
import torch
from vllm_cases import DIM, HEADS, LAYERS, TOKENS, groups_follow_the_wants

from vmcache.memory.backends.host import HostBackend
from vmcache.memory.backends.strict import CUDA_GRANULARITY, StrictBackend
from vmcache.vllm.device import DeviceKVRegion
from vmcache.vllm.region import BlockLayout


@pytest.fixture
def strict():
    backend = StrictBackend(HostBackend(), CUDA_GRANULARITY)
    yield backend
    assert backend.live_handles() == 0 and backend.mapped_pages() == 0  # nothing leaked
    backend.close()


def test_groups_are_mapped_while_wanted_under_the_cuda_page_rules(strict):
    groups_follow_the_wants(strict, CUDA_GRANULARITY)
    assert strict.live_handles() == 0


def test_a_layout_that_splits_a_page_between_layers_is_refused(strict):
    blocks = 1000  # 1000 blocks of 4 KiB: layer 1 starts mid-page
    per = 2 * blocks * TOKENS * HEADS * DIM
    region = DeviceKVRegion(strict, LAYERS * per * 2)
    h = region.tensor(LAYERS * per * 2).view(torch.float16)
    views = [h[i * per:(i + 1) * per].view(2, blocks, TOKENS, HEADS, DIM).transpose(0, 1)
             for i in range(LAYERS)]  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 512 .*--num-gpu-blocks-override"):
        BlockLayout.from_views(views, region.base, blocks, CUDA_GRANULARITY)
    region.close()


def test_no_group_is_unmapped_while_a_step_runs(strict):
    """The GPU worker's idle thread synced (and unmapped) while ``execute_model`` ran: only
    the sync was locked. A step now holds the region: a sync from another thread waits for
    it, and the group a request of that step may read stays mapped until it returns."""
    import threading
    import time

    from vllm_cases import BLOCKS, gpu_views

    from vmcache.vllm.region import open_worker_memory, rendezvous_path

    nbytes = LAYERS * 2 * BLOCKS * TOKENS * HEADS * DIM * 2
    region = DeviceKVRegion(strict, nbytes)
    views = gpu_views(region.tensor(nbytes))
    region.bind(BlockLayout.from_views(views, region.base, BLOCKS, CUDA_GRANULARITY))
    path = rendezvous_path(f"step{os.getpid()}", 0)
    region.publish(path)
    wants = open_worker_memory(path)
    wants.back([1])
    idle = None
    with region.step():  # a step in flight: it reads group 1
        assert 1 in region.mapped
        wants.unback([1])  # the scheduler takes the group back meanwhile
        idle = threading.Thread(target=region.sync)
        idle.start()
        time.sleep(0.3)
        assert idle.is_alive() and 1 in region.mapped  # the idle sync waits for the step
        views[0][700].fill_(1.0)  # still readable and writable: mapped
    idle.join(10)
    assert not idle.is_alive() and 1 not in region.mapped  # unmapped once the step returned
    wants.close()
    region.close()
