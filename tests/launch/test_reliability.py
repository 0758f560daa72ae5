"""Failures a job must survive or report plainly (issue 16): ranks die with their launcher; a
broken manifest, a model shorter than its data, an unwritable run directory and a taken
rendezvous port end the run with one `error:` line and exit status 2, before anything
expensive; ranks over uneven shards stay in step through several epochs with DataLoader workers.

Processes are found through /proc, so the launcher tests need Linux.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import ENV, packed_data, run_cli, train_command
from corpora import free_port
from errorlines import assert_one_error_line
from processes import alive, children, command_of, descendants, kill_all, parent_of, wait_for
from repo import ROOT
from shardtools import VOCAB_SIZE, make_dataset, save_manifest, shard_ids
from trainruns import steps_of

from common.configure import UserError
from launch.distributed import port_in_use
from launch.launcher import launcher_kind
from launch.preconditions import check_writable_dir, data_fits_model, input_positions, longest_input
from model import ModelConfig
from pipeline.format import FIELDS, MANIFEST, decode_array, read_manifest
from pipeline.load.shards import Shard, read_shard
from pipeline.specials import sentencepiece_specials

PYTHON = sys.executable
LINUX = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="finds processes through /proc"
)


# ----------------------------------------------------------------------------- processes


# A stand-in launcher: starts CHILD (which arms die_with_parent and reports), writes its pid,
# and then lives on until killed, or exits at once (EXIT_AT_ONCE). With FROM_THREAD it starts
# the child from a thread that ends right after, which PR_SET_PDEATHSIG takes for the parent dying.
LAUNCHER = """
import os, subprocess, sys, threading, time
env = dict(os.environ, **{KIND_ENV!r})
def start():
    child = subprocess.Popen([sys.executable, {child!r}, {report!r}], env=env)
    open({report!r} + ".pid", "w").write(str(child.pid))
if {FROM_THREAD}:
    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
else:
    start()
if not {EXIT_AT_ONCE}:
    time.sleep(600)
"""
CHILD = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
# SIG_IGN is what nohup leaves to the program it starts; the default, whatever ran the tests.
signal.signal(signal.SIGHUP, signal.SIG_IGN if {NOHUP} else signal.SIG_DFL)
from launch.launcher import die_with_parent
kind = die_with_parent(interval_s={INTERVAL})
open(sys.argv[1] + ".partial", "w").write(f"{{os.getpid()}} {{kind}}")
os.replace(sys.argv[1] + ".partial", sys.argv[1])
time.sleep(600)
"""


def start_launcher(
    tmp_path: Path,
    kind_env: dict,
    *,
    from_thread=False,
    exit_at_once=False,
    nohup=False,
    watch_interval_s=0.2,
):
    child, report = tmp_path / "child.py", tmp_path / "armed"
    child.write_text(CHILD.format(root=str(ROOT), NOHUP=nohup, INTERVAL=watch_interval_s))
    code = LAUNCHER.format(
        KIND_ENV=kind_env,
        child=str(child),
        report=str(report),
        FROM_THREAD=from_thread,
        EXIT_AT_ONCE=exit_at_once,
    )
    launcher = subprocess.Popen(
        [PYTHON, "-c", code], env=ENV, stderr=open(tmp_path / "stderr", "w")
    )
    return launcher, report


def child_pid(report: Path) -> int:
    pid_file = Path(f"{report}.pid")
    return int(
        wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 30, "the child to start")
    )


def armed(report: Path) -> str:
    """What the child reported once die_with_parent returned: "PID KIND"."""
    return wait_for(lambda: report.is_file() and report.read_text(), 60, "the child to arm")


@LINUX
@pytest.mark.parametrize(
    "kind_env", [{}, {"TORCHELASTIC_RUN_ID": "test"}], ids=["watchdog", "pdeathsig"]
)
def test_a_rank_dies_when_its_launcher_is_killed(tmp_path, kind_env):
    # Under torchrun the watchdog is slowed down to 10 minutes: only the kernel's PR_SET_PDEATHSIG
    # can act in time.
    launcher, report = start_launcher(tmp_path, kind_env, watch_interval_s=600 if kind_env else 0.2)
    pid = None
    try:
        pid = child_pid(report)
        assert armed(report) == f"{pid} {'torchrun' if kind_env else 'plain'}"
        assert alive(pid)
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(pid), 5, f"the child {pid} to die with its launcher")
    finally:
        kill_all([launcher.pid] + ([pid] if pid else []))


