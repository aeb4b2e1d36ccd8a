#!/usr/bin/env bash
# GPU check, one device call, offline: probe the image, install the project against the
# machine's own packages, run the GPU tests and quick GPU benchmarks, and write a summary of
# every GPU claim of docs/results.md (measured value, verdict).
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# What comes back from a device call is at most 8 files, so $OUT gets exactly two:
#   summary.json        the claims, the preflight, every step, and `stopped` (why it ended early)
#   gpu-check.tar.gz    everything else: preflight.txt, steps.jsonl, a log per step, JUnit XML,
#                       each benchmark's JSON
#
# Preflight is a gate: a missing or failing nvidia-smi, no CUDA in torch, a failing cuInit,
# missing pytest/hypothesis, a failed install (an externally managed Python refuses
# `pip install -e`), `import vmcache.kernels` failing, or a cache that cannot be built over a
# reservation with nothing mapped (torch.as_tensor honouring the interface's device) stops
# the run at once with the reason in summary.json (GPU_CHECK_FORCE=1 goes on regardless: the
# CPU dry run of the deadline logic).
#
# One deadline for everything (GPU_CHECK_DEADLINE seconds, default 480: a device call may last
# 600 s): each command runs under `timeout -k` with the smaller of its own budget and what is
# left, and a step that no longer fits is recorded as skipped, never started. Exit status: 0
# only if every step passed and no GPU test was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE:-480}
OUT=${OUT:-$PWD/gpu-out}
PY=${PY:-python3}
FORCE=${GPU_CHECK_FORCE:-}
mkdir -p "$OUT"
WORK=$(mktemp -d)  # archived into $OUT at the end
: > "$WORK/steps.jsonl"
: > "$WORK/preflight.txt"
export VMCACHE_RESULTS="$WORK" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
status=0

left() { echo $((DEADLINE - ($(date +%s) - START))); }

finish() {
  timeout -k 5 30 $PY scripts/gpu_summary.py "$WORK" > "$WORK/summary.log" 2>&1 || status=1
  [ -f "$WORK/summary.json" ] || printf '{"gpu": "unknown", "stopped": "%s", "claims": []}\n' \
    "summary failed: see summary.log" > "$WORK/summary.json"
  cp "$WORK/summary.json" "$OUT/summary.json"
  tar -czf "$OUT/gpu-check.tar.gz" -C "$WORK" --exclude summary.json .
  tail -n 3 "$WORK"/*.log 2>/dev/null
  echo "gpu_check: $(( $(date +%s) - START )) s of $DEADLINE, status $status"
  rm -rf "$WORK"
  exit $status
}

# stop REASON: the run cannot succeed; say why and end now (unless forced)
stop() {
  echo "$1" >> "$WORK/stopped.txt"
  status=1
  [ -n "$FORCE" ] || finish
}

# probe NAME LIMIT COMMAND...: a preflight command under `timeout -k`, its output as
# "NAME: ..." lines of preflight.txt; returns its exit status
probe() {
  local name=$1 limit=$2 rc
  shift 2
  timeout -k 5 "$limit" "$@" > "$WORK/probe.out" 2>&1
  rc=$?
  sed "s/^/$name: /" "$WORK/probe.out" | head -n 40 >> "$WORK/preflight.txt"
  [ $rc -eq 0 ] || echo "$name: exit $rc" >> "$WORK/preflight.txt"
  return $rc
}

# step NAME BUDGET_S COMMAND...: run under min(budget, time left - 15 s for the summary)
step() {
  local name=$1 budget=$2 rc t0 limit state
  shift 2
  limit=$(( $(left) - 15 ))
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -lt 5 ]; then
    printf '{"name": "%s", "status": "skipped", "rc": null, "seconds": 0, "why": "deadline"}\n' \
      "$name" >> "$WORK/steps.jsonl"
    status=1
    return 1
  fi
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  case $rc in 0) state=ok ;; 124|137) state=timeout ;; *) state=failed ;; esac
  [ $rc -eq 0 ] || status=1
  printf '{"name": "%s", "status": "%s", "rc": %d, "seconds": %d, "limit": %d}\n' \
    "$name" "$state" "$rc" $(( $(date +%s) - t0 )) "$limit" >> "$WORK/steps.jsonl"
  return $rc
}

# --- preflight: each probe a gate -------------------------------------------------------------
echo "gcc: $(command -v gcc || echo missing)" >> "$WORK/preflight.txt"
probe gpu 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
  --format=csv,noheader || stop "nvidia-smi missing or failing: no usable GPU driver"
probe image 60 $PY - <<'EOF' || stop "the Python image is unusable (see preflight.txt)"
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
EOF
probe torch 90 $PY -c "import torch; print('torch cuda:', torch.version.cuda, \
'available:', torch.cuda.is_available()); assert torch.cuda.is_available()" \
  || stop "torch sees no CUDA device"
probe cuinit 30 $PY -c "from cuda.bindings import driver as d; (r,) = d.cuInit(0); \
print('cuInit:', r.name); assert r == d.CUresult.CUDA_SUCCESS" || stop "cuInit failed"
probe test_tools 30 $PY -c "import pytest, hypothesis; print('ok')" \
  || stop "pytest or hypothesis missing: the GPU tests cannot run"
if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
  step install 120 $PY -m pip install --no-deps --no-build-isolation -e . \
    || stop "installing the project failed (see install.log)"
fi
probe kernels 120 $PY -c "import vmcache.kernels, vmcache.paged_fallback; print('ok')" \
  || stop "import vmcache.kernels failed"
# the first thing a cache does: views over a reservation with nothing mapped yet
probe empty_views 60 $PY -c "import torch; from vmcache import KVSpec, VMKVCache; \
c = VMKVCache(KVSpec(2, 2, 64, torch.bfloat16), 2, 1024, device='cuda'); \
k = c.views.k_cache(0); print('view device:', k.device); assert k.device.type == 'cuda'; c.close()" \
  || stop "a cache cannot be built over an empty reservation on this torch"

# --- the run -----------------------------------------------------------------------------------
# GPU-marked tests (CUDA backend, every kernel on CUDA memory); short tracebacks (a long one
# would repr tensors over unmapped memory); a skipped GPU test is a failure here
step gpu_tests 260 $PY -P -m pytest tests/gpu/test_cuda.py tests/gpu/test_cuda_quant.py \
  tests/gpu/test_cuda_graphs.py tests/gpu/test_vllm_device.py tests/distributed/test_transfer.py \
  -m gpu -q \
  -p no:cacheprovider --tb=short -rs --junitxml="$WORK/gpu-tests.xml"
if grep -q 'skipped="[1-9]' "$WORK/gpu-tests.xml" 2>/dev/null; then
  echo "GPU tests were skipped: a GPU machine must run them all" >> "$WORK/gpu_tests.log"
  status=1
fi
step syncs 30 $PY benchmarks/bench_syncs.py --device cuda --quick
step bench_vmm 30 $PY benchmarks/bench_vmm.py --device cuda --quick
step bench_attention 70 $PY benchmarks/bench_attention.py --device cuda --quick
step soak 30 $PY benchmarks/soak.py --device cuda --ops 1500
step bench_hf 90 $PY benchmarks/bench_hf.py --device cuda --quick
step ab_compute 60 $PY -P -m vmcache.bench --mode compute --device cuda --quick
finish
