"""The batch scripts of slurm/ submitted to a real SLURM: `slurm/local-cluster.sh start` (two
emulated nodes on this machine; `.ci/run` installs and starts it).

Every job is 2 nodes x 1 rank (world size 2) of a tiny model on CPU. The jobs run the test's
own interpreter (PYTHON=sys.executable) in this checkout (PROJECT_DIR). Without `sbatch` the
tests skip, except under CI=true, where a missing or unreachable cluster fails them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from corpora import prepare_args
from repo import ROOT
from trainruns import TINY, metrics, wandb_records

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LOCAL_CONF = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/slurm-local")) / "etc" / "slurm.conf"
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
IN_CI = os.environ.get("CI", "").lower() == "true"


def slurm_env() -> dict:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PROJECT_DIR": str(ROOT),
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
    }
    if (
        "SLURM_CONF" not in env
        and not Path("/etc/slurm/slurm.conf").exists()
        and LOCAL_CONF.exists()
    ):
        env["SLURM_CONF"] = str(LOCAL_CONF)
    return env


def slurm(*command: str, timeout: float = 60) -> str:
    run = subprocess.run(command, env=slurm_env(), capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{' '.join(command)}: {run.stderr.strip()}"
    return run.stdout


if shutil.which("sbatch") is None and not IN_CI:
    pytest.skip(
        "sbatch not installed: apt-get install munge slurmctld slurmd slurm-client slurmdbd mariadb-server, "
        "then `bash slurm/local-cluster.sh start` (as root)",
        allow_module_level=True,
    )


@pytest.fixture(scope="session", autouse=True)
def cluster() -> None:
    """Checked before the session's data fixtures are built (autouse, session scope)."""
    if shutil.which("sbatch") is None:
        pytest.fail(
            "CI=true but sbatch is not installed: .ci/run installs SLURM and starts slurm/local-cluster.sh"
        )
    try:
        nodes = slurm("sinfo", "-h", "-N", "-o", "%N %t", timeout=30).splitlines()
    except (AssertionError, subprocess.TimeoutExpired) as err:
        pytest.fail(
            f"no SLURM cluster answers ({err}); start one with `bash slurm/local-cluster.sh start`"
        )
    ready = [
        line for line in nodes if line.split()[1:2] and line.split()[1] in ("idle", "mix", "alloc")
    ]
    assert len(ready) >= 2, f"the SLURM cluster needs 2 nodes up; sinfo says {nodes}"


