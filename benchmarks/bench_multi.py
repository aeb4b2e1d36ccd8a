"""Several models on one KV budget against the static split users run today, on kvcached's own
workload scaled to this machine (``make bench-multi``).

    python benchmarks/bench_multi.py [--peaks 2,3,4] [--repeats 2] [--budget-mib 120]

Workload (kvcached's "intermittent peaks", scaled): three models (the embedded SmolLM2-135M-
Instruct served under three names, fp32). Per model, a peak: the rate rises by 1 request/s
each second from 1 to P and falls back to 1 (P^2 requests in 2P - 1 seconds); the models'
peaks follow one another, never overlapping, and a model outside its peak sends 1 request/s.
Every request: --prompt random token ids (seeded), --output tokens generated greedily
(ignore_eos), streamed; TTFT is the time from its scheduled send to its first streamed token.

Systems, started in this script and fed the same arrivals (one client thread a request):
  shared   one vmcache-server of the three models on one KV budget (--budget-mib; each
           model's floor one --max-seq-len sequence)
  static   three single-model vmcache-servers, each with --pool-mib = budget / 3
Both on VMKVCache, eager, one torch thread a process (the static split's three processes and
the shared server's three engine threads: three threads on 2 cores either way), recompute
preemption, prefix caching off: random prompts share nothing, and a prompt that ends inside a
page would be published as a partial entry whose page the next token copies (a page per
layer and K/V: every sequence would copy its pages once, doubling what it needs).

The design question (one process, one engine thread a model): does one model's compute stall
another's requests worse than separate processes? After the peaks, m1's TTFT for short
requests one after another, idle and while m0 decodes 4 long ones, on both systems.

Memory, not compute, must bind at a peak: the script reports the KV bytes one sequence maps,
and how many sequences a third of the budget and the whole budget hold.

Reported per P and system: TTFT mean and p99 per model and over all requests, output tokens/s
(tokens / the span from the first send to the last token), preemptions; the ratio static /
shared of the p99 and the mean (median over --repeats, min-max); tokens compared request by
request between the systems; the capacity figure: the largest P at which shared's p99 stays
at or below the static split's p99 at the largest P (the grid's end when it holds there).
JSON to results/multi-<date>-<device>.json with a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai

MODELS = ("m0", "m1", "m2")
SERVED = "smollm2-135m-instruct"


def arrivals(peak: int, n_models: int = len(MODELS)) -> list[tuple[float, int]]:
    """(send time in s, model index), sorted: model k peaks in [k·W, (k+1)·W), W = 2P - 1,
    at 1, 2, .., P, .., 1 requests in its successive seconds (spread evenly in each); outside
    its peak it sends 1 request/s (at the middle of each second)."""
    width = 2 * peak - 1
    out = []
    for k in range(n_models):
        for s in range(n_models * width):
            if k * width <= s < (k + 1) * width:
                j = s - k * width
                rate = j + 1 if j < peak else 2 * peak - 1 - j
                out += [(s + i / rate, k) for i in range(rate)]
            else:
                out.append((s + 0.5, k))
    return sorted(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vmcache.server`` in its own process."""

    def __init__(self, flags: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "vmcache.server", "--port", str(self.port), *flags]
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"server exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("server did not start")

    def metric(self, name: str, model: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        key = f'vmcache:{name}{{model_name="{model}"}} '
        return sum(float(ln[len(key) :]) for ln in text.splitlines() if ln.startswith(key))

    def close(self) -> None:
        self.p.send_signal(signal.SIGINT)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


def common(args) -> list[str]:
    return ["--threads", str(args.threads), "--max-seq-len", str(args.max_seq_len),
            "--max-seqs", "32", "--max-waiting", "512", "--request-timeout-s", "900",
            "--no-prefix-caching",
            *(["--compile", "--compile-cache", args.compile_cache] if args.compile
              else ["--no-compile"])]  # fmt: skip


def start(system: str, args, logs: str) -> dict[str, Server]:
    if system == "shared":
        models = [a for m in MODELS for a in ("--model", f"{m}={SERVED}")]
        s = Server([*models, "--kv-budget-mib", str(args.budget_mib), *common(args)],
                   os.path.join(logs, "shared.log"))  # fmt: skip
        servers = {m: s for m in MODELS}
    else:
        servers = {m: Server(["--model", SERVED, "--served-model-name", m, "--pool-mib",
                              str(args.budget_mib / len(MODELS)), *common(args)],
                             os.path.join(logs, f"static-{m}.log"))
                   for m in MODELS}  # fmt: skip
    for s in set(servers.values()):
        s.wait()
    return servers


_CLIENTS: dict[str, openai.OpenAI] = {}  # one a server (httpx's pool is thread-safe)


def client(url: str) -> openai.OpenAI:
    if url not in _CLIENTS:
        _CLIENTS[url] = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                      timeout=900)  # fmt: skip
    return _CLIENTS[url]


