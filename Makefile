# Two commands for a newcomer:  `make demo`  and  `make test`.  Everything else is optional.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= --durations=25
# PYTEST_WORKERS: pytest-xdist workers for everything but the Slurm tests, which then run alone; its default (2) and
# why are in scripts/run_tests.sh. `make test PYTEST_WORKERS=0` runs the first pass serially too.

.PHONY: install demo test test-layouts test-long test-gpu-prep lint theory clean ci-time

install:  ## create .venv if missing and install the CPU stack (idempotent)
	bash scripts/install.sh cpu $(VENV)

demo: install  ## tiny end-to-end CPU run (see examples/tiny_cpu_da3po.yaml)
	bash scripts/demo.sh $(PY)

test: install  ## the whole test suite, as CI runs it
	$(PY) -m ruff check .
	PYTEST_WORKERS=$(PYTEST_WORKERS) bash scripts/run_tests.sh $(PY) $(PYTEST_ARGS)

test-layouts: install  ## every shipped recipe's layout shrunk to tiny width (~25 min on 2 cores; not in make test)
	$(PY) -m pytest -m layouts tests/test_shipped_layouts.py $(PYTEST_ARGS)

test-long: install  ## end-to-end tests that cheaper ones in make test overlap (~3 min on 2 cores; not in make test)
	$(PY) -m pytest -m long $(PYTEST_ARGS)

test-gpu-prep: install  ## tools/gpu/gpu_check.sh run whole on CPU at tiny sizes (~90 s; not in make test): before a device session
	$(PY) -m pytest -m gpu_prep tests/test_gpu_check_script.py $(PYTEST_ARGS)

theory: install  ## the paper's Figures 1-2 (alpha+, alpha-, gamma vs p)
	$(PY) tools/plot_theory.py --out outputs/theory

clean:
	rm -rf outputs runs .pytest_cache
