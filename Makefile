# Two commands for a newcomer:  `make demo`  and  `make test`.  Everything else is optional.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= --durations=25
# PYTEST_WORKERS: pytest-xdist workers of `make test` (default 2, why: scripts/run_tests.sh); 0 runs it serially.
# What each test target guards and what it costs: docs/testing.md.

.PHONY: install demo test test-slurm test-layouts test-long test-gpu-prep test-all theory clean ci-time

install:  ## create .venv if missing and install the CPU stack (idempotent)
	bash scripts/install.sh cpu $(VENV)

demo: install  ## tiny end-to-end CPU run (see examples/tiny_cpu_da3po.yaml)
	bash scripts/demo.sh $(PY)

test: install  ## ruff + the test suite (<= 25 min on 2 idle cores); CI runs it first, then the parts below
	$(PY) -m ruff check .
	PYTEST_WORKERS=$(PYTEST_WORKERS) bash scripts/run_tests.sh $(PY) suite $(PYTEST_ARGS)

test-slurm: install  ## the Slurm tests: a 3-node cluster in network namespaces (~5 min; in CI, not in make test)
	bash scripts/run_tests.sh $(PY) slurm $(PYTEST_ARGS)

test-layouts: install  ## every shipped recipe's layout shrunk to tiny width (~10 min; in CI, not in make test)
	bash scripts/run_tests.sh $(PY) layouts $(PYTEST_ARGS)

test-long: install  ## end-to-end runs that cheaper tests in make test overlap (in CI, not in make test)
	bash scripts/run_tests.sh $(PY) long $(PYTEST_ARGS)

test-gpu-prep: install  ## tools/gpu/gpu_check.sh run whole on CPU at tiny sizes (~90 s; in CI): before a device session
	bash scripts/run_tests.sh $(PY) gpu_prep $(PYTEST_ARGS)

test-all: install  ## everything CI runs, part by part, each timed (.ci/run)
	bash .ci/run

ci-time:  ## what the last test run cost: slowest tests, seconds per file and per part (tools/dev/ci_time.py)
	$(PY) tools/dev/ci_time.py

theory: install  ## the paper's Figures 1-2 (alpha+, alpha-, gamma vs p)
	$(PY) tools/plot_theory.py --out outputs/theory

clean:
	rm -rf outputs runs .pytest_cache
