"""One OpenAI-compatible server under load, as benchmarks/bench_server.py drives it: the server in
a process group of its own (started, timed to ``/health``, paused while another runs, its CPU
seconds over every process of the group: vLLM's engine core and worker included), one streamed
chat request as the official ``openai`` client sees it, a load level of N concurrent clients,
and the medians over repeats."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.request

import openai

from vmcache.bench.compute_real import QUESTIONS, SYSTEM

OURS = ("vm", "paged")  # vmcache-server's two caches; the other servers are peers


def messages(i: int) -> list[dict]:
    q = QUESTIONS[i % len(QUESTIONS)]
    sys_ = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
    return sys_ + [{"role": "user", "content": q}]


class Proc:
    """A server in a session of its own: started, waited for (``/health``, the seconds it took
    kept as ``startup_s``), paused and resumed (SIGSTOP / SIGCONT to the whole group, so an idle
    server's polling threads take no CPU from the one measured), its CPU time, stopped."""

    def __init__(self, name: str, cmd: list[str], model: str, env: dict | None = None,
                 start_timeout_s: float = 600.0) -> None:  # fmt: skip
        self.name, self.model, self.port = name, model, int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = open(f"/tmp/bench_server-{name}.log", "w")
        t0 = time.perf_counter()
        self.p = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name} did not start (see {self.log.name})")
            time.sleep(0.2)
        self.startup_s = time.perf_counter() - t0
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=600)  # fmt: skip

    def _group(self) -> list[int]:
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                # the session id (start_new_session), zombies left out (nothing runs there)
                if int(fields[3]) == self.p.pid and fields[0] != "Z":
                    pids.append(int(d))
        return pids

    def cpu_s(self) -> float:
        """User and system seconds of every live process of the server's session."""
        total = 0
        for pid in self._group():
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def pause(self) -> None:
        os.killpg(self.p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.p.pid, signal.SIGCONT)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        # one model a server: its samples without their model_name label
        return {re.sub(r'\{model_name="[^"]*"\}$', "", ln.rsplit(" ", 1)[0]):
                float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("vmcache:")}  # fmt: skip

    def close(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGCONT)
            os.killpg(self.p.pid, signal.SIGTERM)
            self.p.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)
        deadline = time.monotonic() + 10
        while self._group() and time.monotonic() < deadline:  # its children go too
            for pid in self._group():
                try:
                    os.kill(pid, signal.SIGKILL if time.monotonic() > deadline - 5 else 0)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.log.close()


def one(srv: Proc, i: int, new: int) -> dict:
    """One streamed chat request: the client's timings (every content chunk's arrival), the
    text, the usage."""
    t0 = time.perf_counter()
    arrivals, text, usage, finish = [], [], None, None
    stream = srv.client.chat.completions.create(
        model=srv.model, messages=messages(i), max_tokens=new, temperature=0, stream=True,
        stream_options={"include_usage": True})  # fmt: skip
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                arrivals.append(time.perf_counter())
                text.append(c.delta.content)
            finish = c.finish_reason or finish
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else len(text)
    details = getattr(usage, "prompt_tokens_details", None)
    first = arrivals[0] if arrivals else None
    return {"i": i, "t0": t0, "ttft_s": (first or end) - t0, "end": end, "tokens": tokens,
            "tpot_s": (end - first) / (tokens - 1) if first and tokens > 1 else None,
            "itl_s": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "text": "".join(text), "finish": finish,
            "cached": (details.cached_tokens or 0) if details else 0}  # fmt: skip


