"""Progress a user can watch (issue #32 §4): `common.progress.meter` (a tqdm bar on a terminal,
plain lines every PROGRESS_EVERY_S seconds elsewhere, one rank only), the entry points that use it
run as subprocesses on tiny data, with stderr a pipe and a pseudo-terminal, the training log
line (tokens/s, ETA, last checkpoint) and the main job's stage lines and overall ETA."""

import io
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time

import pytest
from repo import ROOT

from common.progress import meter

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PROGRESS_EVERY_S": "0"}
# A tiny translation model trained 4 steps, checkpointed at 2 and 4 (both kept, for averaging).
TRAIN = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_decoder_layers=1",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=64",
    "data.micro_batch_size=8",
    "data.num_workers=0",
    "max_steps=4",
    "log_every=1",
    "eval_every=0",
    "eval_batches=2",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
    "wandb.mode=disabled",
    "threads_per_rank=1",
]
DECODE = ["split=valid", "limit=20", "beam=1", "max_len=8", "micro_batch_size=4"]  # 5 batches of 4
PLAIN = re.compile(
    r"^(?P<desc>[^:\r]+): (?P<n>\d+)/(?P<total>\d+) (?P<unit>\w+) \(\d+%\), elapsed [\d:]+, "
    r"ETA (\?|[\d:]+), \S+/\S+$"
)


