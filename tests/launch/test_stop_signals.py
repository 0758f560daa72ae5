"""Every catchable signal that a scheduler, a shell or the kernel sends before a kill ends a
training job checkpointed, whichever process gets it (issue 61, item 3): SIGTERM, SIGINT,
SIGUSR1, SIGHUP, SIGQUIT, SIGXCPU and SIGXFSZ, to a rank, to its DataLoader worker, or to the
launcher (torchrun passes SIGQUIT on to each rank's process group; a signal it does not handle
kills it, which the ranks take for a stop request: test_reliability.py). SIGQUIT killed the ranks
and their workers unsaved; a CPU-time limit (`ulimit -t`: a SIGKILL with no SIGXCPU before it,
or SIGXCPU where a soft limit is set below the hard one) ended a run with its steps lost; and a
write past the file size limit (EFBIG; SIGXFSZ, which Python ignores) ended it at its next log
line.

Cheap first: each signal in a real process that installed `launch.stop` (a stop request, a
repeat no "now" except SIGINT's), a forked worker passing its own limits' signals on to the rank,
the kernel's own SIGXCPU and EFBIG, the main job's signals. Then four tiny runs: SIGQUIT to
torchrun (checkpointed, and resumed from there), a real `ulimit -t` on torchrun and its ranks,
and a real `ulimit -f` on a one-process run, reached by a log (checkpointed, but not left for a
requeue) or by a checkpoint file (its save refused in one line). Linux (/proc, setrlimit)."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import ENV, packed_data, train_command
from processes import alive, command_of, descendants, kill_all, parent_of, wait_for
from repo import ROOT
from trainruns import steps_of

from launch import checkpoint as ckpt
from launch.main import job as main_job
from launch.stop import SIGNALS

PYTHON = sys.executable
LINUX = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="finds processes through /proc"
)
SEVEN = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP", "SIGQUIT", "SIGXCPU", "SIGXFSZ")


def test_the_stop_signals_are_the_seven_a_kill_may_follow():
    assert sorted(s.name for s in SIGNALS) == sorted(SEVEN)
    assert sorted(s.name for s in main_job.STOP_SIGNALS) == sorted(SEVEN)


# ----------------------------------------------------------------------------- one process

# Installs the stop handlers, then signals itself with argv[2] twice, or runs argv[2] as a case.
PROBE = """
import json, os, resource, signal, sys, time
sys.path.insert(0, {root!r})
from launch import stop
stop.install(sys.argv[1])
report = {{}}
def done(**more):
    report.update(more, requested=stop.requested(), signals=stop._signals,
                  past_file_size_limit=getattr(stop, "past_file_size_limit", bool)(),
                  cpu=resource.getrlimit(resource.RLIMIT_CPU))
    print(json.dumps(report), flush=True)
case = sys.argv[2]
if case.startswith("SIG"):
    signum = getattr(signal, case)
    report["handled"] = signal.getsignal(signum) is stop._on_signal
    try:
        for _ in range(2):
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # the handler runs here, in the main thread
        report["second"] = "a stop request"
    except KeyboardInterrupt:
        report["second"] = "KeyboardInterrupt"
    done()
elif case == "worker":  # a forked process, as a DataLoader worker is
    child = os.fork()
    if child == 0:
        for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP", "SIGQUIT", "SIGXCPU", "SIGXFSZ"):
            os.kill(os.getpid(), getattr(signal, name))
            time.sleep(0.05)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    deadline = time.monotonic() + 5
    while len(stop._signals) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    done(child_status=status)
elif case == "cpu":  # burn CPU until the kernel's SIGXCPU asks us to stop
    while not stop.requested():
        pass
    done(at=time.process_time())
elif case == "fsize":  # write past the file size limit
    target = os.path.join(sys.argv[1], "metrics.jsonl")
    try:
        with stop.log_write(), open(target, "a") as fh:
            fh.write("x" * 4096)
    except AttributeError:  # no log_write: as the trainer wrote its logs before
        with open(target, "a") as fh:
            fh.write("x" * 4096)
    logged = os.path.getsize(target)
    try:
        with open(os.path.join(sys.argv[1], "other"), "w") as fh:
            fh.write("x" * 4096)
        other = "written"
    except OSError as err:
        other = err.errno
    done(logged=logged, other=other)