def pct(xs, q) -> float:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def level(srv: Proc, others: list[Proc], clients: int, requests: int, new: int) -> dict:
    """One level on one server, the others paused (their CPU seconds are recorded: nothing
    while paused)."""
    peak = {"pages": 0.0, "running": 0.0}
    done = threading.Event()
    ours = srv.name in OURS

    def poll():
        while not done.wait(0.25):
            try:
                m = srv.metrics()
            except OSError:  # counted: a scrape must not fail under load
                peak["scrape_errors"] = peak.get("scrape_errors", 0) + 1
                continue
            peak["pages"] = max(peak["pages"], m["vmcache:kv_pages_used"])
            peak["running"] = max(peak["running"], m["vmcache:num_requests_running"])

    for o in others:
        o.pause()
    try:
        before = srv.metrics() if ours else {}
        poller = threading.Thread(target=poll, daemon=True) if ours else None
        idle0 = sum(o.cpu_s() for o in others)
        cpu0, t0 = srv.cpu_s(), time.perf_counter()
        if poller:
            poller.start()
        with cf.ThreadPoolExecutor(clients) as ex:
            res = list(ex.map(lambda i: one(srv, i, new), range(requests)))
        wall = time.perf_counter() - t0
        done.set()
        if poller:
            poller.join()
        cpu = srv.cpu_s() - cpu0
        idle = sum(o.cpu_s() for o in others) - idle0
    finally:
        for o in others:
            o.resume()
    itl = [x for r in res for x in r["itl_s"]]
    row = {"server": srv.name, "clients": clients, "requests": requests, "wall_s": wall,
           "req_per_s": requests / wall, "tok_per_s": sum(r["tokens"] for r in res) / wall,
           "ttft_p50_s": pct([r["ttft_s"] for r in res], 0.5),
           "ttft_p99_s": pct([r["ttft_s"] for r in res], 0.99),
           "tpot_p50_s": pct([r["tpot_s"] for r in res], 0.5),
           "tpot_p99_s": pct([r["tpot_s"] for r in res], 0.99),
           "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
           "server_cpu_s": cpu, "idle_servers_cpu_s": idle,
           "tokens": sum(r["tokens"] for r in res), "cached_tokens": sum(r["cached"] for r in res),
           "prompt_tokens": [r["prompt_tokens"] for r in res],
           "texts": [r["text"] for r in res]}  # fmt: skip
    if ours:
        after = srv.metrics()
        row.update(peak_pages=int(peak["pages"]), pages_total=int(after["vmcache:kv_pages_total"]),
                   peak_running=int(peak["running"]), scrape_errors=peak.get("scrape_errors", 0),
                   preemptions=int(after["vmcache:num_preemptions_total"]
                                   - before["vmcache:num_preemptions_total"]))  # fmt: skip
    return row


METRICS = ("req_per_s", "tok_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
           "itl_p50_s", "itl_p99_s")  # fmt: skip


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (server, clients): medians over repeats with min-max, answers and prompt
    token counts compared with the vm server's of the same repeat, ratios at each level."""
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
        same = [r["prompt_tokens"] == v["prompt_tokens"] for r, v in zip(rs, vm)]
        row["prompt_tokens_equal_to_vm"] = all(same) if same else None
        row["prompt_tokens"] = sum(rs[0]["prompt_tokens"])
        out.append(row)
    for row in out:  # ratios at each level, side by side in the same run
        peers = {r["server"]: r for r in out if r["clients"] == row["clients"]}
        vllm = [r for s, r in peers.items() if s.startswith("vllm")]
        best = max(vllm, key=lambda r: r["tok_per_s"]) if vllm else None
        base = peers.get("transformers")
        if row["server"] in OURS:
            if base:
                row["tok_per_s_vs_transformers"] = row["tok_per_s"] / base["tok_per_s"]
                row["ttft_p50_vs_transformers"] = row["ttft_p50_s"] / base["ttft_p50_s"]
            if best:
                row["vs_vllm"] = best["server"]
                row["tok_per_s_vs_vllm"] = row["tok_per_s"] / best["tok_per_s"]
                row["ttft_p99_vs_vllm"] = row["ttft_p99_s"] / best["ttft_p99_s"]
        if row["server"] == "paged" and "vm" in peers:
            row["paged_vs_vm_tok_per_s"] = row["tok_per_s"] / peers["vm"]["tok_per_s"]
    return out


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    keys = ("tok_per_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
    scales = (1, 1, 1e3, 1e3)
    for server in dict.fromkeys(r["server"] for r in rows):
        rs = sorted((r for r in rows if r["server"] == server), key=lambda r: r["clients"])
        x = [r["clients"] for r in rs]
        for ax, k, scale in zip(axes, keys, scales):
            ax.errorbar(x, [r[k] * scale for r in rs], marker="o", label=server,
                        yerr=[[(r[k] - r[k + "_min"]) * scale for r in rs],
                              [(r[k + "_max"] - r[k]) * scale for r in rs]])  # fmt: skip
    titles = ("output tokens/s", "TTFT p99 (s)", "inter-token latency p50 (ms)",
              "inter-token latency p99 (ms)")  # fmt: skip
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
