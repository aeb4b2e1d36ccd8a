"""scripts/gpu_check.sh, dry run on the CPU: a fake nvidia-smi, a slow fake python and a short
deadline. It must record what the image has, never start a step that no longer fits (and
record it as skipped), fail when GPU tests are skipped, finish within its deadline and leave
a summary with every claim and a verdict. And docs/results.md's GPU section is rendered from the
committed summary (or says that nothing was measured)."""

import json
import os
import re
import subprocess
import sys
import tarfile
import time

import pytest
from repo import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_summary  # noqa: E402

STEPS = ["gpu_tests", "syncs", "bench_vmm", "bench_attention", "soak", "bench_hf", "ab_compute"]


def _fakes(tmp_path, smi=True):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi:
        f = bin_dir / "nvidia-smi"
        f.write_text("#!/bin/sh\necho 'NVIDIA H200, 570.00, 143771 MiB, 9.0'\n")
        f.chmod(0o755)
    slow_py = bin_dir / "slowpy"
    slow_py.write_text(f'#!/bin/sh\nsleep 1\nexec {sys.executable} "$@"\n')
    slow_py.chmod(0o755)
    return bin_dir, slow_py


def _run(tmp_path, bin_dir, py, deadline, **extra):
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "PY": str(py), "GPU_CHECK_DEADLINE": str(deadline), **extra}  # fmt: skip
    t0 = time.monotonic()
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    return res, time.monotonic() - t0, out


def _unpack(out, tmp_path):
    """What comes back from a device call: at most 8 plain files; here exactly two."""
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tar.gz", "summary.json"]
    work = tmp_path / "unpacked"
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        tar.extractall(work, filter="data")
    return work, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("why", ["no nvidia-smi", "no CUDA in torch"])
def test_a_failing_preflight_stops_within_seconds_and_says_why(tmp_path, why):
    bin_dir, _ = _fakes(tmp_path, smi=why != "no nvidia-smi")
    res, wall, out = _run(tmp_path, bin_dir, sys.executable, 480)
    assert res.returncode != 0 and wall < 60, (wall, res.stdout[-2000:])
    work, summary = _unpack(out, tmp_path)
    want = "nvidia-smi" if why == "no nvidia-smi" else "torch sees no CUDA"
    assert want in summary["stopped"], summary["stopped"]
    assert not (work / "steps.jsonl").read_text()  # no step was started
    if why != "no nvidia-smi":
        assert "gpu: NVIDIA H200" in (work / "preflight.txt").read_text()


@pytest.mark.slow
def test_dry_run_keeps_its_deadline_and_records_every_step(tmp_path):
    bin_dir, slow_py = _fakes(tmp_path)
    deadline = 45
    res, wall, out = _run(tmp_path, bin_dir, slow_py, deadline, GPU_CHECK_SKIP_INSTALL="1",
                          GPU_CHECK_FORCE="1")  # fmt: skip
    assert res.returncode != 0  # no GPU: tests skipped, benchmarks fail
    assert wall <= deadline + 5, wall
    work, summary = _unpack(out, tmp_path)
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    assert [s["name"] for s in steps] == STEPS
    ran = [s for s in steps if s["status"] != "skipped"]
    skipped = [s for s in steps if s["status"] == "skipped"]
    assert ran and skipped, steps  # the deadline cut the run short, and said so
    assert all(s["why"] == "deadline" for s in skipped)
    assert all(s["limit"] <= deadline - 15 for s in ran)
    pre = (work / "preflight.txt").read_text()
    assert "gpu: NVIDIA H200" in pre and re.search(r"Python.h: (present|missing)", pre)
    for name in ("gcc", "pytest", "flash-attn", "triton", "transformers", "cuda-bindings"):
        assert f"{name}:" in pre
    assert "skipped" in (work / "gpu_tests.log").read_text()
    assert "torch sees no CUDA" in summary["stopped"]  # forced on: still said
    assert [c["id"] for c in summary["claims"]] == [c[0] for c in gpu_summary.CLAIMS]
    by = {c["id"]: c["verdict"] for c in summary["claims"]}
    assert by["gpu_tests"] == "DIFFERS"  # every GPU test skipped is a failure, not a pass
    assert set(by.values()) <= {"agrees", "DIFFERS", "not measured"}
    assert summary["gpu"].startswith("NVIDIA H200")


def test_readme_gpu_section_is_rendered_from_the_summary():
    readme = open(os.path.join(ROOT, "docs", "results.md")).read()
    committed = sorted(
        p for p in os.listdir(os.path.join(ROOT, "benchmarks", "results"))
        if p.startswith("gpu-summary") and p.endswith(".json")
    )  # fmt: skip
    summary = None
    if committed:
        summary = json.load(open(os.path.join(ROOT, "benchmarks", "results", committed[-1])))
    assert gpu_summary.readme_section(summary) in readme


def test_readme_compile_table_is_rendered_from_the_committed_json():
    readme = open(os.path.join(ROOT, "docs", "results.md")).read()
    doc = json.load(open(os.path.join(ROOT, "benchmarks", "results", "compile_sm90.json")))
    table = gpu_summary.compile_table(doc)
    assert table in readme
    edited = table.replace("| 0 |", "| 1 |", 1)
    assert edited != table and edited not in readme  # a hand edit would be caught


def test_readme_coverage_table_is_rendered_from_the_committed_json():
    import render_reliability

    readme = open(os.path.join(ROOT, "docs", "results.md")).read()
    table = render_reliability.coverage_table(json.load(open(render_reliability.DEFAULT)))
    assert table in readme
