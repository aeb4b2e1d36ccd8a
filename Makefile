# The two commands of the README: `make bench` and `make test`. Each creates .venv if missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.vmcache-installed

.PHONY: bench test lint gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Without an NVIDIA GPU take the CPU build first, so no multi-GB CUDA build is pulled.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[test,bench,hf]'
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/vmcache-bench

test: $(STAMP)
	# the pytest script, not `python -m`, keeps the repository root off sys.path (see kernels/)
	TRITON_INTERPRET=1 $(VENV)/bin/pytest

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