def python_m(
    *args: str, env: dict | None = None, stdin: str = "", timeout: int = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env or ENV,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def plain_lines(stderr: str, desc: str) -> list[re.Match]:
    found = [PLAIN.match(line) for line in stderr.splitlines()]
    return [m for m in found if m and m["desc"].startswith(desc)]


def on_pty(*args: str, timeout: float = 600) -> tuple[int, str]:
    """`python -m ARGS` with its stderr a pseudo-terminal (stdout a pipe): exit status, what the terminal got."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=follower,
        stdin=subprocess.DEVNULL,
    )
    os.close(follower)
    seen = read_terminal(leader, lambda: process.poll() is not None, timeout)
    return process.wait(timeout=60), seen


def read_terminal(leader: int, ended, timeout: float) -> str:
    """What was written to a pseudo-terminal, read from its `leader` end until the writer has `ended()`."""
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([leader], [], [], 0.5)[0]:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: every holder of the other end has closed it
                break
            if not data:
                break
            chunks.append(data)
        elif ended():
            break
    os.close(leader)
    return b"".join(chunks).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- the meter itself


def test_plain_lines_at_most_every_n_seconds_and_a_short_loop_says_nothing(monkeypatch):
    monkeypatch.setenv("PROGRESS_EVERY_S", "0.2")
    stream = io.StringIO()  # not a terminal
    started = time.monotonic()
    with meter(15, "work", "item", stream=stream) as shown:
        for _ in range(15):
            time.sleep(0.05)
            shown.update()
    elapsed = time.monotonic() - started
    lines = stream.getvalue().splitlines()
    assert all(PLAIN.match(line) for line in lines), lines
    # One line per 0.2 s at most, and the closing one with the final count.
    assert 2 <= len(lines) <= elapsed / 0.2 + 1, (elapsed, lines)
    assert lines[-1].startswith("work: 15/15 item (100%), elapsed 00:00, ETA 00:00, ")
    counts = [int(PLAIN.match(line)["n"]) for line in lines]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)

    monkeypatch.setenv("PROGRESS_EVERY_S", "30")
    quiet = io.StringIO()
    with meter(3, "work", "item", stream=quiet) as shown:
        shown.update(3)
    assert quiet.getvalue() == ""

    monkeypatch.setenv("PROGRESS_EVERY_S", "0")
    other_rank = io.StringIO()
    with meter(3, "work", "item", stream=other_rank, enabled=False) as shown:
        shown.update(3)
    assert other_rank.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar():
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as terminal:
        with meter(4, "work", "item", stream=terminal) as shown:
            for _ in range(4):
                shown.update()
    seen = read_terminal(leader, lambda: True, timeout=10)
    assert "\r" in seen and "work: 100%|" in seen and "| 4/4 [" in seen, repr(seen)


def test_a_bad_interval_is_one_line_error(tiny_dataset):
    run = python_m(
        "pipeline.validate", f"data_dir={tiny_dataset}", env={**ENV, "PROGRESS_EVERY_S": "soon"}
    )
    assert run.returncode == 2
    assert (
        run.stderr
        == "error: PROGRESS_EVERY_S=soon: seconds between progress lines, a number >= 0\n"
    )


# ----------------------------------------------------------------------------- the main job's lines


def test_stage_clock_estimates_each_kind_from_its_own_stages():
    from launch.main.plan import Stage, StageClock

    clock = StageClock(
        [
            Stage("prepare", "prepare", 1),
            Stage("pretrain gpt", "pretrain", 100),
            Stage("pretrain bert", "pretrain", 200),
            Stage("fine-tune a", "fine-tune", 50),
            Stage("evaluate a valid", "evaluate", 1),
        ]
    )
    assert (
        clock.eta()
        == "0/5 stages done, overall ETA not known yet (prepare, pretrain, fine-tune, evaluate not "
        "yet timed)"
    )
    clock.start("pretrain gpt")  # prepare skipped: done, untimed
    clock.finish("pretrain gpt", 50.0)  # 0.5 s a step
    assert (
        clock.eta() == "2/5 stages done, overall ETA >= 01:40 (fine-tune, evaluate not yet timed)"
    )
    clock.start("pretrain bert")
    assert (
        clock.eta(running_s=30.0)
        == "2/5 stages done, overall ETA >= 01:10 (fine-tune, evaluate not yet timed)"
    )
    # Its own progress line knows better than the kind's mean.
    assert (
        clock.eta(running_s=30.0, running_left_s=200.0)
        == "2/5 stages done, overall ETA >= 03:20 (fine-tune, evaluate not yet timed)"
    )
    clock.finish("pretrain bert", 110.0)  # 160 s for 300 steps now
    clock.start("fine-tune a")
    # The first of a kind: what it says of itself is what is known.
    assert (
        clock.eta(running_s=10.0, running_left_s=15.0)
        == "3/5 stages done, overall ETA >= 00:15 (evaluate not yet timed)"
    )
    clock.finish("fine-tune a", 25.0)
    clock.start("evaluate a valid")
    clock.finish("evaluate a valid", 4.0)
    assert clock.eta() == "5/5 stages done, overall ETA 00:00"
    with pytest.raises(ValueError):
        clock.start("export gpt")  # a stage not in the plan is a bug, not a silent gap in the ETA


def test_the_first_stage_of_a_kind_times_the_rest_of_its_kind_by_its_own_eta():
    # While the first fine-tuning runs, the job knows from its progress line how long it takes,
    # and so how long the second will: the overall ETA is that, not a bound of zero.
    from launch.main.plan import Stage, StageClock, own_eta_s

    clock = StageClock(
        [
            Stage("pretrain gpt", "pretrain", 100),
            Stage("fine-tune random-random", "fine-tune", 600),
            Stage("evaluate finetune-random-random valid", "evaluate", 1),
            Stage("fine-tune bert-gpt", "fine-tune", 600),
            Stage("evaluate finetune-bert-gpt valid", "evaluate", 1),
        ]
    )
    clock.finish("pretrain gpt", 50.0)
    clock.start("fine-tune random-random")
    line = "step 240/600 | loss 4.1 | 3000 tok/s | 192s | ETA 04:48 | last ckpt none yet"
    assert own_eta_s(line) == 288.0
    assert own_eta_s("evaluate valid: 10/100 sentence (10%), elapsed 1:02:03, ETA 1:00:00") == 3600
    assert own_eta_s("no figure here") is None
    # 192 s run + 288 s left = 480 s for 600 steps: the other fine-tuning takes as long.
    assert (
        clock.eta(running_s=192.0, running_left_s=own_eta_s(line))
        == "1/5 stages done, overall ETA >= 12:48 (evaluate not yet timed)"
    )
    # A line without an ETA leaves the kind untimed, and the job says it knows nothing yet.
    assert (
        clock.eta(running_s=192.0, running_left_s=None)
        == "1/5 stages done, overall ETA not known yet (fine-tune, evaluate not yet timed)"
    )


def test_a_running_stage_shows_its_latest_progress_line_and_the_overall_eta(
    tmp_path, monkeypatch, capsys
):
    from launch.main.job import _run
    from launch.main.plan import Stage, StageClock

    monkeypatch.setenv("PROGRESS_EVERY_S", "1")
    clock = StageClock([Stage("export gpt", "export", 1), Stage("fine-tune x", "fine-tune", 4)])
    clock.finish("export gpt", 2.0)
    script = (
        "import sys, time\n"
        "for step in (1, 2, 3):\n"
        "    print(f'step {step}/3 | loss 1.0 | 99 tok/s | 1s | ETA 00:0{3 - step} | last ckpt none yet', flush=True)\n"
        "    print('some other line', flush=True)\n"
        "    time.sleep(1.2)\n"
    )
    _run("fine-tune x", [sys.executable, "-c", script], tmp_path / "logs" / "x.log", clock)
    said = capsys.readouterr().err.splitlines()
    running = [line for line in said if line.startswith("[main] fine-tune x (")]
    assert running, said
    for line in running:
        assert re.match(
            r"\[main\] fine-tune x \(00:0\d\): step [123]/3 \| .* \| ETA 00:0\d \| last ckpt none yet; "
            r"1/2 stages done, overall ETA 00:0\d$",
            line,
        ), line
    assert said[-1].startswith("[main] fine-tune x: done in ") and said[-1].endswith(
        "2/2 stages done, overall ETA 00:00"
    )


# ----------------------------------------------------------------------------- the entry points


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory) -> dict:
    """A tiny translation run (4 steps, checkpoints at 2 and 4), its training stderr and its export."""
    root = tmp_path_factory.mktemp("progress")
    run_dir, exported = root / "run", root / "export"
    train = python_m(
        "launch.train",
        str(ROOT / "configs" / "tiny_translation.yaml"),
        f"data.data_dir={tiny_dataset}",
        f"run_dir={run_dir}",
        *TRAIN,
    )
    assert train.returncode == 0, train.stderr[-4000:]
    export = python_m("launch.export", f"checkpoint={run_dir}", f"out={exported}")
    assert export.returncode == 0, export.stderr[-4000:]
    return {
        "root": root,
        "run": run_dir,
        "export": exported,
        "data": tiny_dataset,
        "train": train.stderr,
        "export_stderr": export.stderr,
    }


def test_training_line_has_tokens_per_second_eta_and_last_checkpoint(trained):
    lines = {
        int(m[1]): line
        for line in trained["train"].splitlines()
        if (m := re.match(r"step (\d+)/4 \|", line))
    }
    assert sorted(lines) == [1, 2, 3, 4], trained["train"][-3000:]
    for step, line in lines.items():
        assert re.search(r"\| \d+ tok/s \|", line) and re.search(r"\| ETA \d\d:\d\d \|", line), line
    # saved after the line
    assert lines[1].endswith("| last ckpt none yet") and lines[2].endswith("| last ckpt none yet")
    assert re.search(r"\| last ckpt step 2 at \d\d:\d\d:\d\d$", lines[3]), lines[3]
    assert lines[4].endswith("| ETA 00:00 | " + lines[3].rpartition("| ")[2])


def test_a_resumed_run_counts_its_eta_from_where_it_resumed_and_names_that_checkpoint(
    trained, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained["run"], run_dir)
    resumed = python_m(
        "launch.train",
        str(ROOT / "configs" / "tiny_translation.yaml"),
        f"data.data_dir={trained['data']}",
        f"run_dir={run_dir}",
        *TRAIN,
        "max_steps=6",
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    lines = [line for line in resumed.stderr.splitlines() if re.match(r"step \d+/6 \|", line)]
    assert [line.split()[1] for line in lines] == ["5/6", "6/6"], resumed.stderr[-3000:]
    assert re.search(r"\| ETA \d\d:\d\d \| last ckpt step 4 at \d\d:\d\d:\d\d$", lines[0]), lines[0]


def test_export_and_average_show_plain_progress_without_a_terminal(trained):
    export = plain_lines(trained["export_stderr"], "export step_00000004")
    assert [(m["n"], m["total"], m["unit"]) for m in export] == [
        ("1", "2", "phase"),
        ("2", "2", "phase"),
    ]
    out = trained["root"] / "averaged"
    average = python_m("launch.average", f"checkpoint={trained['run']}", "last=2", f"out={out}")
    assert average.returncode == 0, average.stderr[-3000:]
    read = plain_lines(average.stderr, "average")
    assert [(m["n"], m["total"], m["unit"]) for m in read] == [
        ("1", "2", "checkpoint"),
        ("2", "2", "checkpoint"),
    ]


def test_validate_shows_plain_lines_in_a_log_and_a_bar_on_a_terminal(tiny_dataset):
    run = python_m("pipeline.validate", f"data_dir={tiny_dataset}")
    assert run.returncode == 0, run.stderr[-3000:]
    shards = int(re.search(r": (\d+) shards checked, 0 problem", run.stdout)[1])
    assert [int(m["n"]) for m in plain_lines(run.stderr, "validate")] == list(range(1, shards + 1))
    assert "\r" not in run.stderr

    code, seen = on_pty("pipeline.validate", f"data_dir={tiny_dataset}")
    assert code == 0, seen[-3000:]
    assert "\r" in seen and "validate: 100%|" in seen and f"| {shards}/{shards} [" in seen, seen[
        -2000:
    ]


def test_evaluate_shows_progress_on_one_rank_only(trained):
    one = python_m(
        "launch.evaluate",
        f"checkpoint={trained['export']}",
        f"data_dir={trained['data']}",
        *DECODE,
        f"out={trained['root'] / 'eval-1'}",
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert [(m["n"], m["total"]) for m in plain_lines(one.stderr, "evaluate valid")] == [
        ("4", "20"),
        ("8", "20"),
        ("12", "20"),
        ("16", "20"),
        ("20", "20"),
    ]

    two = python_m(
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "launch.evaluate",
        f"checkpoint={trained['export']}",
        f"data_dir={trained['data']}",
        *DECODE,
        "threads_per_rank=1",
        f"out={trained['root'] / 'eval-2'}",
    )
    assert two.returncode == 0, two.stderr[-3000:]
    shown = plain_lines(two.stderr, "evaluate valid")
    # Rank 0 holds batches 0, 2 and 4 of the five: three lines, all its own; rank 1 prints none.
    assert [m["desc"] for m in shown] == ["evaluate valid (rank 0 of 2)"] * 3, two.stderr[-3000:]
    assert [(m["n"], m["total"]) for m in shown] == [("4", "12"), ("8", "12"), ("12", "12")]


def test_translate_of_a_file_shows_progress(trained, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text(
        "the red cat\nthe old house\n\na new list\nthe door\nthe window", encoding="utf-8"
    )
    run = python_m(
        "launch.translate",
        f"checkpoint={trained['export']}",
        f"input={source}",
        "beam=1",
        "max_len=8",
        "micro_batch_size=2",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.stdout.split("\n")) == 7  # six lines, one translation each
    assert [(m["n"], m["total"], m["unit"]) for m in plain_lines(run.stderr, "translate")] == [
        ("2", "6", "line"),
        ("4", "6", "line"),
        ("6", "6", "line"),
    ]

    code, seen = on_pty(
        "launch.translate",
        f"checkpoint={trained['export']}",
        f"input={source}",
        "beam=1",
        "max_len=8",
        "micro_batch_size=2",
    )
    assert code == 0, seen[-3000:]
    assert "\r" in seen and "translate: 100%|" in seen and "| 6/6 [" in seen, seen[-2000:]

    piped = python_m(
        "launch.translate",
        f"checkpoint={trained['export']}",
        "beam=1",
        "max_len=8",
        stdin="the red cat\n",
    )
    # standard input: no progress
    assert piped.returncode == 0 and not plain_lines(piped.stderr, "translate")
