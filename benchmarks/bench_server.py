"""The OpenAI-compatible server under load, beside ``transformers serve``: N concurrent
streaming clients (the official ``openai`` client, one thread each) send chat requests from
real questions (every other one behind a long shared system prompt) to three servers on the
trained SmolLM2-135M-Instruct, each its own process on this machine:

    vm            vmcache-server --cache vm      (VMKVCache, prefix caching on)
    paged         vmcache-server --cache paged   (PagedKVCache, prefix caching on)
    transformers  transformers serve --continuous-batching (its paged cache), the same KV
                  bytes (--cb-num-blocks) and step token budget (--cb-max-batch-tokens)

Greedy, at most 64 new tokens, stop at EOS; levels 1 / 4 / 16 / 64 concurrent clients
sending 8 / 16 / 32 / 64 requests; the servers take turns at every level (order rotated
per repeat), medians over repeats with min-max. Per level: requests/s and output tokens/s
(the wall clock from the first send to the last byte), TTFT and TPOT p50 / p99 as the
client sees them, the server process's CPU seconds; on vmcache's, peak pages in use and
running sequences (``/metrics`` polled every 0.25 s), preemptions and prompt tokens served
from the prefix cache. Answers are compared with the vm server's, request by request.

Then a soak (``--soak N``, in this process, so the cache can be inspected): N requests from
32 clients to a server of two models on one KV budget (the trained model served as two
names, requests alternating), random lengths, 30 % of the streams closed after a random
number of chunks;
it ends when the engine is idle, and checks every page not held by the prefix index is back
in the pool, the cache's invariants, that every request ended exactly once (answered or
aborted, counted by ``/metrics``), and that the engine keeps no record of any.

    python benchmarks/bench_server.py [--repeats 2] [--levels 1,4,16,64] [--soak 1500]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import torch
from common import add_out_arg, save

from vmcache.bench.compute_real import QUESTIONS, SYSTEM
from vmcache.bench.real import NAME
from vmcache.sequences.invariants import check_invariants

LEVELS = {1: 8, 4: 16, 16: 32, 64: 64}  # concurrent clients -> requests sent
NEW = 64
POOL_MIB = 512
SERVED = "smollm2-135m-instruct"


def messages(i: int) -> list[dict]:
    q = QUESTIONS[i % len(QUESTIONS)]
    sys_ = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
    return sys_ + [{"role": "user", "content": q}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server in its own process: started, waited for (``/health``), its CPU time."""

    def __init__(self, name: str, cmd: list[str], model: str, start_timeout_s=300.0) -> None:
        self.name, self.model, self.port = name, model, int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
        self.log = open(f"/tmp/bench_server-{name}.log", "w")
        self.p = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (see {self.log.name})")
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=600)  # fmt: skip

    def cpu_s(self) -> float:
        fields = open(f"/proc/{self.p.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        # one model a server: its samples without their model_name label
        return {re.sub(r'\{model_name="[^"]*"\}$', "", ln.rsplit(" ", 1)[0]):
                float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("vmcache:")}  # fmt: skip

    def close(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


def start_servers(names: list[str]) -> dict[str, Proc]:
    from vmcache import KVSpec
    from vmcache.models import checkpoint_dir

    out = {}
    for name in names:
        port = str(free_port())
        if name == "transformers":
            ckpt = str(checkpoint_dir(SERVED))
            import transformers

            spec = KVSpec.from_hf_config(transformers.AutoConfig.from_pretrained(ckpt))
            blocks = POOL_MIB * 2**20 // (32 * spec.bytes_per_token)
            exe = shutil.which("transformers", path=os.path.dirname(sys.executable))
            cmd = [exe, "serve", ckpt, "--continuous-batching", "--device", "cpu", "--dtype",
                   "float32", "--host", "127.0.0.1", "--port", port, "--cb-block-size", "32",
                   "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens", "2048"]  # fmt: skip
            out[name] = Proc(name, cmd, ckpt)
        else:
            cmd = [sys.executable, "-m", "vmcache.server", "--cache", name, "--port", port,
                   "--max-seqs", "64", "--max-seq-len", "1024", "--pool-mib", str(POOL_MIB),
                   "--max-batch-tokens", "2048", "--threads", "2"]  # fmt: skip
            out[name] = Proc(name, cmd, SERVED)
        for i in range(2):  # warm-up (transformers' first request starts its manager)
            one(out[name], i, 8)
    return out


def one(srv: Proc, i: int, new: int = NEW) -> dict:
    """One streamed chat request: the client's timings, the text, the usage."""
    t0 = time.perf_counter()
    first = end = None
    text, usage, finish = [], None, None
    stream = srv.client.chat.completions.create(
        model=srv.model, messages=messages(i), max_tokens=new, temperature=0, stream=True,
        stream_options={"include_usage": True})  # fmt: skip
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                first = first or time.perf_counter()
                text.append(c.delta.content)
            finish = c.finish_reason or finish
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else len(text)
    details = getattr(usage, "prompt_tokens_details", None)
    return {"i": i, "t0": t0, "ttft_s": (first or end) - t0, "end": end, "tokens": tokens,
            "tpot_s": (end - first) / (tokens - 1) if first and tokens > 1 else None,
            "text": "".join(text), "finish": finish,
            "cached": (details.cached_tokens or 0) if details else 0}  # fmt: skip


def pct(xs, q) -> float:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def level(srv: Proc, others: list[Proc], clients: int, requests: int) -> dict:
    """One level on one server (the others idle: their CPU seconds are recorded)."""
    peak = {"pages": 0.0, "running": 0.0}
    done = threading.Event()
    ours = srv.name != "transformers"

    def poll():
        while not done.wait(0.25):
            try:
                m = srv.metrics()
            except OSError:  # counted: a scrape must not fail under load
                peak["scrape_errors"] = peak.get("scrape_errors", 0) + 1
                continue
            peak["pages"] = max(peak["pages"], m["vmcache:kv_pages_used"])
            peak["running"] = max(peak["running"], m["vmcache:num_requests_running"])

    before = srv.metrics() if ours else {}
    poller = threading.Thread(target=poll, daemon=True) if ours else None
    idle0 = sum(o.cpu_s() for o in others)
    cpu0, t0 = srv.cpu_s(), time.perf_counter()
    if poller:
        poller.start()
    with cf.ThreadPoolExecutor(clients) as ex:
        res = list(ex.map(lambda i: one(srv, i), range(requests)))
    wall = time.perf_counter() - t0
    done.set()
    if poller:
        poller.join()
    row = {"server": srv.name, "clients": clients, "requests": requests, "wall_s": wall,
           "req_per_s": requests / wall, "tok_per_s": sum(r["tokens"] for r in res) / wall,
           "ttft_p50_s": pct([r["ttft_s"] for r in res], 0.5),
           "ttft_p99_s": pct([r["ttft_s"] for r in res], 0.99),
           "tpot_p50_s": pct([r["tpot_s"] for r in res], 0.5),
           "tpot_p99_s": pct([r["tpot_s"] for r in res], 0.99),
           "server_cpu_s": srv.cpu_s() - cpu0, "idle_servers_cpu_s": sum(
               o.cpu_s() for o in others) - idle0,
           "tokens": sum(r["tokens"] for r in res), "cached_tokens": sum(r["cached"] for r in res),
           "texts": [r["text"] for r in res]}  # fmt: skip
    if ours:
        after = srv.metrics()
        row.update(peak_pages=int(peak["pages"]), pages_total=int(after["vmcache:kv_pages_total"]),
                   peak_running=int(peak["running"]), scrape_errors=peak.get("scrape_errors", 0),
                   preemptions=int(after["vmcache:num_preemptions_total"]
                                   - before["vmcache:num_preemptions_total"]))  # fmt: skip
    return row


METRICS = ("req_per_s", "tok_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (server, clients): medians over repeats with min-max, answers compared
    with the vm server's of the same repeat."""
    by: dict[tuple, list[dict]] = {}
    for r in runs:
        by.setdefault((r["server"], r["clients"]), []).append(r)
    out = []
    for (server, clients), rs in by.items():
        row = {"server": server, "clients": clients, "requests": rs[0]["requests"],
               "repeats": len(rs)}  # fmt: skip
        for k in METRICS:
            xs = [r[k] for r in rs]
            row.update({k: statistics.median(xs), f"{k}_min": min(xs), f"{k}_max": max(xs)})
        for k in ("server_cpu_s", "idle_servers_cpu_s", "tokens", "cached_tokens"):
            row[k] = statistics.median(r[k] for r in rs)
        for k in ("peak_pages", "pages_total", "peak_running", "preemptions", "scrape_errors"):
            if k in rs[0]:
                row[k] = max(r[k] for r in rs)
        vm = [r for r in runs if r["server"] == "vm" and r["clients"] == clients]
        equal = [sum(a == b for a, b in zip(r["texts"], v["texts"])) for r, v in zip(rs, vm)]
        row["equal_to_vm"] = min(equal) if equal else None
        out.append(row)
    for row in out:  # ratios at each level, side by side in the same run
        peers = {r["server"]: r for r in out if r["clients"] == row["clients"]}
        base = peers.get("transformers")
        if base and row["server"] != "transformers":
            row["tok_per_s_vs_transformers"] = row["tok_per_s"] / base["tok_per_s"]
            row["ttft_p50_vs_transformers"] = row["ttft_p50_s"] / base["ttft_p50_s"]
        if row["server"] == "paged" and "vm" in peers:
            row["paged_vs_vm_tok_per_s"] = row["tok_per_s"] / peers["vm"]["tok_per_s"]
    return out


SOAK_MODELS = ("soak-a", "soak-b")


def soak(n: int, clients: int = 32, seed: int = 0, cache: str = "vm", new: int = 12) -> dict:
    """``n`` requests against a two-model server in this process, random disconnects; then
    each model's engine and cache are inspected on its engine's thread."""
    from vmcache.bench.real import smol
    from vmcache.server.cli import Running, build_server, parse_args

    model, tok = smol()
    args = ["--no-compile", "--cache", cache, "--max-seqs", "32", "--kv-budget-mib", "128",
            "--max-waiting",
            str(2 * n + 64), "--max-seq-len", "1024",
            *(a for m in SOAK_MODELS for a in ("--model", f"{m}={SERVED}"))]  # fmt: skip
    server, _ = build_server(parse_args(args), model, tok)
    loops = [m.loop for m in server.models.values()]
    rng = random.Random(seed)
    plan = [(i, rng.randint(1, new), 2 if rng.random() < 0.1 else 1, rng.random() < 0.7,
             rng.randint(0, 3) if rng.random() < 0.3 else None) for i in range(n)]  # fmt: skip
    t0 = time.perf_counter()
    with Running(server) as running:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0,
                               timeout=600)  # fmt: skip

        def go(p):
            i, max_tokens, n_, stream, close_after = p
            kw = dict(model=SOAK_MODELS[i % 2], messages=messages(i), max_tokens=max_tokens, n=n_,
                      temperature=0.8, seed=i)  # fmt: skip
            if not stream:
                r = client.chat.completions.create(**kw)
                return r.id, sorted(c.index for c in r.choices if c.finish_reason), False
            s = client.chat.completions.create(**kw, stream=True)
            rid, ends, chunks = None, [], 0
            for ch in s:
                rid = ch.id
                ends += [c.index for c in ch.choices if c.finish_reason]
                chunks += 1
                if close_after is not None and chunks > close_after and len(ends) < n_:
                    s.close()  # the client goes away mid-stream
                    return rid, sorted(ends), True
            return rid, sorted(ends), False

        with cf.ThreadPoolExecutor(clients) as ex:
            res = list(ex.map(go, plan))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while any(lp.query(lambda e: e.scheduler.has_work() or bool(e.outputs)) for lp in loops):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)

        def inspect_(e):
            kv = e.kv
            check_invariants(kv)
            return {"pages_used_after": kv.capacity.used_pages,
                    "prefix_cached_pages": kv.prefix.index.stats().cached_pages,
                    "sequences_after": len(kv.sequences), "engine_records_after": len(e.outputs),
                    "swap_bytes_held": kv.swap.held_bytes, "invariants": "held"}  # fmt: skip

        states = [lp.query(inspect_) for lp in loops]
        state = {k: sum(st[k] for st in states) for k in states[0] if k != "invariants"}
        state["invariants"] = "held"
        reg = server.metrics.registry
        ended = {why: sum(int(reg.get_sample_value("vmcache:request_success_total",
                                                   {"finished_reason": why, "model_name": m})
                              or 0) for m in SOAK_MODELS)
                 for why in ("stop", "length", "abort", "error")}  # fmt: skip
    closed = sum(c for _, _, c in res)
    answered = [(rid, ends) for (rid, ends, c), p in zip(res, plan) if not c]
    whole = sum(ends == list(range(p[2])) for (rid, ends, c), p in zip(res, plan) if not c)
    ids = [rid for rid, _, _ in res if rid]
    row = {"cache": cache, "models": len(SOAK_MODELS), "requests": n, "clients": clients,
           "wall_s": wall,
           "req_per_s": n / wall, "closed_mid_stream": closed, "answered": len(answered),
           "answered_whole": whole, "duplicate_ids": len(ids) - len(set(ids)),
           **{f"ended_{k}": v for k, v in ended.items()}, **state}  # fmt: skip
    row["every_request_ended_once"] = sum(ended.values()) == n and whole == len(answered)
    row["pages_back"] = state["pages_used_after"] == state["prefix_cached_pages"]
    return row


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for server in dict.fromkeys(r["server"] for r in rows):
        rs = sorted((r for r in rows if r["server"] == server), key=lambda r: r["clients"])
        x = [r["clients"] for r in rs]
        for ax, k, scale in zip(axes, ("tok_per_s", "ttft_p50_s", "tpot_p50_s"), (1, 1, 1e3)):
            ax.errorbar(x, [r[k] * scale for r in rs], marker="o", label=server,
                        yerr=[[(r[k] - r[k + "_min"]) * scale for r in rs],
                              [(r[k + "_max"] - r[k]) * scale for r in rs]])  # fmt: skip
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (s)", "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    global NEW
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--servers", default="vm,paged,transformers")
    ap.add_argument("--soak", type=int, default=1500, help="soak requests a cache (0: none)")
    ap.add_argument("--quick", action="store_true", help="2 clients, 2 requests, 8 tokens")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    levels = {2: 2} if args.quick else {c: LEVELS[c] for c in map(int, args.levels.split(","))}
    NEW = 8 if args.quick else NEW
    names = args.servers.split(",") if args.servers else []
    servers = start_servers(names)
    runs = []
    try:
        for rep in range(args.repeats if names else 0):
            for clients, requests in levels.items():
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    others = [servers[o] for o in names if o != name]
                    runs.append(level(servers[name], others, clients, requests))
                    r = runs[-1]
                    print(f"rep {rep} {name:12s} {clients:3d} clients: {r['tok_per_s']:7.1f} "
                          f"tok/s, TTFT p50 {r['ttft_p50_s']:.2f} s, TPOT p50 "
                          f"{1e3 * (r['tpot_p50_s'] or 0):.0f} ms", flush=True)  # fmt: skip
    finally:
        for s in servers.values():
            s.close()
    rows = summarize(runs)
    soaks = []
    for cache in ("vm", "paged") if args.soak else ():
        soaks.append(soak(args.soak, new=4 if args.quick else 8, cache=cache))
        print("soak", soaks[-1], flush=True)
    extra = {"model": NAME, "threads": 2, "dtype": "float32", "new_tokens": NEW,
             "pool_mib": POOL_MIB, "levels": [[c, r] for c, r in levels.items()],
             "repeats": args.repeats, "quick": args.quick, "soak": soaks,
             "transformers": __import__("transformers").__version__}  # fmt: skip
    path = save("server", torch.device("cpu"), rows, extra, Path(args.out))
    print(f"saved {path}")
    if rows:
        try:
            plot(rows, path.with_suffix(".png"))
        except ImportError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
