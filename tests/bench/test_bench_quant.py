"""The harness's FP8 / INT8 mode, small: FP8 halves bytes per token and doubles the static
row's capacity for Llama-3-8B (per-token scales cost 32 bytes a row); BF16 agrees with itself
exactly and every quantized storage has a small nonzero error against it; the anchor rows
(transformers' QuantizedCache) run when optimum-quanto is installed and say so when not; the
perplexity rows run on a chat checkpoint. All from one `--mode quant --quick` run through the
harness's entry point, to its save (tests/bench/test_bench_e2e.py runs each other mode so)."""

import json

import pytest

pytest.importorskip("transformers")

from real_model import tiny_chat_checkpoint  # noqa: E402

from vmcache.bench import quant, real  # noqa: E402
from vmcache.bench.__main__ import main as bench_main  # noqa: E402


@pytest.mark.slow
def test_the_quick_run_saves_capacity_accuracy_and_perplexity_rows(tmp_path):
    args = ["--mode", "quant", "--quick", "--threads", "1", "--out", str(tmp_path / "out")]
    if real.available():  # the perplexity rows on a 2-layer model of the trained one's family
        args += ["--real-model", tiny_chat_checkpoint(tmp_path / "tiny-chat")]
    bench_main(args)
    (path,) = (tmp_path / "out").glob("quant-*.json")
    rows = json.loads(path.read_text())["rows"]
    cap = {(r["model"], r["allocator"]): r for r in rows if r["kind"] == "capacity"}
    assert cap["llama-3-8b:fp8", "static"]["vs_bf16"] >= 1.9
    fp8, tok = cap["llama-3-8b:fp8", "static"], cap["llama-3-8b:int8-token", "static"]
    assert tok["vs_bf16"] >= 1.9 and tok["max_concurrent_seqs"] < fp8["max_concurrent_seqs"]
    assert cap["llama-3-8b:fp8", "vm-token-2M"]["max_concurrent_seqs"] is not None
    acc = [r for r in rows if r["kind"] == "accuracy"]
    assert [r["storage"] for r in acc] == list(quant.STORAGES)
    base, *rest = acc
    assert base["logits_rel_err_max"] == 0 and base["greedy_agreement"] == 1
    for r in rest:
        if r["storage"].startswith("transformers"):
            if not quant.quanto_available():
                assert r["note"] == "optimum-quanto not installed"
                continue
            assert r["bytes_per_token"] is None  # its own packing: not our arithmetic
            assert r["logits_rel_err_median"] > 0  # the prompt is quantized at prefill
            continue
        elif r["storage"].endswith("per token"):  # 2 KV heads' fp32 scales padded to 16 B
            assert r["bytes_per_token"] == base["bytes_per_token"] // 2 + 2 * 4 * 16
        else:
            assert r["bytes_per_token"] * 2 == base["bytes_per_token"]
        assert 0 < r["logits_rel_err_median"] < 0.2
    if real.available():
        ppl = [r for r in rows if r["kind"] == "perplexity"]
        assert ppl and all(r["ppl"] > 1 for r in ppl)
