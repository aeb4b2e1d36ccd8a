"""The A/B harness: allocator figures equal hand-computed values on a small fixed trace; the
CSV reader names the bad line; the sizing backend runs the caches' real bookkeeping."""

import json
import os

import pytest
import torch

from vmcache import KVSpec, VMKVCache
from vmcache.bench import traces
from vmcache.bench.__main__ import main as bench_main
from vmcache.bench.allocators import CacheAlloc, OrcaAlloc, StaticAlloc
from vmcache.bench.report import verdicts
from vmcache.bench.simulate import simulate
from vmcache.bench.sizing import make_alloc
from vmcache.memory.backends.sizing import SizingBackend
from vmcache.paged_fallback import PagedKVCache

# one K (or V) row of a token in one layer = 16 B; a token = 2 layers × K,V = 64 B
SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
BPT = 64


def allocators(budget=64 * 1024):
    vm = VMKVCache(SPEC, 16, 64, backend=SizingBackend(granularity=64), page_size=64,
                   pool_bytes=budget)  # 64 B pages = 4 tokens per (layer, K/V) row  # fmt: skip
    paged = PagedKVCache(SPEC, pool_bytes=budget, block_size=4, device="meta", max_seq_len=64,
                         max_seqs=16)  # fmt: skip
    return {"static": StaticAlloc(BPT, budget, l_max=16), "orca": OrcaAlloc(BPT, budget, 16, 4),
            "paged": CacheAlloc("paged", paged), "vm": CacheAlloc("vm", vm)}  # fmt: skip


def test_waste_matches_hand_computed_values():
    # two requests of 10 prompt tokens, 3 generated: snapshots after steps 0, 1 (10, 11 tokens
    # each); at step 2 both finish. Used: 20·64 + 22·64 = 2688 B over the two snapshots.
    trace = [traces.TraceRequest(10, 3), traces.TraceRequest(10, 3)]
    res = {k: simulate(a, trace) for k, a in allocators().items()}
    # paged B=4 / Orca ΔL=4 / VM 4-token pages: 3 granules of 4 tokens per sequence = 2 × 768 B
    for k in ("paged", "orca", "vm"):
        assert res[k]["internal_waste_pct"] == pytest.approx(100 * (3072 - 2688) / 3072)
        assert res[k]["reservation_waste_pct"] == 0
        assert res[k]["waste_tokens_per_seq"] == pytest.approx((3072 - 2688) / BPT / 4)
    # static: 2 slots of L_max = 16 tokens held at each snapshot
    assert res["static"]["reservation_waste_pct"] == pytest.approx(100 * (4096 - 2688) / 4096)
    assert res["static"]["internal_waste_pct"] == 0
    assert all(r["steps"] == 3 and r["max_concurrent_seqs"] == 2 for r in res.values())


def test_cow_saving_matches_hand_computed_values():
    # n = 2 on an 8-token prompt (2 full blocks shared), 3 generated: step 0 logical 4 blocks,
    # physical 2; step 1 logical 6 blocks, physical 4 (each sample's third block is private)
    trace = [traces.TraceRequest(8, 3, n=2)]
    res = {k: simulate(a, trace) for k, a in allocators().items()}
    for k in ("paged", "vm"):
        assert res[k]["cow_saving_pct"] == pytest.approx(100 * 1024 / 2560)
        assert res[k]["internal_waste_pct"] == pytest.approx(100 * (2560 - 2176) / 2560)
    assert res["static"]["cow_saving_pct"] == 0 and res["static"]["bytes_copied"] == 8 * BPT


def test_orca_fragmentation_stalls_and_nothing_is_lost():
    # a 48-token arena: three 16-token extents; freeing the middle one leaves holes of 16
    # tokens that a 20-token request cannot use although 32 tokens are free in total
    orca = OrcaAlloc(BPT, 48 * BPT, l_max=48, chunk=4)
    a, b, c = (orca.admit(16) for _ in range(3))
    orca.free(a)
    orca.free(c)
    assert orca.free_bytes() == 32 * BPT and not orca.can_admit(20)
    trace = [traces.TraceRequest(14, 2), traces.TraceRequest(14, 12), traces.TraceRequest(14, 2),
             traces.TraceRequest(28, 2)]  # fmt: skip
    r = simulate(OrcaAlloc(BPT, 48 * BPT, l_max=48, chunk=4), trace)
    assert r["frag_stalls"] >= 1 and r["steps"] > 12  # the last request waited, then ran


