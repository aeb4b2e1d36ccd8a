"""benchmarks/bench_server.py's soak, short, through its own path to the saved JSON: requests
with random lengths, forks and streams closed mid-way against a two-model server (one KV budget)
on each cache; every request ends exactly once and every page not held by the prefix index comes
back (the full run, thousands of requests beside transformers serve, is `make bench-server`)."""

import json
import sys

import pytest
from real_model import smol
from repo import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_server  # noqa: E402


@pytest.mark.slow
def test_the_soak_gives_every_page_back_and_ends_every_request_once(tmp_path):
    smol()  # skips unless the embedded model is fetched
    assert bench_server.main(["--quick", "--servers", "", "--soak", "40", "--out",
                              str(tmp_path)]) == 0  # fmt: skip
    (path,) = tmp_path.glob("server-*.json")
    doc = json.loads(path.read_text())
    assert [r["cache"] for r in doc["soak"]] == ["vm", "paged"]
    assert all(r["models"] == 2 for r in doc["soak"])  # one KV budget, two models
    for r in doc["soak"]:
        assert r["every_request_ended_once"] and r["pages_back"], r
        assert r["closed_mid_stream"] > 0 and r["duplicate_ids"] == 0
        assert r["sequences_after"] == r["engine_records_after"] == r["swap_bytes_held"] == 0
        assert sum(r[f"ended_{k}"] for k in ("stop", "length", "abort", "error")) == 40
        assert r["ended_error"] == 0