@LINUX
def test_a_rank_whose_launcher_died_while_it_started_exits_at_once(tmp_path):
    launcher, report = start_launcher(tmp_path, {"TORCHELASTIC_RUN_ID": "test"}, exit_at_once=True)
    pid = child_pid(report)  # it starts before its launcher exits
    try:
        # by now the child has been handed to init or a subreaper, while it imports torch
        launcher.wait()
        adopter = parent_of(pid)
        if adopter and "python" in Path(command_of(adopter).split(" ")[0]).name:
            pytest.skip(
                "orphans go to a Python process here, which may be a launcher for all a rank can tell"
            )
        wait_for(lambda: not alive(pid), 60, "the orphaned child to exit")
        assert not report.exists()  # it never got past die_with_parent
        assert "launcher that started this rank is gone" in (tmp_path / "stderr").read_text()
    finally:
        kill_all([pid])


@LINUX
def test_no_false_kill_and_a_detached_run_is_left_alone(tmp_path):
    # A plain parent may start us from a thread that ends at once: the watchdog looks at the
    # parent process, not the thread, so the child lives as long as the launcher.
    launcher, report = start_launcher(tmp_path, {}, from_thread=True)
    pid = None
    try:
        pid = child_pid(report)
        armed(report)
        time.sleep(1.5)
        assert alive(pid), (tmp_path / "stderr").read_text()
    finally:
        kill_all([launcher.pid] + ([pid] if pid else []))

    # Started under nohup: the run was meant to outlive whoever started it.
    nohup = tmp_path / "nohup"
    nohup.mkdir()
    launcher, report = start_launcher(nohup, {}, nohup=True)
    pid = None
    try:
        pid = child_pid(report)
        assert armed(report) == f"{pid} None"
        launcher.kill()
        launcher.wait()
        time.sleep(1.0)
        assert alive(pid)
    finally:
        kill_all([launcher.pid] + ([pid] if pid else []))


def test_launcher_kinds():
    assert launcher_kind({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}) == "torchrun"
    assert launcher_kind({"CROSS_RANK": "0", "LOCAL_SIZE": "2", "RANK": "0"}) == "deepspeed"
    assert launcher_kind({"SLURM_STEP_ID": "0", "SLURM_TASK_PID": str(os.getpid())}) == "srun"
    # A program that an srun task started in turn, or the batch script's own step, is not srun's
    # task.
    assert launcher_kind({"SLURM_STEP_ID": "0", "SLURM_TASK_PID": "1"}) == "plain"
    assert launcher_kind({"SLURM_PROCID": "0", "SLURM_TASK_PID": str(os.getpid())}) == "plain"
    assert launcher_kind({}) == "plain"


# ----------------------------------------------------------------------------- real launchers


def start_job(launcher: str, data: Path, run_dir: Path, stderr: Path) -> subprocess.Popen:
    """Two ranks of a long tiny-GPT run, with a DataLoader worker each, under torchrun or the
    deepspeed runner (which starts deepspeed.launcher.launch, which starts the ranks)."""
    train = train_command(
        data,
        run_dir,
        "max_steps=100000",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=0",
        "data.log_sample_keys=true",
        "data.num_workers=1",
    )
    if launcher == "torchrun":
        command = [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            *train,
        ]
    else:
        command = [
            str(Path(PYTHON).with_name("deepspeed")),
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            *train[1:],
        ]
    return subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=open(stderr, "w")
    )


def is_rank(pid: int) -> bool:
    """A launch.train process (a rank or its DataLoader worker), not the launcher that names it."""
    words = set(command_of(pid).split())
    return "launch.train" in words and not words & {
        "torch.distributed.run",
        "deepspeed.launcher.launch",
    }


