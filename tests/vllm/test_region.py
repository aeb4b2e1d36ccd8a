"""vmcache.vllm's memory and settings without vLLM: the layout vLLM's views make, a memfd
that is resident only where written and gives punched blocks back, the scheduler's handle on
it through /proc, the rendezvous file as untrusted input, and the settings' checks."""

import json
import os

import pytest
import torch

from vmcache.vllm import UnsupportedVllm, check_version
from vmcache.vllm.config import VllmKVConfig
from vmcache.vllm.region import (
    BlockLayout,
    HostKVRegion,
    UnsupportedLayout,
    open_worker_memory,
    rendezvous_path,
)

PAGE = os.sysconf("SC_PAGE_SIZE")


def views_like_vllm(buf: torch.Tensor, layers: int, blocks: int, block_elems: int):
    """vLLM's layer-major layout: layer l of block b at l * layer_stride + b * block_stride,
    each layer's view [blocks, 2, 32, heads * dim] (K and V inside the block)."""
    per_layer = blocks * block_elems
    f = buf.view(torch.float32)
    return [f[i * per_layer:(i + 1) * per_layer].view(blocks, 2, 32, block_elems // 64)
            for i in range(layers)]  # fmt: skip


def test_the_layout_of_vllms_views_is_one_segment_a_layer():
    region = HostKVRegion(3 * 5 * 4 * 2 * 32 * 48)
    views = views_like_vllm(region.tensor(region.nbytes), layers=3, blocks=5, block_elems=3072)
    lay = BlockLayout.from_views(views, region.base, 5, PAGE)
    assert len(lay.segments) == 3 and lay.block_bytes == 3 * 3072 * 4 and lay.group_blocks == 1
    assert lay.segments[1] == (5 * 3072 * 4, 3072 * 4, 3072 * 4)
    assert lay.extent == region.nbytes
    assert lay.ranges([2, 3]) == [(s[0] + 2 * s[1], 2 * s[1]) for s in lay.segments]
    with pytest.raises(ValueError, match="outside"):
        lay.ranges([5])


def test_blocks_smaller_than_a_page_are_given_back_in_groups_or_refused_by_name():
    region = HostKVRegion(PAGE * 16)
    buf = region.tensor(region.nbytes).view(torch.float32)
    views = [buf[i * 64 * 96:(i + 1) * 64 * 96].view(64, 2, 48) for i in range(2)]  # fmt: skip
    lay = BlockLayout.from_views(views, region.base, 64, PAGE)  # 384-byte blocks
    assert lay.group_blocks == 32 and lay.num_groups == 2 and lay.group_bytes == 2 * 32 * 384
    assert lay.ranges([1]) == [(32 * 384, 32 * 384), (64 * 384 + 32 * 384, 32 * 384)]
    odd = [buf[i * 40 * 96:(i + 1) * 40 * 96].view(40, 2, 48) for i in range(2)]  # fmt: skip
    with pytest.raises(UnsupportedLayout, match="multiple of 32"):  # layer 1 starts mid-page
        BlockLayout.from_views(odd, region.base, 40, PAGE)
    with pytest.raises(UnsupportedLayout, match="does not hold 3 blocks"):
        BlockLayout.from_views(views, region.base, 3, PAGE)


def rss_shmem_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem"))


def test_memory_is_resident_only_where_written_and_punched_blocks_go_back(tmp_path):
    blocks, block_elems = 16, 2 * PAGE  # 8 KiB pages of floats... 2 pages a block a layer
    region = HostKVRegion(2 * blocks * block_elems * 4)
    views = views_like_vllm(region.tensor(region.nbytes), 2, blocks, block_elems)
    lay = BlockLayout.from_views(views, region.base, blocks, PAGE)
    assert region.resident_bytes() == 0
    before = rss_shmem_kib()
    for v in views:
        v[3:7].fill_(1.5)
    assert region.resident_bytes() == 4 * lay.block_bytes
    assert rss_shmem_kib() - before >= 4 * lay.block_bytes // 1024
    path = rendezvous_path("test" + str(os.getpid()), 0)
    region.publish(path, lay)
    assert (path.stat().st_mode & 0o777) == 0o600 and (path.parent.stat().st_mode & 0o777) == 0o700
    puncher = open_worker_memory(path)  # the scheduler's side: the same memfd through /proc
    assert not path.exists() and puncher.layout == lay and puncher.punch is not None
    puncher.unback([3, 4])
    assert region.resident_bytes() == 2 * lay.block_bytes == puncher.resident_bytes()
    assert float(views[1][3].abs().sum()) == 0 and float(views[1][5].min()) == 1.5
    puncher.close()


H = '"kind": "host", '


@pytest.mark.parametrize("body, match", [
    ("[]", "not a vmcache rendezvous"),
    ('{"kind": "other", "pid": 1, "fd": 3, "nbytes": 4096, "num_blocks": 1, "page_bytes": 4096, '
     '"segments": [[0, 4096, 4096]]}', "not a vmcache rendezvous"),
    ("{" + H + '"pid": 1, "fd": -1, "nbytes": 4096, "num_blocks": 1, "page_bytes": 4096, '
     '"segments": []}', "not a vmcache rendezvous"),
    ("{" + H + '"pid": 1, "fd": 3, "nbytes": 4096, "num_blocks": 1, "page_bytes": 4096, '
     '"segments": [[0]]}', "malformed segments"),
    ("{" + H + '"pid": 1, "fd": 3, "nbytes": 4096, "num_blocks": 2, "page_bytes": 4096, '
     '"segments": [[0, 4096, 4096]]}', "past the KV memory's end"),
    ('{"kind": "groups", "pid": 1, "fd": 3, "nbytes": 5, "num_blocks": 2, "page_bytes": 4096, '
     '"segments": [[0, 4096, 4096]]}', "5 bytes for 2 groups"),
])  # fmt: skip
def test_a_bad_rendezvous_file_is_refused(tmp_path, body, match):
    p = tmp_path / "r.json"
    p.write_text(body)
    with pytest.raises(ValueError, match=match):
        open_worker_memory(p)
    p.write_bytes(b" " * (5 << 20))
    with pytest.raises(ValueError, match="larger"):
        open_worker_memory(p)
    with pytest.raises(RuntimeError, match="--worker-cls"):
        open_worker_memory(tmp_path / "absent.json")


def test_a_dead_workers_descriptor_is_refused(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"kind": "host", "pid": 2**22 + 7, "fd": 3, "nbytes": PAGE,
                             "num_blocks": 1, "page_bytes": PAGE,
                             "segments": [[0, PAGE, PAGE]]}))  # fmt: skip
    with pytest.raises(RuntimeError, match="cannot open the vLLM worker's KV memory"):
        open_worker_memory(p)


def test_settings_are_checked():
    assert VllmKVConfig.from_additional(None) == VllmKVConfig()
    raw = {"vmcache": {"ledger": "/x", "budget_mib": 64, "floor_mib": 8}}
    cfg = VllmKVConfig.from_additional(raw)
    assert cfg.blocks(64, 2**20) == 64
    for bad, match in [({"vmcache": {"budget": 1}}, "unknown vmcache settings"),
                       ({"vmcache": {"budget_mib": -1}}, "non-negative"),
                       ({"vmcache": {"budget_mib": True}}, "non-negative"),
                       ({"vmcache": {"floor_mib": 4}}, "needs vmcache.ledger"),
                       ({"vmcache": {"chunk_blocks": 0}}, "chunk_blocks"),
                       ({"vmcache": {"name": ""}}, "name")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            VllmKVConfig.from_additional(bad)
    with pytest.raises(TypeError):
        VllmKVConfig.from_additional({"vmcache": [1]})


def test_an_untested_vllm_is_refused_by_version():
    check_version("0.32.0")
    with pytest.raises(UnsupportedVllm, match="not 0.33.0"):
        check_version("0.33.0")
    with pytest.raises(ValueError, match="instance id"):
        rendezvous_path("../etc", 0)
