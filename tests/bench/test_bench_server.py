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


def _run(server, clients, tok_per_s, ttft_p99_s, texts, prompts):
    from server_load import METRICS

    row = {k: 0.05 for k in METRICS}
    row.update(server=server, clients=clients, requests=len(texts), tok_per_s=tok_per_s,
               ttft_p99_s=ttft_p99_s, ttft_p50_s=ttft_p99_s / 2, server_cpu_s=1.0,
               idle_servers_cpu_s=0.0, tokens=64, cached_tokens=0, texts=texts,
               prompt_tokens=prompts)  # fmt: skip
    return row


def test_the_summary_judges_against_the_faster_vllm_binding_and_compares_answers():
    from server_load import summarize

    runs = [_run("vm", 16, 300.0, 1.0, ["a", "b"], [10, 20]),
            _run("vllm-0", 16, 200.0, 2.0, ["a", "b"], [10, 20]),
            _run("vllm-0-1", 16, 240.0, 0.8, ["a", "x"], [10, 21]),
            _run("transformers", 16, 100.0, 3.0, ["a", "b"], [10, 20])]  # fmt: skip
    rows = {r["server"]: r for r in summarize(runs)}
    vm = rows["vm"]
    assert vm["vs_vllm"] == "vllm-0-1" and vm["tok_per_s_vs_vllm"] == 300.0 / 240.0
    assert vm["ttft_p99_vs_vllm"] == 1.0 / 0.8  # the faster binding's, not the better TTFT's
    assert vm["tok_per_s_vs_transformers"] == 3.0
    assert (
        rows["vllm-0-1"]["equal_to_vm"] == 1 and not rows["vllm-0-1"]["prompt_tokens_equal_to_vm"]
    )
    assert rows["vllm-0"]["equal_to_vm"] == 2 and rows["vllm-0"]["prompt_tokens_equal_to_vm"]
    assert "tok_per_s_vs_vllm" not in rows["vllm-0"]  # peers are not judged against peers


def test_a_server_process_group_is_timed_paused_and_stopped(tmp_path):
    import socket
    import time

    from server_load import Proc

    (tmp_path / "health").write_text("ok")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a server whose child spins (as vLLM's engine core polls): the group's CPU time counts
    # the child's; paused, nothing of it runs; closed, none of it is left
    code = (f"import os, http.server as h; os.chdir({str(tmp_path)!r}); "
            "os.fork() or [0 for _ in iter(int, 1)]; "
            f"h.ThreadingHTTPServer(('127.0.0.1', {port}), "
            "h.SimpleHTTPRequestHandler).serve_forever()")  # fmt: skip
    srv = Proc("probe", [sys.executable, "-c", code, "--port", str(port)], "none",
               start_timeout_s=30)  # fmt: skip
    try:
        assert srv.startup_s > 0 and len(srv._group()) == 2  # the server and its child
        a = srv.cpu_s()
        time.sleep(0.5)
        assert srv.cpu_s() - a >= 0.2
        srv.pause()
        time.sleep(0.1)
        a = srv.cpu_s()
        time.sleep(0.5)
        assert srv.cpu_s() - a <= 0.05
        srv.resume()
    finally:
        srv.close()
    assert srv.p.poll() is not None and not srv._group()