@LINUX
@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, target, signum",
    [
        ("torchrun", "ranks", signal.SIGUSR1),
        ("torchrun", "launcher", signal.SIGUSR1),
        ("torchrun", "launcher", signal.SIGKILL),
        ("deepspeed", "launcher", signal.SIGUSR1),
        ("deepspeed", "launcher", signal.SIGKILL),
        ("torchrun", "launcher", signal.SIGHUP),
        ("torchrun", "rank", signal.SIGHUP),
    ],
    ids=[
        "torchrun-ranks-USR1",
        "torchrun-USR1",
        "torchrun-KILL",
        "deepspeed-runner-USR1",
        "deepspeed-runner-KILL",
        "torchrun-HUP",
        "torchrun-one-rank-HUP",
    ],
)
def test_a_signal_to_the_ranks_or_their_launcher_ends_them_with_a_checkpoint(
    tiny_dataset, tmp_path, launcher, target, signum
):
    """Issue #28, item 4. SIGUSR1 to the ranks (SLURM's `--signal=B:USR1` path, through the
    batch script) asks them to checkpoint and exit for a requeue. SIGUSR1 to the launcher (what
    `scancel --signal=USR1` or `--signal=USR1` without `B:` does) kills torchrun or the deepspeed
    runner outright, as a kill -9 does: the ranks, left without it, stop the same way instead of
    dying unsaved. Either way every rank ends within 10 s, the step it reached checkpointed, with
    RUN_DIR/preempted.json and the one stop line. Issue #45, item 2: SIGHUP (the terminal or SSH
    session closed), which torchrun passes on to its ranks and their DataLoader workers, or which
    reaches one rank alone, is such a stop request too; it killed them unsaved."""
    run_dir, stderr = tmp_path / "run", tmp_path / "stderr"
    job = start_job(launcher, tiny_dataset, run_dir, stderr)
    processes: list[int] = []
    try:
        wait_for(
            lambda: job.poll() is not None or all(steps_of(run_dir, r) for r in range(2)),
            300,
            "both ranks to train",
        )
        assert job.poll() is None, (
            f"the job ended before it was signalled: {stderr.read_text()[-3000:]}"
        )
        # the ranks, their DataLoader workers, DeepSpeed's launch.py
        processes = descendants(job.pid)
        # not their workers
        ranks = [pid for pid in processes if is_rank(pid) and not is_rank(parent_of(pid))]
        assert len(ranks) == 2, [command_of(pid) for pid in processes]
        reached = len(steps_of(run_dir, 0))
        for pid in {"ranks": ranks, "rank": ranks[:1]}.get(target, [job.pid]):
            os.kill(pid, signum)
        signalled = time.monotonic()
        try:
            wait_for(
                lambda: not any(alive(pid) for pid in processes),
                10,
                "every process of the job to end",
            )
        except AssertionError:
            raise AssertionError(
                f"{[command_of(p)[:80] for p in processes if alive(p)]} still alive 10 s after "
                f"{signum.name} to the {target}: {stderr.read_text()[-3000:]}"
            ) from None
        print(
            f"\n{signum.name} to the {target} of {launcher}: every process gone "
            f"{time.monotonic() - signalled:.1f} s later"
        )
        if target in ("ranks", "rank"):
            assert job.wait(timeout=30) == 0, stderr.read_text()[-3000:]
    finally:
        kill_all([job.pid, *processes])
    text = stderr.read_text()
    last = steps_of(run_dir, 0)[-1]
    # no step lost, none trained after the stop
    assert last >= reached and steps_of(run_dir, 1)[-1] == last
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": last}, text[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"
    said = [line for line in text.splitlines() if line.startswith("stop requested")]
    assert said == [f"stop requested: checkpoint at step {last} saved; exiting for a requeue"], (
        text[-3000:]
    )


# ----------------------------------------------------------------------------- one-line errors


def test_the_error_line_is_written_in_one_piece(monkeypatch):
    """Every rank of a job says the same error into one stream (stderr is written through to the
    pipe at each write): in two writes, the text and then its newline, two ranks' lines splice."""
    from common.configure import run_main

    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    def fail():
        raise UserError("a named problem")

    monkeypatch.setattr(sys, "stderr", Stream())
    with pytest.raises(SystemExit):
        run_main(fail)
    assert writes == ["error: a named problem\n"]


BAD_MANIFESTS = {
    "a JSON list": (lambda m: [m], "a JSON list, expected an object"),
    "no tokenizer": (
        lambda m: {k: v for k, v in m.items() if k != "tokenizer"},
        "no tokenizer record",
    ),
    "tokenizer not an object": (
        lambda m: {**m, "tokenizer": "sp.model"},
        "the tokenizer record is a JSON string",
    ),
    "no sha256": (
        lambda m: {**m, "tokenizer": {"vocab_size": 10}},
        "the tokenizer record has no sha256",
    ),
    "no vocab_size": (
        lambda m: {**m, "tokenizer": {"sha256": "ab" * 32}},
        "the tokenizer record has no vocab_size",
    ),
    "bad vocab_size": (
        lambda m: {**m, "tokenizer": {**m["tokenizer"], "vocab_size": "4096"}},
        "vocab_size '4096' is not a positive integer",
    ),
    "bad sha256": (
        lambda m: {**m, "tokenizer": {**m["tokenizer"], "sha256": None}},
        "sha256 None is not 64 hex",
    ),
    "datasets a list": (lambda m: {**m, "datasets": []}, "datasets is a JSON list"),
}


