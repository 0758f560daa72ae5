# The two commands of the README: `make main` (set up, then run the main job on the default
# corpus) and `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch first and pinned, so that the project's dependencies do not pick another. Which build
# the pin gets is the index's choice: PyPI's Linux wheel is the CUDA one (several GB of nvidia-*
# packages); our machines' pip configuration (find-links /opt/wheels) holds the CPU one,
# 2.13.0+cpu. For the CPU build from PyTorch's own index: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# The suite in 3 pytest-xdist workers, a test file each at a time (a file's module fixtures are
# built once; the SLURM tests share one cluster in one worker). One worker more than the 2 cores
# fills the time the others wait on SLURM, servers, other ranks and process start-ups
# (docs/design.md#the-test-suite-in-three-workers). Files are dealt costliest first
# (tests/ordering.py COSTLIEST_FIRST), not xdist's most-tests first. 0: one process.
PYTEST_WORKERS ?= 3

.PHONY: setup main test slurm-cluster manpages clean-venv gpu-bundle gpu-wheelhouse gpu-data

# pip byte-compiles what it installs on one core; compileall does the same on every core
# afterwards, so set-up takes less wall time on several cores. Its errors are pip's to ignore too
# (a file of torch's tests written for Python 3.12 only).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
	touch $@

setup: $(VENV)/.installed

# W&B's mode is the caller's (`WANDB_MODE=online make main`); offline when the caller sets none,
# so that the job needs no network and no login.
main: setup
	WANDB_MODE="$${WANDB_MODE:-offline}" $(PY) -m launch.main configs/main.yaml

# SLURM from Debian's packages and a two-node cluster on this machine, for tests/slurm/test_slurm.py
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
	$(PY) -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# ---- The offline GPU check's bundle (docs/gpu.md): run where PyPI is reachable, then copy the
# repository and $(GPU_BUNDLE) to the GPU node and run `bash benchmarks/gpu_check.sh` there.
# gpu-wheelhouse: wheels, for the node's Python on manylinux x86_64, of the closure of this
#   project's runtime dependencies (and pytest) at the versions in .venv, less torch and its CUDA
#   stack (the node's own torch is used), less ray (the data is prepared here), less
#   GPU_WHEELHOUSE_SKIP: large packages a GPU node's Python has anyway (numpy, matplotlib, sacrebleu)
#   and wandb (22 MiB more with what it brings: the check trains with wandb.mode=disabled without it,
#   and a run that asks for wandb.mode=offline fails; drop it from the list to bundle it).
#   Sdist-only packages are built into wheels here (deepspeed with DS_BUILD_OPS=0: no ops
#   prebuilt, they JIT on first use).
# gpu-data: datasets prepared with Ray here from this Python's standard library sources (up to
#   GPU_DATA_CHARS characters of them; all of CPython 3.11's, 11.4 M, give a byte-level BPE of
#   GPT-2's 50,257 pieces, trained by the tokenizers library): data/ for configs/gpt2_small.yaml
#   (seq_len 1024, causal_lm), data2048/ for configs/llama_gpu_1b.yaml (seq_len 2048, the same
#   tokenizer, GPU_DATA2048_CHARS of the text), and tiny_dataset, the test suite's
#   (tests/corpora.py), for the gpu tests that train (TINY_DATASET).
GPU_BUNDLE ?= build/gpu-bundle
NODE_PYTHON_VERSION ?= 3.12
NODE_GLIBC ?= 2.28
GPU_WHEELHOUSE_SKIP ?= numpy matplotlib sacrebleu wandb zstandard
GPU_DATA_CHARS ?= 12000000
GPU_DATA2048_CHARS ?= 5000000

gpu-bundle: gpu-wheelhouse gpu-data
	@du -sh $(GPU_BUNDLE)/wheels $(GPU_BUNDLE)/data $(GPU_BUNDLE)/data2048 $(GPU_BUNDLE)/tiny_dataset; du -sh $(GPU_BUNDLE)

gpu-wheelhouse: setup
	rm -rf $(GPU_BUNDLE)/wheels.partial
	$(PY) benchmarks/gpu_bundle.py wheelhouse $(NODE_PYTHON_VERSION) $(NODE_GLIBC) "$(GPU_WHEELHOUSE_SKIP)" $(GPU_BUNDLE)/wheels.partial
	rm -rf $(GPU_BUNDLE)/wheels && mv $(GPU_BUNDLE)/wheels.partial $(GPU_BUNDLE)/wheels

gpu-data: setup
	mkdir -p build/gpu-corpus
	$(PY) benchmarks/gpu_bundle.py corpus $(GPU_DATA_CHARS) build/gpu-corpus/stdlib.txt
	$(PY) -m pipeline.prepare configs/prepare_gettext_en_de.yaml output_dir=$(GPU_BUNDLE)/data overwrite=true \
		"tasks=[causal_lm]" seq_len=1024 source.format=text "source.paths=[$(CURDIR)/build/gpu-corpus/stdlib.txt]" \
		source.text_split=paragraph tokenizer.kind=hf tokenizer.model_type=bpe tokenizer.vocab_size=50257 \
		split.valid=0.01 split.test=0.01 shard.max_samples=512 shard.buckets=4 ray.num_workers=2 progress=false
	$(PY) benchmarks/gpu_bundle.py corpus $(GPU_DATA2048_CHARS) build/gpu-corpus/stdlib2048.txt
	$(PY) -m pipeline.prepare configs/prepare_gettext_en_de.yaml output_dir=$(GPU_BUNDLE)/data2048 overwrite=true \
		"tasks=[causal_lm]" seq_len=2048 source.format=text "source.paths=[$(CURDIR)/build/gpu-corpus/stdlib2048.txt]" \
		source.text_split=paragraph tokenizer.path=$(CURDIR)/$(GPU_BUNDLE)/data \
		split.valid=0.01 split.test=0.01 shard.max_samples=256 shard.buckets=4 ray.num_workers=2 progress=false
	rm -rf $(GPU_BUNDLE)/tiny_dataset
	$(PY) tests/corpora.py $(GPU_BUNDLE)/tiny_dataset
	@du -sh $(GPU_BUNDLE)/data $(GPU_BUNDLE)/data2048 $(GPU_BUNDLE)/tiny_dataset

clean-venv:
	rm -rf $(VENV)