def one(servers, model: str, ids: list[int], t_send: float, n_out: int) -> dict:
    c = client(servers[model].url)
    delay = t_send - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    sent = time.perf_counter()
    first, text = None, ""
    for ch in c.completions.create(model=model, prompt=ids, max_tokens=n_out, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
        if ch.choices and ch.choices[0].text and first is None:
            first = time.perf_counter()
        text += ch.choices[0].text if ch.choices else ""
    end = time.perf_counter()
    return {"model": model, "late_s": sent - t_send, "ttft_s": (first or end) - t_send,
            "end_s": end, "sent_s": t_send, "text": text, "tokens": n_out}  # fmt: skip


def run_load(servers, plan, prompts, n_out: int) -> list[dict]:
    t0 = time.perf_counter() + 1.0
    out: list[dict | None] = [None] * len(plan)

    def go(i):
        t, k = plan[i]
        out[i] = one(servers, MODELS[k], prompts[i], t0 + t, n_out)

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(plan))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def stall(servers, prompt: int, long_out: int, n_short: int = 12, n_long: int = 4,
          seed: int = 7) -> dict:  # fmt: skip
    """Does one model's compute stall another's requests? m0 serves ``n_long`` long requests
    (``prompt`` tokens, ``long_out`` generated) while m1 gets ``n_short`` short ones one
    after another (``prompt`` + 1): m1's TTFT, idle and under m0's load."""
    rng = random.Random(seed)
    ids = lambda: [rng.randrange(1000, 40000) for _ in range(prompt)]  # noqa: E731
    idle = [one(servers, "m1", ids(), time.perf_counter(), 1)["ttft_s"] for _ in range(n_short)]
    longs = [threading.Thread(target=one, daemon=True,
                              args=(servers, "m0", ids(), time.perf_counter(), long_out))
             for _ in range(n_long)]  # fmt: skip
    for th in longs:
        th.start()
    time.sleep(2.0)  # m0 decoding its batch
    loaded = [one(servers, "m1", ids(), time.perf_counter(), 1)["ttft_s"] for _ in range(n_short)]
    for th in longs:
        th.join()
    return {"m1_ttft_idle_median_s": statistics.median(idle),
            "m1_ttft_loaded_median_s": statistics.median(loaded),
            "m1_ttft_loaded_p90_s": sorted(loaded)[int(0.9 * (len(loaded) - 1))]}  # fmt: skip


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def summarize(system: str, peak: int, rep: int, res: list[dict], pre: dict) -> dict:
    ttft = [r["ttft_s"] for r in res]
    span = max(r["end_s"] for r in res) - min(r["sent_s"] for r in res)
    row = {"system": system, "peak": peak, "repeat": rep, "requests": len(res),
           "ttft_mean_s": statistics.fmean(ttft), "ttft_p99_s": p99(ttft),
           "tok_per_s": sum(r["tokens"] for r in res) / span,
           "late_max_s": max(r["late_s"] for r in res), "preemptions": pre}  # fmt: skip
    for m in MODELS:
        mine = [r["ttft_s"] for r in res if r["model"] == m]
        row[f"{m}_ttft_mean_s"], row[f"{m}_ttft_p99_s"] = statistics.fmean(mine), p99(mine)
    return row


