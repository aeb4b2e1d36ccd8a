"""The harness's prefix-tier workload, small: the tiers serve what a small pool evicts (the
hit rate of a pool that holds everything), and the answers do not change."""

import pytest

pytest.importorskip("transformers")

from vmcache.bench import tiers  # noqa: E402


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_tiers_recover_what_a_small_pool_evicts(kind):
    m = tiers.model()
    args = (m, 6, 3)  # 6 conversations of 3 turns: about 1,200 tokens against a 256-token pool
    none = tiers.run(kind, "none", *args, pool_tokens=256)
    disk = tiers.run(kind, "host+disk", *args, pool_tokens=256)
    ref = tiers.run(kind, "none, 8x pool", *args, pool_tokens=256)
    assert none["hit_rate"] < disk["hit_rate"] == ref["hit_rate"]
    assert disk["prefill_tokens"] == ref["prefill_tokens"] < none["prefill_tokens"]
    assert disk["promoted_host_pages"] + disk["promoted_disk_pages"] > 0
    assert disk["answers"] == none["answers"] == ref["answers"]
