"""The base install (`pip install -e .`, no extras) as its users meet it, simulated by a
`transformers` package on PYTHONPATH that cannot be imported (every process, Ray's workers
included, finds it before the real one): preparing a corpus with a Hugging Face tokenizer works
(`tokenizers` is a base dependency) and writes the same shards as with transformers installed;
what needs transformers (a Hugging Face directory as `init.model`, `format=hf`) stops in one
`error:` line naming the extra, nothing written."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from corpora import prepare_args, prepare_command
from hflayouts import HF_LAYOUT_TASKS
from repo import ROOT

pytestmark = pytest.mark.slow

EXTRA = "needs the transformers package, which the base install leaves out: pip install -e '.[hf]'"


@pytest.fixture(scope="module")
def without_transformers(tmp_path_factory) -> dict:
    """The environment of a process that cannot import transformers."""
    blocked = tmp_path_factory.mktemp("blocked")
    (blocked / "transformers").mkdir()
    (blocked / "transformers" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'transformers' (blocked by the test)\")\n"
    )
    path = os.pathsep.join([str(blocked), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def shard_digests(dataset: Path) -> dict[str, str]:
    return {
        str(path.relative_to(dataset)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(dataset.rglob("*.tar"))
    }


def test_prepare_with_a_hugging_face_tokenizer_needs_no_extra(
    without_transformers, hf_layouts, hf_layout_data, hf_layout_corpus, tmp_path
):
    out = tmp_path / "data"
    args = prepare_args(hf_layout_corpus, out, **{"ray.num_workers": 2})
    args += [f"tokenizer.path={hf_layouts['gpt2']}", f"tasks={HF_LAYOUT_TASKS['gpt2']}"]
    check = subprocess.run(
        [sys.executable, "-c", "import transformers"],
        env=without_transformers,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 1 and "blocked by the test" in check.stderr
    run = subprocess.run(
        prepare_command(args),
        cwd=ROOT,
        env=without_transformers,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    digests = shard_digests(out)
    assert digests and digests == shard_digests(hf_layout_data["gpt2"])


@pytest.mark.parametrize("what", ["init.model", "format=hf"])
def test_what_needs_transformers_says_so_in_one_line(
    without_transformers, hf_layouts, hf_layout_data, tmp_path, what
):
    if what == "init.model":
        argv = [
            "launch.train",
            str(ROOT / "configs" / "tiny_gpt.yaml"),
            f"data.data_dir={hf_layout_data['gpt2']}",
            f"run_dir={tmp_path / 'run'}",
            f"init.model={hf_layouts['gpt2']}",
        ]
        expected = (
            f"error: init.model={argv[-1].split('=', 1)[1]} (a Hugging Face directory) {EXTRA}"
        )
        written = tmp_path / "run"
    else:
        run_dir = tmp_path / "run"
        made = subprocess.run(
            [
                sys.executable,
                "-m",
                "launch.train",
                str(ROOT / "configs" / "tiny_gpt.yaml"),
                f"data.data_dir={hf_layout_data['llama']}",
                f"run_dir={run_dir}",
                "max_steps=1",
                "eval_every=0",
                "eval_batches=0",
                "threads_per_rank=1",
                "data.num_workers=0",
                "data.micro_batch_size=4",
            ],
            cwd=ROOT,
            env=without_transformers,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert made.returncode == 0, made.stderr[-3000:]  # training needs no extra either
        argv = ["launch.export", f"checkpoint={run_dir}", f"out={tmp_path / 'hf'}", "format=hf"]
        expected = f"error: format=hf {EXTRA}"
        written = tmp_path / "hf"
    run = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        env=without_transformers,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and errors == [expected] and "Traceback" not in run.stderr, (
        run.stderr[-3000:]
    )
    assert not written.exists()
