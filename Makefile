# recsys developer commands. Everything runs inside .venv, built by `make setup` from the pins in
# requirements/ (each pin is explained there).

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.recsys-setup-done
# CUDA machines get the CUDA build of FBGEMM, everything else the CPU build.
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCHREC_REQS := requirements/torchrec-$(if $(HAS_CUDA),cuda,cpu).txt
CONFIG ?= configs/dlrm_synthetic.toml

.PHONY: setup train test lint docs docs-test docs-serve format bench clean

setup: $(STAMP)

# Rebuilt only when a pin or the package metadata changes, so a second `make setup` is instant.
$(STAMP): pyproject.toml requirements/base.txt requirements/docs.txt $(TORCHREC_REQS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements/base.txt -r requirements/docs.txt
	$(BIN)/python -m pip install --quiet --no-deps -r $(TORCHREC_REQS)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -c "import torch, triton, torchrec, fbgemm_gpu, recsys; print('recsys setup: torch', torch.__version__, 'triton', triton.__version__)"
	touch $@

train: setup
	$(BIN)/recsys train --config $(CONFIG)

lint: setup
	$(BIN)/ruff check recsys tests benchmarks scripts
	$(BIN)/ruff format --check recsys tests benchmarks scripts

format: setup
	$(BIN)/ruff check --fix recsys tests benchmarks scripts
	$(BIN)/ruff format recsys tests benchmarks scripts

test: lint docs
	$(BIN)/python -m pytest -q

# The documentation site (mkdocs.yml) into site/, warnings as errors: a broken link or anchor,
# or a docstring reference that does not resolve, fails it. `make docs-serve` previews it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Every bash / python block of README.md and docs/ marked <!-- example: run ... -->, in order, in
# a scratch directory (scripts/docs_examples.py; CI runs it after `make test`).
docs-test: setup
	$(BIN)/python scripts/docs_examples.py

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# Every benchmark (benchmarks/<topic>.py, run as `python -m benchmarks.<topic>`; the _*.py files
# are its helpers) appends its rows to benchmarks/results/<topic>.csv.
bench: setup
	@set -e; for module in benchmarks/[!_]*.py; do \
		topic=$$(basename $$module .py); \
		echo "== benchmarks.$$topic"; $(BIN)/python -m benchmarks.$$topic; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
