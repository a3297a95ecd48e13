# One entry point for everything; each target creates or reuses .venv.
# torch is installed first and pinned (the CPU wheel), then the project.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv demo test lint typecheck unit bench chaos clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test,local]'
	touch $(STAMP)

demo: $(STAMP)
	rm -rf checkpoints/demo  # a fresh start each time (the job would resume from them)
	$(VENV)/bin/ringmaster run examples/demo.yaml --kill-node-at-step 100

lint: $(STAMP)
	$(VENV)/bin/ruff check orchestrator checkpoint agents tests benchmarks examples
	$(VENV)/bin/lint-imports --no-cache  # the layering contracts in pyproject.toml

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest $(PYTEST_ARGS)

unit: $(STAMP)
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

chaos: $(STAMP)  # the long soak: 12 faults of every kind in one run
	RINGMASTER_SOAK_FAULTS=12 $(PY) -m pytest -m chaos $(PYTEST_ARGS)

bench: $(STAMP)
	@set -e; for b in benchmarks/[a-z]*.py; do \
		echo "== $$b"; $(PY) $$b; \
	done

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
