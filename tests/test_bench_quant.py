"""The harness's FP8 / INT8 mode, small: FP8 halves bytes per token and doubles the static
row's capacity for Llama-3-8B; BF16 agrees with itself exactly and every quantized storage
has a small nonzero error against it."""

import pytest

pytest.importorskip("transformers")

from vmcache.bench import quant  # noqa: E402


def test_capacity_and_accuracy_rows():
    cap = {(r["model"], r["allocator"]): r for r in quant.capacity_rows(60)}
    assert cap["llama-3-8b:fp8", "static"]["vs_bf16"] >= 1.9
    acc = quant.accuracy_rows(quant.model(), 4)
    assert [r["storage"] for r in acc] == list(quant.STORAGES)
    base, *rest = acc
    assert base["logits_rel_err_max"] == 0 and base["greedy_agreement"] == 1
    for r in rest:
        assert r["bytes_per_token"] * 2 == base["bytes_per_token"]
        assert 0 < r["logits_rel_err_median"] < 0.2