@pytest.mark.parametrize("case", BAD_MANIFESTS, ids=list(BAD_MANIFESTS))
def test_a_broken_manifest_is_refused_in_one_line_naming_the_file(tmp_path, case):
    change, expected = BAD_MANIFESTS[case]
    manifest = make_dataset(tmp_path, packed=[8])
    read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps(change(manifest)))
    with pytest.raises(UserError) as err:
        read_manifest(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / MANIFEST}: ") and expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["a JSON list", "no tokenizer", "no vocab_size"])
def test_the_tools_report_a_broken_manifest_in_one_line(tmp_path, case):
    change, expected = BAD_MANIFESTS[case]
    data = tmp_path / "data"
    manifest = make_dataset(data, packed=[8])
    (data / MANIFEST).write_text(json.dumps(change(manifest)))
    assert_one_error_line(
        *run_cli("-m", "pipeline.validate", f"data_dir={data}"), str(data / MANIFEST), expected
    )
    if case == "no tokenizer":  # the trainer reads it first thing too
        code, lines = run_cli(*train_command(data, tmp_path / "run", "max_steps=1"))
        assert_one_error_line(code, lines, str(data / MANIFEST), expected)


def model_config(arch: str, max_seq_len: int) -> ModelConfig:
    return ModelConfig(
        arch=arch, vocab_size=VOCAB_SIZE, d_model=8, n_layers=1, n_heads=2, max_seq_len=max_seq_len
    )


def test_a_model_shorter_than_the_packed_blocks_is_found_from_the_manifest(tmp_path):
    manifest = packed_data(tmp_path, seq_len=32)
    for task in ("causal_lm", "mlm"):
        assert data_fits_model(tmp_path, manifest, task, model_config("gpt", 32)) is None
        assert data_fits_model(tmp_path, manifest, task, model_config("gpt", 16)) == (
            f"model.max_seq_len=16 is shorter than the inputs of {tmp_path}, which need 32 positions (packed "
            "blocks of seq_len 32); set model.max_seq_len=32 or more"
        )
    # Without a recorded seq_len (a dataset made by hand) the blocks themselves are measured.
    del manifest["datasets"]["packed"]["seq_len"]
    assert longest_input(tmp_path, manifest, "causal_lm").positions == 32


def test_a_model_shorter_than_the_translation_pairs_is_found(tmp_path):
    manifest = make_dataset(tmp_path, translation=[30, 30])  # sides of 1 to 8 tokens
    longest = 0
    for index, entry in enumerate(manifest["datasets"]["translation"]["splits"]["train"]["shards"]):
        shard = Shard(index, str(tmp_path / entry["path"]), entry["samples"], None)
        members = read_shard(shard, FIELDS["translation"], set(range(shard.samples))).values()
        longest = max(
            [longest] + [len(decode_array(raw)) for sample in members for raw in sample.values()]
        )
    # A side of n tokens takes n + 1 positions: </s> after a source; <s> before a target, whose own
    # </s>
    # is only predicted.
    layout = sentencepiece_specials()
    assert input_positions("translation", {"src_ids": 12, "tgt_ids": 7}, layout) == {
        "src_ids": 13,
        "tgt_ids": 8,
    }
    assert (
        data_fits_model(tmp_path, manifest, "translation", model_config("seq2seq", longest + 1))
        is None
    )
    problem = data_fits_model(tmp_path, manifest, "translation", model_config("seq2seq", longest))
    assert problem.startswith(
        f"model.max_seq_len={longest} is shorter than the inputs of {tmp_path}, which need "
        f"{longest + 1} positions (the longest "
    )
    assert problem.endswith(
        f", {longest} tokens, in the train split); set model.max_seq_len={longest + 1} or more"
    )

    # prepare's bound answers when it fits the model, without reading a shard; when it does not, the
    # pairs decide.
    manifest["config"] = {"translation": {"max_tokens": 96}}
    assert longest_input(tmp_path, manifest, "translation", bound_ok=64).positions == longest + 1
    for entry in manifest["datasets"]["translation"]["splits"]["train"]["shards"]:
        (tmp_path / entry["path"]).unlink()
    assert longest_input(tmp_path, manifest, "translation", bound_ok=97).positions == 97
    assert data_fits_model(tmp_path, manifest, "translation", model_config("seq2seq", 97)) is None