"""


def probe(tmp_path: Path, case: str, limits: dict | None = None) -> tuple[dict, str]:
    """Run PROBE's `case` in a process of its own, under `limits` (setrlimit's, set before it
    starts, as `ulimit` is): what it reported, and its stderr."""

    def set_limits():
        for which, values in (limits or {}).items():
            resource.setrlimit(which, values)

    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(root=str(ROOT)))
    run = subprocess.run(
        [PYTHON, str(script), str(tmp_path), case],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=set_limits,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    return json.loads(run.stdout.splitlines()[-1]), run.stderr


@LINUX
@pytest.mark.parametrize("name", SEVEN)
def test_each_stop_signal_is_a_stop_request_and_only_sigint_twice_is_now(tmp_path, name):
    report, _ = probe(tmp_path, name)
    assert report["handled"] and report["requested"], report
    if name == "SIGINT":
        assert report["second"] == "KeyboardInterrupt" and report["signals"] == ["SIGINT"]
    else:  # a scheduler's or the kernel's repeat (SIGXCPU every second) is the same request
        assert report["second"] == "a stop request" and report["signals"] == [name, name], report
    assert report["past_file_size_limit"] == (name == "SIGXFSZ")


@LINUX
def test_a_worker_passes_its_own_limits_signals_to_its_rank_and_survives_the_others(tmp_path):
    """A forked process (a DataLoader worker) inherits the handler: SIGXCPU and SIGXFSZ, which its
    own limits send it alone, become its rank's stop request; the others, which reach it with
    its rank's process group (torchrun's SIGQUIT, SIGHUP, SIGTERM), do not end it."""
    report, _ = probe(tmp_path, "worker")
    assert report["child_status"] == 0, report
    assert sorted(report["signals"]) == ["SIGXCPU", "SIGXFSZ"], report


@LINUX
@pytest.mark.parametrize(
    "limit, asked_at, after",
    [((4, 4), 2, (4, 4)), ((2, 6), 2, (6, 6))],
    ids=["ulimit -t: soft = hard", "soft below hard"],
)
def test_the_kernels_sigxcpu_comes_with_room_left_under_the_hard_limit(
    tmp_path, limit, asked_at, after
):
    """`ulimit -t 4` sets soft = hard = 4: the kernel would SIGKILL at 4 CPU seconds with no
    SIGXCPU before it. The process lowers its soft limit (by half, at a limit this small) and
    gets SIGXCPU at 2 s; a soft limit of the user's, below the hard one, is left. The first SIGXCPU
    raises the soft limit to the hard one: no more come while the rank checkpoints."""
    report, stderr = probe(tmp_path, "cpu", {resource.RLIMIT_CPU: limit})
    assert report["signals"] == ["SIGXCPU"], report
    # the kernel counts CPU time at its ticks, Python's process_time more finely
    assert asked_at - 0.25 <= report["at"] < asked_at + 1, report
    assert tuple(report["cpu"]) == after
    lowered = "each rank asks for SIGXCPU at 2 s instead" in stderr
    assert lowered == (limit[0] == limit[1]), stderr


@LINUX
def test_a_log_write_past_the_file_size_limit_is_dropped_as_a_stop_request(tmp_path):
    """Past RLIMIT_FSIZE the kernel sends SIGXFSZ, whose default kills the process: handled, the
    write fails with EFBIG instead, which a log write drops (the rank goes on to its checkpoint)
    and any other write raises."""
    report, _ = probe(tmp_path, "fsize", {resource.RLIMIT_FSIZE: (1024, 1024)})
    assert report["logged"] == 1024 and report["other"] == 27, report  # EFBIG
    assert report["past_file_size_limit"] and report["requested"], report


def test_the_main_job_passes_each_stop_signal_on_as_one_its_stage_takes_and_ignores_repeats(
    monkeypatch,
):
    """SIGINT as itself (a second is "now" to a rank), any other as SIGTERM: SIGUSR1, SIGXCPU or
    SIGXFSZ passed on as they are would kill torchrun outright. The kernel's repeats of SIGXCPU
    and SIGXFSZ are not the second signal that kills the stage."""
    for name in SEVEN:
        passed = main_job.stage_signal(getattr(signal, name))
        assert passed == (signal.SIGINT if name == "SIGINT" else signal.SIGTERM), name
    monkeypatch.setattr(main_job, "_stopping", False)
    with pytest.raises(main_job.Stopped):
        main_job._on_signal(signal.SIGXCPU, None)
    main_job._on_signal(signal.SIGXCPU, None)  # a repeat: nothing
    main_job._on_signal(signal.SIGXFSZ, None)
    with pytest.raises(main_job.Stopped):
        main_job._on_signal(signal.SIGTERM, None)


# ----------------------------------------------------------------------------- tiny runs

LONG_RUN = [
    "model.max_seq_len=32",
    "max_steps=100000",
    "log_every=1",
    "eval_every=0",
    "checkpoint.every_steps=0",
    "data.log_sample_keys=true",
]


def torchrun(data: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *train_command(data, run_dir, *overrides),
    ]


def is_rank(pid: int) -> bool:
    words = set(command_of(pid).split())
    return "launch.train" in words and "torch.distributed.run" not in words


def wait_until_trained(job: subprocess.Popen, run_dir: Path, stderr: Path, ranks: int = 2) -> None:
    wait_for(
        lambda: job.poll() is not None or all(len(steps_of(run_dir, r)) >= 3 for r in range(ranks)),
        300,
        "the ranks to train",
    )
    assert job.poll() is None, (
        f"the job ended before it was signalled: {stderr.read_text()[-3000:]}"
    )


def stopped_at(run_dir: Path, text: str, ranks: int = 2) -> int:
    """The step every rank reached, checkpointed and complete."""
    last = steps_of(run_dir, 0)[-1]
    assert all(steps_of(run_dir, r)[-1] == last for r in range(ranks)), text[-3000:]
    root = ckpt.checkpoint_root(run_dir)
    assert ckpt.latest_tag(root) == f"step_{last:08d}", text[-3000:]
    assert ckpt.verify(root / f"step_{last:08d}") is None
    return last


@LINUX
@pytest.mark.slow
def test_sigquit_to_torchrun_ends_the_ranks_checkpointed_and_the_run_resumes_there(tmp_path):
    """torchrun takes SIGQUIT for a death signal and sends it to each rank's process group (the
    rank and its DataLoader worker), killing them 30 s later. The ranks, whom it killed unsaved,
    stop at the step, checkpointed, and exit 0; the workers live on until their ranks close
    them; a re-run resumes from that step."""
    data, run_dir, stderr = tmp_path / "data", tmp_path / "run", tmp_path / "stderr"
    packed_data(data, seq_len=32, sizes=(400, 400))
    job = subprocess.Popen(
        torchrun(data, run_dir, *LONG_RUN, "data.num_workers=1"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "w"),
    )
    processes: list[int] = []
    try:
        wait_until_trained(job, run_dir, stderr)
        processes = descendants(job.pid)
        ranks = [pid for pid in processes if is_rank(pid) and not is_rank(parent_of(pid))]
        assert len(ranks) == 2 and len(processes) == 4, [command_of(p) for p in processes]
        reached = len(steps_of(run_dir, 0))
        job.send_signal(signal.SIGQUIT)
        wait_for(lambda: not any(alive(p) for p in processes), 40, "every process to end")
        job.wait(timeout=30)
    finally:
        kill_all([job.pid, *processes])
    text = stderr.read_text()
    assert "got signal: 3" in text, text[-3000:]  # torchrun's own SignalException
    assert "DataLoader worker" not in text and "exitcode  : -3" not in text, text[-3000:]
    last = stopped_at(run_dir, text)
    assert last >= reached
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": last}
    said = [line for line in text.splitlines() if line.startswith("stop requested")]
    assert said == [f"stop requested: checkpoint at step {last} saved; exiting for a requeue"], (
        text[-3000:]
    )

    resumed = subprocess.run(
        torchrun(data, run_dir, *LONG_RUN, f"max_steps={last + 2}"),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    root = ckpt.checkpoint_root(run_dir)
    assert f"resumed from {root / f'step_{last:08d}'} at step {last}" in resumed.stderr
    assert json.loads((run_dir / "final.json").read_text())["step"] == last + 2
    assert steps_of(run_dir, 0)[-2:] == [last + 1, last + 2]


@LINUX
@pytest.mark.slow
def test_a_cpu_time_limit_ends_the_ranks_checkpointed_before_the_kernel_kills_them(tmp_path):
    """`ulimit -t 16` on torchrun and so on its ranks (soft = hard: the kernel's SIGKILL at 16 CPU
    seconds, with no SIGXCPU before it). Each rank asks for SIGXCPU at 8 s, stops at the step it
    is in, checkpointed, and exits 0 well before 16 s; torchrun, which spends little CPU, ends
    with its ranks (had it died of the limit first, the ranks would have stopped on its death
    and it would not exit 0)."""
    data, run_dir, stderr = tmp_path / "data", tmp_path / "run", tmp_path / "stderr"
    packed_data(data, seq_len=32, sizes=(400, 400))
    job = subprocess.Popen(
        torchrun(data, run_dir, *LONG_RUN, "data.num_workers=0"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "w"),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CPU, (16, 16)),
    )
    processes: list[int] = []
    try:
        wait_until_trained(job, run_dir, stderr)
        processes = descendants(job.pid)
        code = job.wait(timeout=120)
        wait_for(lambda: not any(alive(p) for p in processes), 10, "every process to end")
    finally:
        kill_all([job.pid, *processes])
    text = stderr.read_text()
    assert code == 0, text[-3000:]
    assert "each rank asks for SIGXCPU at 8 s instead" in text, text[-3000:]
    last = stopped_at(run_dir, text)
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": last}
    said = [line for line in text.splitlines() if line.startswith("stop requested")]
    assert said == [f"stop requested: checkpoint at step {last} saved; exiting for a requeue"], (
        text[-3000:]
    )


FILE_SIZE_LIMIT = 4 << 20  # over the one-rank checkpoint's largest file (about 1.8 MiB)


def limited_run(tmp_path: Path, *overrides: str) -> tuple[int, str, Path]:
    """A one-process run under `ulimit -f` FILE_SIZE_LIMIT: its exit status, stderr and run_dir."""
    data, run_dir, stderr = tmp_path / "data", tmp_path / "run", tmp_path / "stderr"
    packed_data(data, seq_len=32, sizes=(400, 400))
    run_dir.mkdir(exist_ok=True)
    limit = (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT)
    code = subprocess.run(
        [PYTHON, *train_command(data, run_dir, "model.max_seq_len=32", *overrides)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "w"),
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, limit),
    ).returncode
    return code, stderr.read_text(), run_dir


@LINUX
@pytest.mark.slow
def test_a_log_past_the_file_size_limit_ends_the_run_checkpointed_and_not_for_a_requeue(tmp_path):
    """A long run's log reaches `ulimit -f` (here a sample-keys log that a run before this one
    grew to a few lines short of it): the kernel refuses the write (EFBIG) with SIGXFSZ, which
    Python ignores, and the rank died of the OSError at that log line, unsaved. Now the line is
    dropped and the run stops at the step, checkpointed; a requeued job would meet the same limit,
    so the run ends in one error line (exit 2), without preempted.json."""
    log = tmp_path / "run" / "sample_keys.rank0.jsonl"
    log.parent.mkdir()
    line = json.dumps({"step": 0, "keys": []}) + "\n"
    log.write_text(line * ((FILE_SIZE_LIMIT - 2000) // len(line)))
    code, text, run_dir = limited_run(tmp_path, *LONG_RUN)
    assert log.stat().st_size == FILE_SIZE_LIMIT  # the refused line's first bytes, no more
    rows = [json.loads(row)["step"] for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert rows == list(range(1, last + 1)) and last > 1
    root = ckpt.checkpoint_root(run_dir)
    assert (
        ckpt.latest_tag(root) == f"step_{last:08d}"
        and ckpt.verify(root / f"step_{last:08d}") is None
    )
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 2 and errors == [
        "error: a write went past the file size limit (SIGXFSZ; RLIMIT_FSIZE, `ulimit -f`: "
        f"4.0 MiB): checkpoint at step {last} saved; not left for a requeue, which would meet "
        "the same limit: raise it, or make room under it (metrics.jsonl, the log), and start the "
        "job again, which resumes from there"
    ], (code, text[-3000:])
    assert not (run_dir / "preempted.json").exists() and "Traceback" not in text


@LINUX
@pytest.mark.slow
def test_a_checkpoint_file_past_the_file_size_limit_fails_its_save_in_one_line(tmp_path):
    """A checkpoint file larger than `ulimit -f` cannot be written under it: the save fails in one
    line naming the limit (not a file system to make room on), the partial checkpoint removed."""
    code, text, run_dir = limited_run(
        tmp_path, "max_steps=2", "model.d_model=128", "model.d_ff=512"
    )
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, (code, text[-3000:])
    assert errors[0].startswith("error: checkpoint step_00000002 not saved: rank 0 writing "), (
        errors
    )
    assert (
        ": File too large, past the file size limit (RLIMIT_FSIZE, `ulimit -f`: 4.0 MiB), which "
        "this run's checkpoint files outgrow; the partial step_00000002 is removed and no "
        "checkpoint of this run is complete yet: raise the limit and start the job again"
    ) in errors[0], errors
    assert not (ckpt.checkpoint_root(run_dir) / "step_00000002").exists()
