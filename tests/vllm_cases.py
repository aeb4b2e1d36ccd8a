"""vmcache.vllm's device scenario, shared by tests/vllm/test_device.py (StrictBackend on the
CPU) and tests/gpu/test_vllm_device.py (CudaBackend on a GPU)."""

import os

import torch

from vmcache.vllm.device import DeviceKVRegion
from vmcache.vllm.region import BlockLayout, open_worker_memory, rendezvous_path

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 2, 1024, 16, 2, 64  # fp16: 4 KiB of K (and of V) a block


def gpu_views(buf: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's flash layout: each layer stores [2, blocks, tokens, heads, dim] and is viewed
    with blocks first (K/V an outer dimension, as vLLM's standardized views are)."""
    per = 2 * BLOCKS * TOKENS * HEADS * DIM
    h = buf.view(torch.float16)
    return [h[i * per:(i + 1) * per].view(2, BLOCKS, TOKENS, HEADS, DIM).transpose(0, 1)
            for i in range(LAYERS)]  # fmt: skip


def groups_follow_the_wants(strict, granularity):
    """The scenario on ``strict`` (a StrictBackend, or CudaBackend on a GPU)."""
    nbytes = LAYERS * 2 * BLOCKS * TOKENS * HEADS * DIM * 2
    region = DeviceKVRegion(strict, nbytes)
    views = gpu_views(region.tensor(nbytes))
    layout = BlockLayout.from_views(views, region.base, BLOCKS, granularity)
    assert len(layout.segments) == 4 and layout.group_blocks == 512 and layout.num_groups == 2
    region.bind(layout)  # group 0 (vLLM's null block) mapped from the start
    assert region.resident_bytes() == 4 * granularity and region.resident_bytes() == 4 * granularity
    views[1][3].fill_(2.0)  # a block of group 0, K and V of layer 1
    path = rendezvous_path(f"dev{os.getpid()}", 0)
    region.publish(path)
    wants = open_worker_memory(path)  # the scheduler's side
    assert wants.punch is None and wants.layout == layout
    wants.back([1])
    assert region.sync() == (1, 0) and region.resident_bytes() == 8 * granularity
    views[0][700].fill_(3.0)  # group 1 is usable now
    assert float(views[0][700].sum()) == 3.0 * TOKENS * HEADS * DIM * 2
    syncs = getattr(strict, "sync_calls", 0)
    wants.unback([1])
    assert region.sync() == (0, 1) and region.resident_bytes() == 4 * granularity
    assert (
        getattr(strict, "sync_calls", syncs + 1) == syncs + 1
    )  # waited for the device before unmapping
    assert float(views[1][3].min()) == 2.0  # group 0 kept
    assert region.sync() == (0, 0)
    wants.back([1])
    region.sync()
    assert float(views[0][700].abs().sum()) == 0  # new pages: nothing of before
    wants.close()
    region.close()
