# The two commands of the README: `make main` (set up, then run the main job on the default
# corpus) and `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch first and pinned: left to resolve as a dependency it pulls several GB of CUDA
# packages; 2.13.0 resolves to the CPU wheel on our machines.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup main test clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

main: setup
	$(PY) -m pipeline.prepare configs/prepare_gettext_en_de.yaml $(if $(wildcard data/gettext-en-de/manifest.json),overwrite=true,)
	$(PY) -m pipeline.validate data/gettext-en-de

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
