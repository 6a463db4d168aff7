# Two commands for a newcomer:  `make demo`  and  `make test`.  Everything else is optional.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= --durations=25
# PYTEST_WORKERS=2: two pytest-xdist workers, whole files each, long files first (tests/conftest.py) -- 1,716 s for the
# suite once, but in a later run a worker died in the 3-node Slurm requeue test (not yet explained), so the default
# stays serial until that is fixed.
PYTEST_WORKERS ?= 0

.PHONY: install demo test lint theory clean

install:  ## create .venv if missing and install the CPU stack (idempotent)
	bash scripts/install.sh cpu $(VENV)

demo: install  ## tiny end-to-end CPU run (see examples/tiny_cpu_da3po.yaml)
	bash scripts/demo.sh $(PY)

test: install  ## the whole test suite, as CI runs it
	$(PY) -m ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

theory: install  ## the paper's Figures 1-2 (alpha+, alpha-, gamma vs p)
	$(PY) tools/plot_theory.py --out outputs/theory

clean:
	rm -rf outputs runs .pytest_cache
