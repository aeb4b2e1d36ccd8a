"""The README's two commands timed as a newcomer meets them: a fresh `git clone` of this
checkout's HEAD, then `make test` and `make bench` there, each split into its set-up (the
venvs, installed from pip's cache as any second install is; the embedded model, fetched and
converted into ~/.cache/vmcache once a machine) and its work (the tests; the harness). Each
phase is a make target run alone in the clone, timed wall-clock, its exit status kept:

    make test   = make test-setup (set-up: both venvs side by side, the model), then
                  make test (the tests: both tiers)
    make bench  = make .venv-bench/.vmcache-installed (set-up), then make bench

Writes benchmarks/results/fresh_clone-<date>-<machine>.json (README.md's "fresh-clone"
block is rendered from it), and copies what `make bench` wrote in the clone (the harness's
ab-*.json and plots, made at the clone's commit) into benchmarks/results beside it. Run it
on an idle machine: anything else running slows both.

    python scripts/time_fresh_clone.py [--commands test,bench] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from vmcache.bench.common import add_out_arg, save  # noqa: E402

PHASES = {
    "test": [("set-up", ["make", "test-setup"]),
             ("tests", ["make", "test"])],
    "bench": [("set-up", ["make", ".venv-bench/.vmcache-installed"]),
              ("harness", ["make", "bench"])],
}  # fmt: skip


def run_phase(clone: Path, cmd: list[str], log: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=clone, stdout=f, stderr=subprocess.STDOUT,
                            timeout=3600).returncode  # fmt: skip
    return time.perf_counter() - t0, rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commands", default="test,bench", help="some of test,bench")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    commands = [c for c in args.commands.split(",") if c]
    if not commands or any(c not in PHASES for c in commands):
        ap.error(f"--commands takes some of {','.join(PHASES)}")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    rows, logs = [], Path(tempfile.mkdtemp(prefix="vmcache-fresh-clone-logs-"))
    with tempfile.TemporaryDirectory(prefix="vmcache-fresh-clone-") as d:
        clone = Path(d) / "vmcache"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        results = clone / "benchmarks" / "results"
        before = {p: p.stat().st_mtime_ns for p in results.iterdir()}  # a run may rewrite one
        for command in commands:
            total, failed = 0.0, False
            for phase, cmd in PHASES[command]:
                wall, rc = run_phase(clone, cmd, logs / f"{command}-{phase}.log")
                total += wall
                failed |= rc != 0
                rows.append({"command": f"make {command}", "phase": phase,
                             "target": " ".join(cmd), "wall_s": wall, "rc": rc})  # fmt: skip
                print(f"make {command} / {phase}: {wall / 60:.1f} min, exit {rc}", flush=True)
                if rc:
                    break
            rows.append({"command": f"make {command}", "phase": "total", "wall_s": total,
                         "rc": int(failed)})  # fmt: skip
        out = Path(args.out)
        for made in sorted(p for p in results.iterdir()
                           if before.get(p) != p.stat().st_mtime_ns):  # fmt: skip
            shutil.copy2(made, out / made.name)
            print(f"kept {out / made.name}")
    extra = {"clone_of": head, "cores": os.cpu_count(), "logs": "not kept (machine paths)",
             "note": "venvs installed from pip's cache; the embedded model already in "
                     "~/.cache/vmcache (fetched once a machine, converted once a "
                     "transformers release)"}  # fmt: skip
    print(save("fresh_clone", torch.device("cpu"), rows, extra, out_dir=args.out))
    print(f"logs: {logs}")
    return int(any(r["rc"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
