"""The suite's fixtures and hooks: shared artefacts built once a run (the tiny dataset, trained
runs, checkpoints, the Hugging Face layouts), the device set-up and the order of the files. What
test files import is in helper modules beside this (repo, corpora, hflayouts, trainruns, ...):
pytest loads this file as a plugin, not as a module to import."""

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

# The helper modules that test files share assert as tests do: pytest rewrites their asserts too,
# so that a failure shows the values compared, as it did while they were part of test files.
pytest.register_assert_rewrite(
    "batches",
    "clirun",
    "corpora",
    "dryrun",
    "errorlines",
    "hflayouts",
    "madecheckpoints",
    "processes",
    "sourcecfg",
    "trainruns",
    "warm_start_sources",
)

# The device set-up (tests/devices.py: CUDA initialised, then hidden) runs as this file loads,
# before any test file is imported.
import torch  # noqa: E402
from corpora import prepare_tiny_dataset, write_tiny_corpus  # noqa: E402
from devices import HAS_CUDA  # noqa: E402
from hflayouts import BERT2GPT2, HF_LAYOUTS, build_hf_layout_data, build_hf_layouts  # noqa: E402
from ordering import in_cost_order  # noqa: E402
from repo import ROOT  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The costliest files first (COSTLIEST_FIRST). `gpu` tests skip without CUDA (they are
    written for a machine the device tool lends). On a machine meant to test the GPU
    (REQUIRE_GPU=1, as benchmarks/gpu_check.sh sets), a torch that cannot use one is an error:
    `pytest -m gpu` would otherwise pass having run nothing."""
    items[:] = in_cost_order(items)
    if HAS_CUDA:
        return
    if os.environ.get("REQUIRE_GPU", "") not in ("", "0") and any(
        "gpu" in item.keywords for item in items
    ):
        why = (
            "this torch is a CPU build"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: no driver, no device "
            "visible (CUDA_VISIBLE_DEVICES), or a driver older than this CUDA"
        )
        raise pytest.UsageError(f"REQUIRE_GPU=1 but CUDA is not usable: {why}")
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the machine's other cores serve subprocesses."""
    import torch

    torch.set_num_threads(1)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """A session's shared artefact, `build(directory)` into a new directory, made once per run.

    `make test` runs the suite in 2 pytest-xdist workers (one session each); there the first
    worker to ask builds under an exclusive lock in the run's common temp root, and the other
    waits for it and reads the same files. A build that raised leaves no `.done` mark, so the
    next worker to ask builds again (and fails the same way, in its own tests)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        directory = tmp_path_factory.mktemp(name)
        build(directory)
        return directory
    root = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    directory, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "corpus", write_tiny_corpus) / "pairs.tsv"


@pytest.fixture(scope="session")
def tiny_dataset(tiny_corpus, tmp_path_factory) -> Path:
    """The tiny corpus prepared with 2 Ray workers (shared by the data and training tests). Where
    TINY_DATASET names one prepared beforehand the same way (`make gpu-bundle`, for a GPU node
    without Ray or a network), that one."""
    if os.environ.get("TINY_DATASET"):
        given = Path(os.environ["TINY_DATASET"])
        assert (given / "manifest.json").is_file(), (
            f"TINY_DATASET={given}: no prepared dataset there"
        )
        return given
    if importlib.util.find_spec("ray") is None:
        pytest.skip(
            "the tiny dataset is prepared with Ray, which is not installed here (or set TINY_DATASET)"
        )
    return (
        built_once(
            tmp_path_factory,
            "prepared",
            lambda top: prepare_tiny_dataset(tiny_corpus, top / "data"),
        )
        / "data"
    )


# ----------------------------------------------------------------------------- trained runs, once a
# session
# Each is a 2-rank torchrun job of launch.train (10-25 s on 2 cores, most of it start-up) that tests
# of several files assert on; their settings are in trainruns.py, which those files import.


@pytest.fixture(scope="session")
def uninterrupted_gpt(tiny_dataset, tmp_path_factory) -> Path:
    """Tiny GPT on 2 ranks under ZeRO-2, fp32, no dropout, 14 steps (trainruns.UNINTERRUPTED_GPT):
    the run test_elastic resumes against on other world sizes and test_compile's compiled ZeRO-3
    chain matches."""
    from trainruns import UNINTERRUPTED_GPT, run_train

    return built_once(
        tmp_path_factory,
        "uninterrupted-gpt",
        lambda run_dir: run_train(tiny_dataset, run_dir, *UNINTERRUPTED_GPT),
    )


@pytest.fixture(scope="session")
def dropout_zero3_gpt(tiny_dataset, tmp_path_factory) -> Path:
    """Tiny GPT on 2 ranks under ZeRO-3 with dropout 0.1, 10 steps, a checkpoint every 5
    (trainruns.DROPOUT_ZERO3): the uninterrupted run of test_train's resume and the run without
    activation checkpointing of test_zero_paths."""
    from trainruns import DROPOUT_ZERO3, train

    return built_once(
        tmp_path_factory,
        "dropout-zero3-gpt",
        lambda run_dir: train("tiny_gpt.yaml", tiny_dataset, run_dir, *DROPOUT_ZERO3),
    )


def _make_checkpoints(out: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")
    }
    env["OMP_NUM_THREADS"] = "1"
    made = subprocess.run(
        [sys.executable, str(ROOT / "tests/launch/test_checkpoint_integrity.py"), "make", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-4000:]


@pytest.fixture(scope="session")
def made_checkpoints(tmp_path_factory) -> Path:
    """OUT/stage0 and OUT/stage2: run directories of a tiny GPT with two checkpoints each, ZeRO-0
    and ZeRO-2, as launch.train leaves them but without integrity.json (test_checkpoint_integrity's
    `make`, a one-process DeepSpeed engine; ~10 s): read, never written, by the checkpoint
    integrity and export tests, which copy what they change."""
    return built_once(tmp_path_factory, "checkpoints", _make_checkpoints)


# --- Hugging Face layouts (tests/hflayouts.py), built once a session --------------------------


@pytest.fixture(scope="session")
def hf_layouts(tmp_path_factory) -> dict[str, Path]:
    """{layout: a Hugging Face directory with its tokenizer and a tiny model} for HF_LAYOUTS."""
    pytest.importorskip("transformers")
    top = built_once(tmp_path_factory, "hf-layouts", build_hf_layouts)
    return {layout: top / layout for layout in HF_LAYOUTS}


@pytest.fixture(scope="session")
def hf_layout_top(hf_layouts, tmp_path_factory) -> Path:
    return built_once(
        tmp_path_factory, "hf-layout-data", lambda top: build_hf_layout_data(hf_layouts, top)
    )


@pytest.fixture(scope="session")
def hf_layout_corpus(hf_layout_top) -> Path:
    """The synthetic corpus (600 pairs) the layouts' datasets are prepared from."""
    return hf_layout_top / "pairs.tsv"


@pytest.fixture(scope="session")
def bert2gpt2_data(hf_layout_top) -> Path:
    """A translation dataset of hf_layout_corpus with two tokenizers: BERT's for the sources,
    GPT-2's for the targets (`tokenizer.target_path`)."""
    return hf_layout_top / BERT2GPT2


@pytest.fixture(scope="session")
def hf_layout_data(hf_layout_top) -> dict[str, Path]:
    """{layout: its dataset of hf_layout_corpus, HF_LAYOUT_TASKS[layout], 2 Ray workers}."""
    return {layout: hf_layout_top / layout for layout in HF_LAYOUTS}