def test_beam_reorder_copies_on_static_and_remaps_on_caches():
    trace = [traces.TraceRequest(8, 6, beam=4)]
    res = {k: simulate(a, trace, seed=1) for k, a in allocators().items()}
    assert res["static"]["bytes_copied"] > res["paged"]["bytes_copied"]
    assert res["paged"]["cow_saving_pct"] > 30 and res["static"]["cow_saving_pct"] == 0


def test_csv_reader_names_the_bad_line(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("prompt_len,output_len,n,arrival_s\n500,200,1,0.5\n700,100,4,0.1\n")
    rows, skipped = traces.read_csv(good)
    assert skipped == 0
    assert [r.prompt_len for r in rows] == [700, 500] and rows[0].n == 4  # arrival order
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_len,output_len\n500,200\n500,abc\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: expected integers"):
        traces.read_csv(bad)
    neg = tmp_path / "neg.csv"
    neg.write_text("prompt_len,output_len\n0,5\n")
    with pytest.raises(ValueError, match=r"neg.csv:2: need prompt_len >= 1"):
        traces.read_csv(neg)
    hdr = tmp_path / "hdr.csv"
    hdr.write_text("prompt,output\n5,5\n")
    with pytest.raises(ValueError, match="header must name"):
        traces.read_csv(hdr)
    with pytest.raises(SystemExit):
        bench_main(["--mode", "sizing", "--trace", str(bad), "--out", str(tmp_path)])


def test_sizing_cli_on_a_user_trace(tmp_path, capsys):
    trace = tmp_path / "mine.csv"
    trace.write_text("prompt_len,output_len\n" + "600,40\n" * 20)
    bench_main(
        [
            "--mode",
            "sizing",
            "--trace",
            str(trace),
            "--budget-gb",
            "1",
            "--no-plot",
            "--rates",
            "20",
            "--out",
            str(tmp_path),
        ]
    )  # fmt: skip (two worker processes)
    out = capsys.readouterr().out
    assert "paged-16" in out and "vm-layer-2M" in out and "Poisson 20 req/s" in out
    assert "radix-paged-16" not in out  # a CSV carries no token ids: no prefix to find
    assert list(tmp_path.glob("ab-*.json"))


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_preemption_policies_account_for_what_they_move(policy):
    # a 40-token budget: two 12-token prompts growing by 12 each cannot both finish together
    trace = [traces.TraceRequest(12, 12), traces.TraceRequest(12, 12)]
    alloc = OrcaAlloc(BPT, 40 * BPT, l_max=40, chunk=4)
    r = simulate(alloc, trace, preemption=policy)
    assert r["preemptions"] >= 1 and r["steps"] > 12
    if policy == "swap":
        assert r["swap_bytes"] > 0 and r["recompute_tokens"] == 0 and r["prefill_tokens"] == 24
    else:
        assert r["swap_bytes"] == 0 and r["recompute_tokens"] > 0 and r["prefill_tokens"] > 24
    with pytest.raises(ValueError, match="preemption"):
        simulate(alloc, trace, preemption="drop")


def test_results_carry_their_provenance_and_no_machine_paths(tmp_path):
    from vmcache.bench.common import save

    out = save("probe", torch.device("cpu"), [{"x": 1}],
               {"args": {"trace": "/home/someone/traces/t.csv", "out": str(tmp_path)}},
               out_dir=tmp_path)  # fmt: skip
    doc = json.loads(out.read_text())
    assert len(doc["git_sha"] or "") == 40 and doc["git_dirty"] in (True, False)
    assert doc["cpu"] and doc["cores"] >= 1 and doc["packages"]["torch"]
    assert doc["args"]["trace"] == "t.csv" and not os.path.isabs(doc["args"]["out"])


class OverMapping(CacheAlloc):
    """Maps one page per row more than a sequence needs (pages reserved ahead count as the
    sequence's memory): the VM claim must then read DIFFERS."""

    def _ahead(self, h):
        self.kv.allocate(h, 0, ahead=32)  # the next page of every row, before it is needed

    def admit(self, tokens, ids=None):
        h = super().admit(tokens, ids)
        self._ahead(h)
        return h

    def grow(self, h, n, ids=None):
        super().grow(h, n, ids)
        self._ahead(h)


def _claim_row(alloc, trace, name="vm-layer-64K", tname="enterprise"):
    row = {"trace": tname, "rate_rps": None, "allocator": name, "model": "llama-3-8b",
           "requests": len(trace), **simulate(alloc, trace)}  # fmt: skip
    verdicts([row])
    return row


def test_a_vm_verdict_reads_differs_when_an_allocator_over_maps():
    spec = KVSpec.preset("llama-3-8b")
    trace = traces.builtin("enterprise", 12)
    honest = _claim_row(make_alloc("vm-layer-64K", spec, int(2e9)), trace)
    kv = make_alloc("vm-layer-64K", spec, int(2e9)).kv
    over = _claim_row(OverMapping("vm-layer-64K", kv), trace)
    assert honest["verdict"].startswith("agrees") and honest["seq_waste_max_tok"] < 32
    assert over["verdict"].startswith("DIFFERS") and over["seq_waste_max_tok"] >= 32
    # the mean alone would not have caught it: both stay within a few pages per sequence
    assert over["waste_tokens_per_seq"] < 3 * 32


def test_a_row_where_memory_never_binds_says_so():
    spec = KVSpec.preset("llama-3-8b")
    trace = traces.builtin("enterprise", 4)
    roomy = _claim_row(make_alloc("paged-16", spec, int(16e9)), trace, "paged-16")
    tight = _claim_row(make_alloc("paged-16", spec, int(0.5e9)), traces.builtin("enterprise", 30),
                       "paged-16")  # fmt: skip
    assert not roomy["memory_binding"] and "memory not binding" in roomy["verdict"]
    assert tight["memory_binding"] and "memory not binding" not in tight["verdict"]
    assert tight["mem_refusals"] > 0


def test_open_loop_arrivals_change_latency_not_work():
    """Arrivals spread out: requests wait less (TTFT), the same tokens are generated."""
    spec = KVSpec.preset("llama-3-8b")
    trace = traces.builtin("heavy", 60)
    burst = simulate(make_alloc("paged-16", spec, int(2e9)), trace)
    spread = simulate(make_alloc("paged-16", spec, int(2e9)), traces.with_rate(trace, 0.5))
    assert burst["generated_tokens"] == spread["generated_tokens"]
    assert spread["model_ttft_p50_s"] < burst["model_ttft_p50_s"]
    assert spread["modelled_s"] > 60 / 0.5 * 0.5  # the clock follows the arrivals


def test_chunked_prefill_keeps_every_step_within_the_token_budget():
    spec = KVSpec.preset("llama-3-8b")
    trace = [traces.TraceRequest(3000, 4), traces.TraceRequest(10, 4)]
    r = simulate(make_alloc("paged-16", spec, int(4e9)), trace, max_batch_tokens=512)
    assert r["prefill_tokens"] == 3010 and r["steps"] >= 3000 // 512


def test_sizing_cli_options(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_len,output_len\n" + "600,40\n" * 30 + "9000,10\n")
    bench_main(["--mode", "sizing", "--trace", str(trace), "--skip-long", "--sample", "10",
                "--allocators", "paged-16,vm-token-2M", "--rates", "", "--budget-gb", "1",
                "--no-plot", "--jobs", "1", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert "skipped 1 rows longer than --l-max 8192" in out and "vm-token-2M" in out
    doc = json.loads(next(tmp_path.glob("ab-*.json")).read_text())
    assert {r["allocator"] for r in doc["rows"]} == {"paged-16", "vm-token-2M"}
    assert all(r["requests"] == 10 for r in doc["rows"]) and doc["wall_s"] > 0
    with pytest.raises(SystemExit, match="unknown allocator 'paged-17x'"):
        bench_main(["--mode", "sizing", "--allocators", "paged-17x", "--out", str(tmp_path)])
