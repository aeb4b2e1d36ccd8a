#!/usr/bin/env bash
# GPU check, one go, offline: install the project against the machine's own packages, run the
# GPU tests (CUDA backend, kernels) and the GPU benchmarks, write everything under $OUT.
# Budget: about 15 device minutes in all; the timeouts below add up to ~20, so the slow
# steps come last (a timeout still leaves the earlier JSON in $OUT).
#   OUT=/some/dir bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
$PY -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || true
export VMCACHE_RESULTS="$OUT"
status=0
# GPU-marked tests first (the CUDA backend), then the kernel suite on CUDA tensors.
timeout 240 $PY -P -m pytest tests/test_cuda.py -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
  > "$OUT/gpu-tests.log" 2>&1 || status=1
timeout 120 $PY benchmarks/bench_vmm.py --device cuda > "$OUT/bench_vmm.log" 2>&1 || status=1
timeout 240 $PY benchmarks/bench_attention.py --device cuda > "$OUT/bench_attention.log" 2>&1 || status=1
timeout 120 $PY benchmarks/soak.py --device cuda --ops 5000 > "$OUT/soak.log" 2>&1 || status=1
# the drop-in (quick grid) and the engine's compute mode: vmcache vs paged tokens/s on the GPU
timeout 240 $PY benchmarks/bench_hf.py --device cuda --quick > "$OUT/bench_hf.log" 2>&1 || status=1
timeout 240 $PY -P -m vmcache.bench --mode compute --device cuda > "$OUT/ab_compute.log" 2>&1 \
  || status=1
tail -n 5 "$OUT"/*.log
exit $status