def test_a_model_shorter_than_its_data_stops_the_trainer_in_one_line(tmp_path):
    data = tmp_path / "data"
    packed_data(data, seq_len=32, sizes=(40, 40))
    code, lines = run_cli(
        *train_command(data, tmp_path / "run", "model.max_seq_len=16", "max_steps=1")
    )
    assert_one_error_line(code, lines, "model.max_seq_len=16", "set model.max_seq_len=32")
    # found before the engine
    assert not any("DeepSpeed" in line or "ZeRO" in line for line in lines)
    # the run directory it made for the run is not left behind
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "split, change, expected",
    [
        (
            "train",
            lambda shards: shards.append(dict(shards[1])),
            "packed/train/0000-0001.tar: listed 2 times",
        ),
        (
            "valid",
            lambda shards: shards[0].update(samples=-3),
            "packed/valid/0000-0000.tar: samples -3",
        ),
    ],
    ids=["train shard listed twice", "valid shard of -3 samples"],
)
def test_a_manifest_repeating_a_shard_or_counting_below_one_stops_the_trainer_in_one_line(
    tmp_path, split, change, expected
):
    """Not read twice, not dropped, and not evaluation quietly left out: the run stops before it starts."""
    data = tmp_path / "data"
    manifest = packed_data(data, seq_len=32)
    manifest["datasets"]["packed"]["splits"]["valid"] = make_dataset(
        data, packed=[40], seq_len=32, split="valid", seed=1
    )["datasets"]["packed"]["splits"]["valid"]
    change(manifest["datasets"]["packed"]["splits"][split]["shards"])
    save_manifest(data, manifest)
    code, lines = run_cli(
        *train_command(data, tmp_path / "run", "model.max_seq_len=32", "max_steps=1")
    )
    assert_one_error_line(code, lines, f"{data / MANIFEST}: {expected}")
    assert not (tmp_path / "run").exists()  # nothing written, not even an empty run directory


def test_an_unwritable_run_dir_is_named(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert check_writable_dir(tmp_path / "new" / "run", "run_dir") == tmp_path / "new" / "run"
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())
    with pytest.raises(UserError, match=f"^run_dir={afile}: {afile} is a file, not a directory"):
        check_writable_dir(afile, "run_dir")
    with pytest.raises(
        UserError, match=f"^run_dir={afile / 'run'}: {afile} is a file, not a directory"
    ):
        check_writable_dir(afile / "run", "run_dir")
    if os.geteuid() != 0:  # root writes through permission bits
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o555)
        with pytest.raises(
            UserError,
            match=f"^run_dir={readonly / 'run'}: cannot create files in {readonly}: "
            "Permission denied",
        ):
            check_writable_dir(readonly / "run", "run_dir")


def test_an_unwritable_run_dir_stops_the_trainer_in_one_line(tmp_path):
    data = tmp_path / "data"
    packed_data(data, seq_len=32)
    afile = tmp_path / "afile"
    afile.write_text("")
    code, lines = run_cli(
        *train_command(data, afile / "run", "model.max_seq_len=32", "max_steps=1")
    )
    assert_one_error_line(code, lines, "run_dir", f"{afile} is a file, not a directory")


def test_a_taken_master_port_stops_the_trainer_in_one_line(tmp_path):
    data = tmp_path / "data"
    packed_data(data, seq_len=32)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert port_in_use(port)
        env = {
            **ENV,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }
        code, lines = run_cli(
            *train_command(data, tmp_path / "run", "model.max_seq_len=32", "max_steps=1"), env=env
        )
    assert_one_error_line(code, lines, f"MASTER_PORT={port}", "already in use")
    assert not port_in_use(port)


# ----------------------------------------------------------------------------- uneven shards,
# several processes

# 117 samples: not a multiple of 2 ranks x micro batch 4, nor of the workers
UNEVEN = [1, 40, 7, 23, 3, 31, 12]


