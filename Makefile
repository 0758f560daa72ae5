# The two commands of the README: `make main` (set up, then run the main job on the default
# corpus) and `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch first and pinned: left to resolve as a dependency it pulls several GB of CUDA
# packages; 2.13.0 resolves to the CPU wheel on our machines.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup main test slurm-cluster manpages clean-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

main: setup
	WANDB_MODE=offline $(PY) -m launch.main configs/main.yaml

# SLURM from Debian's packages and a two-node cluster on this machine, for tests/test_slurm.py
# (needs root and apt-get; elsewhere those tests skip, except under CI=true where they fail).
SLURM_PACKAGES := munge slurmctld slurmd slurm-client slurmdbd mariadb-server
slurm-cluster:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		dpkg -s $(SLURM_PACKAGES) >/dev/null 2>&1 || { apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null; }; \
		bash slurm/local-cluster.sh start; \
	else echo "not root or no apt-get: no local SLURM cluster, its tests will skip"; fi

# Optional extra pretraining text: Debian's German manual pages for configs/prepare_gettext_manpages.yaml
# (needs root and apt-get; `main` and `test` do not depend on it).
manpages:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		if dpkg -s manpages-de >/dev/null 2>&1 || { apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends manpages-de >/dev/null; }; then \
			echo "manpages-de: $$(ls /usr/share/man/de/man[1-8]/* | wc -l) German pages in /usr/share/man/de/man[1-8]"; \
		else echo "apt-get could not install manpages-de; the German man page source has only the pages already there"; fi; \
	else echo "not root or no apt-get: cannot install manpages-de; the German man page source has only the pages already there"; fi

test: setup slurm-cluster
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
