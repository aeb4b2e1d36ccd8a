"""``make lm-eval``: lm-evaluation-harness against vmcache-server, end to end, checked.

lm-evaluation-harness (PyPI ``lm_eval``, in its own venv) runs a 16-question multiple-choice
task from a local JSON file (``data/lm_eval_mc.jsonl``; no hub) through its
``local-completions`` model: batched prompts of token ids, ``echo`` with ``logprobs`` 1 and
``max_tokens`` 1, the requests its log-likelihood tasks send. The server runs here, on each
cache in turn, with the embedded SmolLM2-135M-Instruct. Every log-likelihood the harness got
is then compared with the model's own teacher-forced one (transformers, one forward pass over
context + continuation, split into tokens as the harness splits them): they must agree within
1e-4, and the harness's accuracy must equal the one those reference values give. Exit 1 when
anything differs. A summary goes to ``results/lm-eval-<date>.json``.

    python lm_eval_check.py --lm-eval-python ../.venv-lmeval/bin/python
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "lm_eval_mc.jsonl"
TASK = "vmcache_local_mc"
TOLERANCE = 1e-4
TIMEOUT_S = 900


def task_yaml(data: Path) -> str:
    return f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's split (``TemplateLM._encode_pair``): trailing spaces of the context move
    to the continuation; the continuation's tokens are the whole's after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    whole, ctx = enc(context + continuation), enc(context)
    return ctx, whole[len(ctx) :]


@torch.no_grad()
def teacher_forced(model, ctx: list[int], cont: list[int]) -> float:
    logits = model(torch.tensor([ctx + cont])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[len(ctx) + i - 1, t] for i, t in enumerate(cont)))


def run_harness(python: str, url: str, model_name: str, tokenizer_dir: Path, work: Path):
    """The harness's samples (one dict per question) from a run against ``url``."""
    out = work / "out"
    args = (f"model={model_name},base_url={url}/completions,tokenizer={tokenizer_dir},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
            "max_retries=1,timeout=300")  # fmt: skip
    cmd = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--tasks", TASK, "--include_path", str(work), "--batch_size", "8",
           "--output_path", str(out), "--log_samples"]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    subprocess.run(cmd, check=True, env=env, timeout=TIMEOUT_S)
    files = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    if not files:
        raise RuntimeError(f"the harness wrote no samples under {out}")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def pairs(sample: dict) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [(a[0], a[1]) for a in args]


def check(samples, model, tok) -> dict:
    diffs, right_ref, right_got = [], 0, 0
    for s in samples:
        got = [float(r[0][0]) for r in s["resps"]]
        ref = [teacher_forced(model, *encode_pair(tok, c, x)) for c, x in pairs(s)]
        diffs += [abs(a - b) for a, b in zip(got, ref)]
        target = int(s["target"])
        right_ref += max(range(len(ref)), key=ref.__getitem__) == target
        right_got += max(range(len(got)), key=got.__getitem__) == target
    return {"questions": len(samples), "loglikelihoods": len(diffs),
            "max_abs_diff": max(diffs), "acc_harness": right_got / len(samples),
            "acc_reference": right_ref / len(samples)}  # fmt: skip


def main(argv=None) -> int:
    from vmcache.models import DEFAULT_MODEL, checkpoint_dir, load
    from vmcache.server.cli import Running, build_server, parse_args

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lm-eval-python", required=True, help="a python with lm_eval[api]")
    p.add_argument("--caches", default="vm,paged")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    model, tok = load(DEFAULT_MODEL)
    tokenizer_dir = checkpoint_dir(DEFAULT_MODEL)
    version = subprocess.run([args.lm_eval_python, "-c", "import importlib.metadata as m; "
                              "print(m.version('lm_eval'))"], capture_output=True, text=True,
                             check=True, timeout=60).stdout.strip()  # fmt: skip
    report = {"when": datetime.date.today().isoformat(), "where": platform.platform(),
              "cpus": os.cpu_count(), "lm_eval": version, "model": DEFAULT_MODEL,
              "task": f"{TASK}: {DATA.name}", "tolerance": TOLERANCE, "caches": {}}  # fmt: skip
    ok = True
    for cache in args.caches.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            (work / f"{TASK}.yaml").write_text(task_yaml(DATA))
            server, _ = build_server(parse_args(["--cache", cache, "--pool-mib", "64"]),
                                     model, tok)  # fmt: skip
            t0 = time.perf_counter()
            with Running(server) as running:
                samples = run_harness(args.lm_eval_python, running.url, server.limits.model,
                                      tokenizer_dir, work)  # fmt: skip
            row = {**check(samples, model, tok), "seconds": round(time.perf_counter() - t0, 1)}
        same = row["max_abs_diff"] <= TOLERANCE and row["acc_harness"] == row["acc_reference"]
        row["verdict"] = "SAME" if same else "DIFFERS"
        ok &= row["verdict"] == "SAME"
        report["caches"][cache] = row
        print(f"{cache}: {row}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"lm-eval-{report['when']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}: {'SAME' if ok else 'DIFFERS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
