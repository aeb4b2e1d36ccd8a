#!/usr/bin/env bash
# GPU check, one device call, offline: install the project against the machine's own packages,
# record what the image has, run the GPU tests and quick GPU benchmarks, and write a summary of
# every GPU claim of the README (measured value, verdict) to $OUT/summary.json.
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# One deadline for everything (GPU_CHECK_DEADLINE seconds, default 480: a device call may last
# 600 s): each step runs under `timeout` with the smaller of its own budget and what is left,
# and a step that no longer fits is recorded as skipped, never started. $OUT/steps.jsonl has a
# line per step (name, status ok|failed|timeout|skipped, rc, seconds). Exit status: 0 only if
# every step passed and no GPU test was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE:-480}
OUT=${OUT:-$PWD/gpu-out}
PY=${PY:-python3}
mkdir -p "$OUT"
: > "$OUT/steps.jsonl"
export VMCACHE_RESULTS="$OUT" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
status=0

left() { echo $((DEADLINE - ($(date +%s) - START))); }

# step NAME BUDGET_S COMMAND...: run under min(budget, time left - 10 s for the summary)
step() {
  local name=$1 budget=$2 rc t0 limit state
  shift 2
  limit=$(( $(left) - 10 ))
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -lt 5 ]; then
    printf '{"name": "%s", "status": "skipped", "rc": null, "seconds": 0, "why": "deadline"}\n' \
      "$name" >> "$OUT/steps.jsonl"
    status=1
    return
  fi
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  case $rc in 0) state=ok ;; 124|137) state=timeout ;; *) state=failed ;; esac
  [ $rc -eq 0 ] || status=1
  printf '{"name": "%s", "status": "%s", "rc": %d, "seconds": %d, "limit": %d}\n' \
    "$name" "$state" "$rc" $(( $(date +%s) - t0 )) "$limit" >> "$OUT/steps.jsonl"
}

# --- preflight: what the image has (Triton's launcher needs gcc and Python.h) ----------------
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
    2>&1 | head -n 1 | sed 's/^/gpu: /'
  echo "gcc: $(command -v gcc || echo missing)"
  $PY - <<'EOF' 2>&1
import importlib.metadata as md, os, sys, sysconfig
print("python:", sys.version.split()[0])
inc = sysconfig.get_paths().get("include", "")
print("Python.h:", "present" if os.path.exists(os.path.join(inc, "Python.h")) else "missing")
for name in ("torch", "triton", "cuda-bindings", "cuda-python", "transformers", "pytest",
             "hypothesis", "flash-attn", "numpy", "matplotlib"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: missing")
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), "torch cuda:", torch.version.cuda)
except Exception as exc:  # noqa: BLE001
    print("torch import failed:", exc)
EOF
} > "$OUT/preflight.txt"

if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
  step install 90 $PY -m pip install --no-deps --no-build-isolation -e .
fi
# GPU-marked tests (CUDA backend, every kernel on CUDA memory); short tracebacks (a long one
# would repr tensors over unmapped memory); a skipped GPU test is a failure here
step gpu_tests 200 $PY -P -m pytest tests/test_cuda.py -m gpu -q -p no:cacheprovider --tb=short \
  -rs --junitxml="$OUT/gpu-tests.xml"
if grep -q 'skipped="[1-9]' "$OUT/gpu-tests.xml" 2>/dev/null; then
  echo "GPU tests were skipped: a GPU machine must run them all" >> "$OUT/gpu_tests.log"
  status=1
fi
step syncs 30 $PY benchmarks/bench_syncs.py --device cuda --quick
step bench_vmm 30 $PY benchmarks/bench_vmm.py --device cuda --quick
step bench_attention 50 $PY benchmarks/bench_attention.py --device cuda --quick
step soak 30 $PY benchmarks/soak.py --device cuda --ops 1500
step bench_hf 40 $PY benchmarks/bench_hf.py --device cuda --quick
step ab_compute 60 $PY -P -m vmcache.bench --mode compute --device cuda --quick

$PY scripts/gpu_summary.py "$OUT" > "$OUT/summary.log" 2>&1 || status=1
tail -n 3 "$OUT"/*.log
echo "gpu_check: $(( $(date +%s) - START )) s of $DEADLINE, status $status"
exit $status