def kv_arithmetic(args) -> dict:
    """What one sequence maps (VMKVCache, 64 KiB pages, SmolLM2's 30 layers x K/V, 3 KV heads
    of 64, fp32) against a third of the budget and the whole."""
    tokens = args.prompt + args.output
    row_bytes = 3 * 64 * 4
    pages = 2 * 30 * -(-tokens * row_bytes // 65536)
    seq = pages * 65536
    budget = int(args.budget_mib * 2**20)
    return {"tokens_a_sequence": tokens, "sequence_bytes": seq,
            "sequences_in_a_third": budget // 3 // seq, "sequences_in_the_budget": budget // seq,
            "floor_bytes": 2 * 30 * -(-args.max_seq_len * row_bytes // 65536) * 65536}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peaks", default="2,4,6,8", help="the peak rates P (requests/s)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-mib", type=float, default=26.25, help="7 sequences' pages")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens a request")
    ap.add_argument("--output", type=int, default=8, help="generated tokens a request")
    ap.add_argument("--max-seq-len", type=int, default=64, help="(the floor: one such sequence)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a server process")
    ap.add_argument(
        "--eager",
        dest="compile",
        action="store_false",
        help="the eager engine step (default: compiled, cached between starts)",
    )
    ap.add_argument("--compile-cache", default=os.path.expanduser("~/.cache/vmcache/bench-multi"))
    ap.add_argument("--out", default=os.environ.get("VMCACHE_RESULTS", "results"))
    args = ap.parse_args(argv)
    peaks = [int(p) for p in args.peaks.split(",")]
    os.makedirs(args.out, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="vmcache-bench-multi-")  # the servers' logs
    print("server logs in", logs, flush=True)
    kv = kv_arithmetic(args)
    print("kv", kv, flush=True)
    rows, texts = [], {}
    servers = {s: start(s, args, logs) for s in ("shared", "static")}
    try:
        for rep in range(args.repeats):
            for peak in peaks:
                plan = arrivals(peak)
                rng = random.Random(args.seed * 1000 + peak)
                prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt)] for _ in plan]
                order = ("shared", "static") if rep % 2 == 0 else ("static", "shared")
                for system in order:
                    before = {m: servers[system][m].metric("num_preemptions_total", m)
                              for m in MODELS}  # fmt: skip
                    res = run_load(servers[system], plan, prompts, args.output)
                    pre = {m: servers[system][m].metric("num_preemptions_total", m) - before[m]
                           for m in MODELS}  # fmt: skip
                    rows.append(summarize(system, peak, rep, res, pre))
                    texts[system, peak, rep] = [r["text"] for r in res]
                    print(json.dumps(rows[-1]), flush=True)
        long_out = args.max_seq_len - args.prompt
        stalls = {system: stall(servers[system], args.prompt, long_out)
                  for system in ("static", "shared")}  # fmt: skip
        print("stall", json.dumps(stalls), flush=True)
    finally:
        for group in servers.values():
            for s in set(group.values()):
                s.close()
    equal = {f"{p}/{r}": sum(a == b for a, b in zip(texts["shared", p, r], texts["static", p, r]))
             for p in peaks for r in range(args.repeats)}  # fmt: skip
    doc = report(args, peaks, rows, kv, equal, len(plan), stalls)
    print(json.dumps(doc["summary"], indent=1))
    return 0


def report(args, peaks, rows, kv, equal, n_last, stalls) -> dict:
    import platform
    from pathlib import Path

    import torch

    from vmcache.bench.common import save_and_plot

    summary = []
    for p in peaks:
        by = {s: [r for r in rows if r["system"] == s and r["peak"] == p]
              for s in ("shared", "static")}  # fmt: skip
        ratios = [st["ttft_p99_s"] / sh["ttft_p99_s"] for sh, st in zip(by["shared"], by["static"])]
        mean_ratios = [st["ttft_mean_s"] / sh["ttft_mean_s"]
                       for sh, st in zip(by["shared"], by["static"])]  # fmt: skip
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        summary.append({"peak": p, "requests": by["shared"][0]["requests"],
                        "p99_ratio": statistics.median(ratios), "p99_ratio_min": min(ratios),
                        "p99_ratio_max": max(ratios), "mean_ratio": statistics.median(mean_ratios),
                        **{f"{s}_{k}": med(by[s], k) for s in by
                           for k in ("ttft_mean_s", "ttft_p99_s", "tok_per_s")},
                        **{f"{s}_{m}_{k}": med(by[s], f"{m}_{k}") for s in by for m in MODELS
                           for k in ("ttft_mean_s", "ttft_p99_s")},
                        "shared_preemptions": sum(sum(r["preemptions"].values())
                                                  for r in by["shared"]),
                        "static_preemptions": sum(sum(r["preemptions"].values())
                                                  for r in by["static"])})  # fmt: skip
    base = summary[-1]["static_ttft_p99_s"]  # the static split at the largest P
    holds = [s["peak"] for s in summary if s["shared_ttft_p99_s"] <= base]
    extra = {"cpu": platform.processor() or platform.machine(), "args": vars(args), "kv": kv,
             "summary": summary, "tokens_equal": equal, "requests_a_run": n_last,
             "capacity_peak": max(holds) if holds else None,
             "capacity_base_p99_s": base, "stall": stalls}  # fmt: skip
    out = Path(args.out)
    save_and_plot("multi", torch.device("cpu"), rows, extra, out, lambda _, png: plot(summary, png))
    return extra


def plot(summary, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary
    x = [r["peak"] for r in s]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for system in ("static", "shared"):
        axes[0].plot(x, [r[f"{system}_ttft_p99_s"] for r in s], marker="o", label=system)
        axes[1].plot(x, [r[f"{system}_ttft_mean_s"] for r in s], marker="o", label=system)
    for ax, title in zip(axes, ("TTFT p99 (s)", "TTFT mean (s)")):
        ax.set_xlabel("peak rate P (requests/s)")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle("3 models, one KV budget (shared) vs a static split in thirds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
