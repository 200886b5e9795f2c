# Developer shortcuts. Run from the repository root; PYTHONPATH points at src/
# so the in-place build is the one imported.
PYTHON ?= python3
export PYTHONPATH := $(CURDIR)/src
PYTEST := $(PYTHON) -m pytest

.PHONY: build build-debug test test-quick test-slow lint typecheck stubtest bench clean

build:  ## the release engine, in place (src/aionvme/_engine*.so)
	$(PYTHON) setup.py build_ext --inplace

build-debug:  ## the debug engine: per-chunk counters and invariant checks (aionvme._engine.counters())
	AIONVME_DEBUG=1 $(PYTHON) setup.py build_ext --inplace --force

test: build  ## the whole suite, slow soaks included (what CI runs: pyproject's addopts leave them out of a plain run)
	$(PYTEST) -q tests
	$(PYTEST) -q -m slow tests

test-quick: build  ## everything but the slow soaks
	$(PYTEST) -q -x -m "not slow" tests

test-slow: build
	$(PYTEST) -q -m slow tests

lint:  ## ruff, ruff format, cython-lint, codespell
	$(PYTHON) -m ruff check src tests bench
	$(PYTHON) -m ruff format --check src tests bench
	cython-lint --max-line-length 120 cython_ext
	codespell --skip "cython_ext/aionvme/_engine.c,*.so" src tests cython_ext bench setup.py README.md Makefile

typecheck: build  ## strict mypy and the stub check of the Cython engine
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy.stubtest aionvme._engine --allowlist tests/stubtest_allowlist.txt

bench: build  ## 4 KiB random reads, QD 64, gather and batch (see bench/README.md for the full comparison)
	$(PYTHON) -m aionvme bench -w randread --mode gather --iodepth 64
	$(PYTHON) -m aionvme bench -w randread --mode batch --iodepth 64

clean:
	rm -rf build cython_ext/aionvme/_engine.c src/aionvme/_engine*.so