def submit(
    script: str, log: Path, *args: str, flags: tuple[str, ...] = (), env: dict | None = None
) -> str:
    """sbatch from the project root; the flags after the script's #SBATCH lines replace them."""
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            f"--output={log}",
            *flags,
            str(ROOT / "slurm" / script),
            *args,
        ],
        cwd=ROOT,
        env={**slurm_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict:
    """`scontrol show job` as a dict (works without accounting: finished jobs stay MinJobAge)."""
    fields = {}
    for item in slurm("scontrol", "show", "job", "-o", job_id).split():
        key, _, value = item.partition("=")
        fields.setdefault(key, value)
    return fields


def wait_for(job_id: str, log: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info["JobState"] in ENDED:
            return info
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=slurm_env())
    tail = log.read_text()[-4000:] if log.exists() else "(no log)"
    pytest.fail(f"job {job_id} still {info['JobState']} after {timeout:.0f} s; log:\n{tail}")


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def sacct(job_id: str) -> str:
    """The accounting record, when the cluster keeps one (slurm/local-cluster.sh runs slurmdbd)."""
    run = subprocess.run(
        [
            "sacct",
            "-j",
            job_id,
            "--duplicates",
            "--format=JobID,JobName,NodeList,State,ExitCode,Elapsed",
        ],
        env=slurm_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return run.stdout if run.returncode == 0 else f"(sacct unavailable: {run.stderr.strip()})"


def train_args(data: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *TINY,
        *overrides,
    ]


# finetune.sbatch launches like pretrain.sbatch; here a randomly initialised Seq2Seq stands in
# for one warm-started from exported checkpoints (init.encoder, init.decoder).
SEQ2SEQ = ("task=translation", "model.arch=seq2seq")


@pytest.mark.parametrize(
    "script, task",
    [("pretrain.sbatch", ()), ("finetune.sbatch", SEQ2SEQ)],
    ids=["pretrain", "finetune"],
)
def test_training_on_two_nodes(tiny_dataset, tmp_path, script, task):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    # NCCL settings of the submitting shell reach the job (logged by the script for every rank).
    job = submit(
        script,
        log,
        *train_args(
            tiny_dataset,
            run_dir,
            *task,
            "max_steps=10",
            "log_every=2",
            "eval_every=10",
            "checkpoint.every_steps=0",
            "deepspeed.zero_stage=3",
        ),
        env={"NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"},
    )
    info = wait_for(job, log, timeout=240)
    print(f"\n{sacct(job)}")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text()[-4000:]
    assert info["JobName"] == script.split(".")[0]
    assert info["NumNodes"] == "2" and info["NodeList"] == "node[1-2]"
    text = log.read_text()
    assert "world 2" in text and "2 x 1 ranks" in text
    assert (
        "NCCL settings passed to the ranks: NCCL_DEBUG=WARN NCCL_SOCKET_IFNAME=lo TORCH_NCCL_ASYNC_ERROR_HANDLING=1"
        in text
    )
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    assert (run_dir / "checkpoints" / "step_00000010").is_dir()
    losses = {row["step"]: row["train/loss"] for row in metrics(run_dir) if "train/loss" in row}
    assert sorted(losses) == [2, 4, 6, 8, 10]
    assert all(0 < loss < 20 for loss in losses.values())
    final = json.loads((run_dir / "final.json").read_text())
    assert final["step"] == 10 and final["eval/loss"] > 0


def test_prepare_on_two_nodes_matches_one_node(tiny_corpus, tiny_dataset, tmp_path):
    """tiny_dataset is the same config prepared by one machine's local Ray."""
    out, log = tmp_path / "data", tmp_path / "prepare.log"
    job = submit(
        "prepare.sbatch",
        log,
        str(ROOT / "configs/prepare_gettext_en_de.yaml"),
        *prepare_args(tiny_corpus, out),
    )
    info = wait_for(job, log, timeout=240)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert ": 2 nodes, 2 CPUs" in text  # the head and the worker joined before prepare ran
    assert "stopping Ray" in text
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(
        p.relative_to(tiny_dataset) for p in tiny_dataset.rglob("*") if p.is_file()
    )
    assert sum(f.suffix == ".tar" for f in files) > 6
    for relative in files:
        # these name output_dir and ray.address
        if relative.name not in ("manifest.json", "config.yaml"):
            assert (out / relative).read_bytes() == (tiny_dataset / relative).read_bytes(), relative
    ours, theirs = (json.loads((d / "manifest.json").read_text()) for d in (out, tiny_dataset))
    for manifest in (ours, theirs):
        del manifest["config"], manifest["seconds"]
    assert ours == theirs


def test_warning_signal_requeues_and_resumes(tiny_dataset, tmp_path):
    """SLURM's warning signal (here sent by hand, as `--signal=B:USR1@N` would before the limit):
    checkpoint, requeue, resume from that checkpoint in the same W&B run, every step once."""
    run_dir, log = tmp_path / "run", tmp_path / "requeue.log"
    max_steps = 100  # the stop lands about step 16 (the signal is sent once 10 are logged)
    job = submit(
        "pretrain.sbatch",
        log,
        *train_args(
            tiny_dataset,
            run_dir,
            f"max_steps={max_steps}",
            "log_every=1",
            "eval_every=0",
            "checkpoint.every_steps=0",
            "wandb.mode=offline",
        ),
    )
    wait_until(
        lambda: logged_steps(run_dir) >= 10 or job_info(job)["JobState"] in ENDED,
        180,
        "training to start",
    )
    slurm("scancel", "--batch", "--signal=USR1", job)
    info = wait_for(job, log, timeout=300)
    print(f"\n{sacct(job)}")
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert info["Restarts"] == "1", text[-4000:]

    # The first run stopped mid-way with a checkpoint; the requeued run started from it.
    stops = re.findall(r"^stop requested: checkpoint at step (\d+) saved", text, flags=re.MULTILINE)
    assert len(stops) == 1, text[-4000:]
    stopped = int(stops[0])
    assert 10 <= stopped < max_steps
    assert (
        f"resumed from {run_dir / 'checkpoints' / f'step_{stopped:08d}'} at step {stopped}" in text
    )
    assert json.loads((run_dir / "final.json").read_text())["step"] == max_steps
    steps = [row["step"] for row in metrics(run_dir)]
    assert steps == list(range(1, max_steps + 1))  # no step trained twice, none skipped

    # One W&B run: both jobs wrote to the run id kept in the checkpoint, history without repeats.
    run_id = json.loads(
        (run_dir / "checkpoints" / f"step_{max_steps:08d}" / "client_state.json").read_text()
    )["wandb_run_id"]
    assert sorted(p.name.rsplit("-", 1)[1] for p in run_dir.glob("wandb/offline-run-*")) == [
        run_id,
        run_id,
    ]
    records = wandb_records(run_dir)
    assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {run_id}
    history = [
        json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "history"
        for item in r.history.item
        if (item.key or "/".join(item.nested_key)) == "_step"
    ]
    assert history == list(range(1, max_steps + 1))


def test_requeued_onto_fewer_nodes_continues_with_the_same_global_batch(tiny_dataset, tmp_path):
    """A node is lost while the job runs (drained here); the warning signal checkpoints and
    requeues the job, which then gets 1 node instead of 2: it resumes from the 2-rank
    checkpoint (converted to a universal one) with grad_accum 2, the same global batch, every
    step once."""
    run_dir, log = tmp_path / "run", tmp_path / "shrink.log"
    max_steps = 40
    job = submit(
        "pretrain.sbatch",
        log,
        *train_args(
            tiny_dataset,
            run_dir,
            f"max_steps={max_steps}",
            "log_every=1",
            "eval_every=0",
            "checkpoint.every_steps=0",
            "global_batch_size=8",
        ),
    )
    wait_until(
        lambda: logged_steps(run_dir) >= 5 or job_info(job)["JobState"] in ENDED,
        180,
        "training to start",
    )
    nodes = job_info(job)["NodeList"]
    lost = slurm("scontrol", "show", "hostnames", nodes).split()[-1]
    slurm("scontrol", "update", f"NodeName={lost}", "State=DRAIN", "Reason=pretrain-test-lost-node")
    try:
        slurm("scancel", "--batch", "--signal=USR1", job)
        wait_until(
            lambda: job_info(job)["Restarts"] == "1" and job_info(job)["JobState"] == "PENDING",
            240,
            "the requeue",
        )
        slurm("scontrol", "update", f"JobId={job}", "NumNodes=1", "NumTasks=1")  # one rank per node
        info = wait_for(job, log, timeout=600)
    finally:
        slurm("scontrol", "update", f"NodeName={lost}", "State=RESUME")
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert "(written by 2 ranks, resumed on 1)" in text, text[-4000:]
    assert "global batch 8 (4 x 2 x 1)" in text, text[-4000:]
    assert json.loads((run_dir / "final.json").read_text())["step"] == max_steps
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, max_steps + 1))