@LINUX
def test_two_ranks_with_workers_stay_in_step_over_uneven_shards_for_three_epochs(tmp_path):
    from uneven_worker import MICRO_BATCH

    data, out, epochs = tmp_path / "data", tmp_path / "out", 3
    manifest = make_dataset(data, packed=UNEVEN)
    out.mkdir()
    launcher = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "tests" / "launch" / "uneven_worker.py"),
            str(data),
            str(out),
            str(epochs),
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ranks = []
    try:
        ranks = wait_for(
            lambda: launcher.poll() is not None or children(launcher.pid), 60, "the ranks"
        )
        # a hang fails here instead of hanging the suite
        output, _ = launcher.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        raise AssertionError("the ranks did not finish: out of step over uneven shards?") from None
    finally:
        kill_all([launcher.pid] + (ranks if isinstance(ranks, list) else []))
    assert launcher.returncode == 0, output[-4000:]

    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    total = sum(UNEVEN)
    # whole global batches of 8; the remainder waits for the next epoch
    per_rank = total // (2 * MICRO_BATCH)
    every_id = set().union(*shard_ids(manifest).values())
    orders = []
    for epoch in range(epochs):
        for report in reports:
            assert report[epoch]["epoch"] == epoch and report[epoch]["loader_epoch"] == epoch + 1
            assert len(report[epoch]["batches"]) == report[epoch]["len"] == per_rank
            # every batch met its partner
            assert report[epoch]["all_reduced_batches"] == 2 * per_rank
            assert all(len(batch) == MICRO_BATCH for batch in report[epoch]["batches"])
        seen = [i for report in reports for batch in report[epoch]["batches"] for i in batch]
        assert len(seen) == len(set(seen)) == per_rank * 2 * MICRO_BATCH  # each sample at most once
        assert set(seen) <= every_id and len(every_id - set(seen)) == total % (2 * MICRO_BATCH)
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]  # reshuffled each epoch


@pytest.mark.parametrize(
    "entry, args",
    [
        ("launch.export", ["checkpoint={missing}", "out={blocked}/model"]),
        (
            "pipeline.prepare",
            [str(ROOT / "configs" / "prepare_gettext_en_de.yaml"), "output_dir={blocked}/data"],
        ),
    ],
    ids=["export-out", "prepare-output_dir"],
)
def test_an_unwritable_output_is_one_line(tmp_path, entry, args):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    missing = tmp_path / "no-run"
    argv = [arg.format(blocked=blocked, missing=missing) for arg in args]
    run = subprocess.run(
        [sys.executable, "-m", entry, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(blocked) in errors[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr


RANK_EXIT_SCRIPT = """
import sys, threading, torch
from launch.distributed import run_rank
from common.configure import UserError, run_main
from pipeline.tokenizer import SENTENCEPIECE_FILE, sentencepiece_specials

a = torch.randn(400, 400)

def busy():  # a native thread still working when the interpreter finalizes (as gloo's can be)
    while True:
        torch.mm(a, a)

def main():
    for _ in range(2):
        threading.Thread(target=busy, daemon=True).start()
    print("finished", end="")  # unflushed: must still reach stdout
    if sys.argv[2] == "error":
        raise UserError("a named problem")
    return 0

(run_rank if sys.argv[1] == "rank" else run_main)(main)
"""


@pytest.mark.parametrize("outcome, code", [("ok", 0), ("error", 2)])
def test_a_rank_ends_without_the_teardown_abort(tmp_path, outcome, code):
    """A native thread that needs the GIL while Python finalizes is ended by pthread_exit, and
    its unwinding through C++ aborts the process: a finished run would exit -6. The plain entry
    point shows the abort; a rank's entry point (run_rank) exits with its own status."""
    script = tmp_path / "rank_exit.py"
    script.write_text(RANK_EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    plain = subprocess.run(
        [sys.executable, str(script), "plain", outcome],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == -signal.SIGABRT and "terminate called" in plain.stderr, (
        plain.returncode,
        plain.stderr[-500:],
    )
    for _ in range(3):
        rank = subprocess.run(
            [sys.executable, str(script), "rank", outcome],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rank.returncode == code, rank.stderr[-500:]
        assert rank.stdout == "finished"
        assert "terminate called" not in rank.stderr
        assert ("error: a named problem" in rank.stderr) == (outcome == "error")