def _rank_pids(job_id: str, rank: int) -> list[int]:
    """The trainer processes of one rank of a job: the local cluster's nodes are this machine."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if (
            f"SLURM_JOB_ID={job_id}" in environ
            and f"RANK={rank}" in environ
            and "launch.train" in cmdline
        ):
            pids.append(int(proc.name))
    return pids


def test_dead_rank_fails_the_job_quickly(tiny_dataset, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "dead.log"
    job = submit(
        "pretrain.sbatch",
        log,
        *train_args(
            tiny_dataset,
            run_dir,
            "max_steps=100000",
            "log_every=1",
            "eval_every=0",
            "checkpoint.every_steps=0",
            "dist_timeout_s=600",
        ),
    )
    wait_until(
        lambda: logged_steps(run_dir) >= 3 or job_info(job)["JobState"] in ENDED,
        180,
        "training to start",
    )
    pids = _rank_pids(job, 1)
    assert pids, f"rank 1 of job {job} not found; log:\n{log.read_text()[-3000:]}"
    killed = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    info = wait_for(job, log, timeout=120)
    took = time.monotonic() - killed
    print(
        f"\njob {job} ended {info['JobState']} {took:.1f} s after rank 1 was killed (dist_timeout_s=600)\n{sacct(job)}"
    )
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0"
    assert took < 60  # torchrun sees its worker die; srun --kill-on-bad-exit ends the other node
    assert not (run_dir / "final.json").exists()
