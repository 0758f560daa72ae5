"""A dataset served over HTTP (a real http.server on 127.0.0.1, started by each test): the same
batches as from the local path, retries, skipped shards, the shared cache (atomic, LRU-capped,
one download for two processes, nothing half-written left by a killed download), O(1) resume."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from repo import ROOT

from common.configure import UserError
from launch.main.plan import python_launcher
from pipeline import remote
from pipeline.load.loader import ShardLoader
from pipeline.load.plan import LoaderPlan
from pipeline.remote import FetchConfig
from tests.shardtools import make_dataset

UNEVEN = [1, 40, 7, 23, 3, 31, 12]  # 117 samples in 7 shards
HANG_S = 300  # the longest a request the server never answers is held open


class _Handler(BaseHTTPRequestHandler):
    """Serves server.root; server.fail[path] = how many more requests of it get a 500 (-1: all),
    paths in server.missing get a 404;
    paths in server.trickle are sent slowly, server.trickle_s per 256 bytes;
    with server.answer_only (a set of paths), a request for any other shard is accepted and never
    answered (until server.release is set, or HANG_S)."""

    def do_GET(self):
        server = self.server
        path = self.path.split("?", 1)[0]
        with server.lock:
            server.requests.append(path)
            failures = server.fail.get(path, 0)
            if failures > 0:
                server.fail[path] = failures - 1
            hang = (
                path.endswith(".tar")
                and server.answer_only is not None
                and path not in server.answer_only
            )
            server.hanging += hang
        if hang:
            server.release.wait(HANG_S)
            return
        if failures:
            self.send_error(500, "injected failure")
            return
        file = server.root / path.lstrip("/")
        if not file.is_file() or path in server.missing:
            self.send_error(404)
            return
        body = file.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if path in server.trickle:
                for start in range(0, len(body), 256):
                    self.wfile.write(body[start : start + 256])
                    self.wfile.flush()
                    time.sleep(server.trickle_s)
            else:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client was killed: what the test is about

    def log_message(self, *args):
        pass


@dataclass
class Served:
    local: Path  # the dataset on disk
    url: str  # the same dataset over HTTP
    server: ThreadingHTTPServer
    cache: Path

    def requests(self, relative: str) -> int:
        with self.server.lock:
            return self.server.requests.count("/" + relative)

    def shard_requests(self) -> list[str]:
        with self.server.lock:
            return [path.lstrip("/") for path in self.server.requests if path.endswith(".tar")]

    def fetch(self, **kw) -> FetchConfig:
        return FetchConfig(cache_dir=str(self.cache), backoff_s=0.01, timeout_s=10, **kw)


def serve(tmp_path: Path, **dataset) -> Served:
    """A dataset made with `dataset`'s shard sizes, served from a thread of this process."""
    local = tmp_path / "data"
    make_dataset(local, **dataset)
    return serve_directory(local, tmp_path / "cache")


def serve_directory(local: Path, cache: Path) -> Served:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.root, server.lock, server.requests = local.parent, threading.Lock(), []
    server.fail, server.missing, server.trickle, server.trickle_s = {}, set(), set(), 0.05
    server.answer_only, server.hanging, server.release = None, 0, threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return Served(local, f"http://127.0.0.1:{server.server_address[1]}/{local.name}", server, cache)


@pytest.fixture
def served(tmp_path):
    served = serve(tmp_path, packed=UNEVEN)
    try:
        yield served
    finally:
        served.server.shutdown()
        served.server.server_close()


def batches(data_dir, state=None, **kw) -> tuple[list[dict], ShardLoader]:
    loader = ShardLoader(LoaderPlan(str(data_dir), "causal_lm", "train", micro_batch_size=4, **kw))
    if state is not None:
        loader.load_state_dict(state)
    try:
        return list(loader), loader
    finally:
        loader.close()


def assert_same_batches(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def shards_read(data_dir: Path, state: dict | None = None) -> set[str]:
    """The shards (relative to the served root) that an epoch, or its rest after `state`, reads."""
    loader = ShardLoader(LoaderPlan(str(data_dir), "causal_lm", "train", micro_batch_size=4))
    if state is not None:
        loader.load_state_dict(state)
    read = set()
    for _ in loader:
        read |= {key.split("#")[0] for key in loader.sample_keys()}
    return {str(Path(path).relative_to(data_dir.parent)) for path in read}


def mid_epoch_state(data_dir, batch: int) -> dict:
    loader = ShardLoader(LoaderPlan(str(data_dir), "causal_lm", "train", micro_batch_size=4))
    stream = iter(loader)
    for _ in range(batch):
        next(stream)
    return loader.state_dict()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_url_gives_the_local_batches_also_after_a_resume(served, num_workers):
    local, _ = batches(served.local, num_workers=num_workers)
    remote_batches, loader = batches(served.url, num_workers=num_workers, fetch=served.fetch())
    assert_same_batches(remote_batches, local)
    assert loader.stats["shards_skipped"] == 0
    assert set(served.shard_requests()) == shards_read(served.local)
    # downloaded once, then read from the cache
    assert len(served.shard_requests()) == len(set(served.shard_requests()))

    state = mid_epoch_state(served.local, 15)
    resumed_local, _ = batches(served.local, state, num_workers=num_workers)
    resumed_remote, _ = batches(served.url, state, num_workers=num_workers, fetch=served.fetch())
    assert_same_batches(resumed_remote, resumed_local)
    assert resumed_local == [] or len(resumed_local) == len(local) - 15


def test_shards_are_prefetched_ahead_of_the_reader_and_no_further(served):
    order = []  # the shards in the order the epoch first reads them
    local = ShardLoader(LoaderPlan(str(served.local), "causal_lm", "train", micro_batch_size=4))
    for _ in local:
        for key in local.sample_keys():
            shard = str(Path(key.split("#")[0]).relative_to(served.local.parent))
            if shard not in order:
                order.append(shard)
    loader = ShardLoader(
        LoaderPlan(
            served.url, "causal_lm", "train", micro_batch_size=4, fetch=served.fetch(prefetch=2)
        )
    )
    stream = iter(loader)
    next(stream)
    read = {
        "data/" + key.split("#")[0].removeprefix(served.url + "/") for key in loader.sample_keys()
    }
    assert read == set(order[: len(read)])
    ahead = order[: len(read) + 2]  # the reader's shards and the two after the last of them
    deadline = time.monotonic() + 20
    while len(served.shard_requests()) < len(ahead):
        assert time.monotonic() < deadline, served.shard_requests()
        time.sleep(0.02)
    time.sleep(0.3)
    assert sorted(served.shard_requests()) == sorted(ahead)
    rest = list(stream)
    assert len(rest) == len(local) - 1


def test_a_dataset_prepared_anew_at_the_same_url_is_not_read_from_stale_cache_entries(served):
    first, _ = batches(served.url, fetch=served.fetch())
    # other tokens, the same shard names and byte sizes
    make_dataset(served.local, packed=UNEVEN, seed=1)
    local, _ = batches(served.local)
    again, _ = batches(served.url, fetch=served.fetch())
    assert_same_batches(again, local)
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))


def test_a_resume_fetches_no_shard_lying_before_the_resume_point(served):
    state = mid_epoch_state(served.local, 20)
    needed = shards_read(served.local, state)
    # the resume point lies past some shard, or the test proves nothing
    assert 0 < len(needed) < len(shards_read(served.local))

    resumed, _ = batches(served.url, state, fetch=served.fetch())
    assert (
        len(resumed)
        == len(
            list(
                ShardLoader(LoaderPlan(str(served.local), "causal_lm", "train", micro_batch_size=4))
            )
        )
        - 20
    )
    assert set(served.shard_requests()) == needed


def test_a_shard_that_fails_twice_is_retried_and_read(served, caplog):
    shard = "data/packed/train/0000-0003.tar"
    served.server.fail["/" + shard] = 2
    local, _ = batches(served.local)
    with caplog.at_level(logging.WARNING, logger="pipeline.remote"):
        remote_batches, loader = batches(served.url, fetch=served.fetch(retries=3))
    assert served.requests(shard) == 3
    retries = [r.getMessage() for r in caplog.records if r.name == "pipeline.remote"]
    assert len(retries) == 2 and all(shard in m and "500" in m for m in retries), retries
    assert "attempt 1 of 4" in retries[0] and "attempt 2 of 4" in retries[1]
    assert loader.stats["shards_skipped"] == 0
    assert_same_batches(remote_batches, local)


@pytest.mark.parametrize("num_workers, failure", [(0, "500"), (1, "500"), (0, "404")])
def test_a_shard_that_always_fails_is_skipped_like_a_corrupt_local_one(
    served, tmp_path, num_workers, failure
):
    shard = "packed/train/0000-0003.tar"
    if failure == "500":
        served.server.fail["/data/" + shard] = -1
    else:
        served.server.missing.add("/data/" + shard)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(served.local, corrupt)
    (corrupt / shard).write_bytes(b"not a tar")
    local, local_loader = batches(corrupt, num_workers=num_workers)
    remote_batches, loader = batches(
        served.url, num_workers=num_workers, fetch=served.fetch(retries=2)
    )
    assert loader.stats["shards_skipped"] == local_loader.stats["shards_skipped"] == 1
    assert loader.stats["filler_batches"] == local_loader.stats["filler_batches"] > 0
    assert loader.skipped_shards[0]["path"] == f"{served.url}/{shard}"
    reason = loader.skipped_shards[0]["reason"]
    assert "cannot fetch" in reason and (
        "500" in reason if failure == "500" else "not found" in reason
    ), reason
    assert_same_batches(remote_batches, local)
    # Three attempts by the prefetcher (the reader takes its verdict), at most three more by the
    # reader if it came first: never one attempt per batch. A missing file is not retried.
    assert (
        3 <= served.requests("data/" + shard) <= 6
        if failure == "500"
        else served.requests("data/" + shard) <= 2
    )
    assert not list(served.cache.glob("*.part"))


def _fetch_in_subprocess(url: str, fetch: FetchConfig) -> subprocess.Popen:
    code = (
        "import hashlib, sys; from pipeline import remote\n"
        f"path = remote.local_file({url!r}, remote.FetchConfig(cache_dir={fetch.cache_dir!r}, timeout_s=30))\n"
        "print(hashlib.sha256(open(path, 'rb').read()).hexdigest())"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_killed_download_leaves_no_file_under_the_final_name(served):
    shard = "data/packed/train/0000-0001.tar"  # 40 samples: some kB, a few seconds at the trickle
    served.server.trickle.add("/" + shard)
    fetch = served.fetch()
    child = _fetch_in_subprocess(f"{served.url}/packed/train/0000-0001.tar", fetch)
    try:
        deadline = time.monotonic() + 30
        while not any(path.stat().st_size > 0 for path in served.cache.glob("*.part")):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    assert not list(served.cache.glob("*.data"))
    # the dead download's, under its temporary name
    assert len(list(served.cache.glob("*.part"))) == 1

    served.server.trickle.clear()
    path = remote.local_file(f"{served.url}/packed/train/0000-0001.tar", fetch)
    assert Path(path).read_bytes() == (served.local / "packed/train/0000-0001.tar").read_bytes()
    assert not list(served.cache.glob("*.part"))  # the next fetch cleaned it up


def test_two_processes_fetching_one_shard_download_it_once(served):
    relative = "packed/train/0000-0001.tar"
    served.server.trickle.add(f"/data/{relative}")
    served.server.trickle_s = 0.005
    fetch = served.fetch()
    children = [_fetch_in_subprocess(f"{served.url}/{relative}", fetch) for _ in range(2)]
    outputs = [child.communicate(timeout=60) for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    expected = hashlib.sha256((served.local / relative).read_bytes()).hexdigest()
    assert [out.strip() for out, _ in outputs] == [expected, expected]
    assert served.requests(f"data/{relative}") == 1


def test_the_cache_keeps_under_its_cap_evicting_the_least_recently_used(tmp_path):
    served = serve(tmp_path, packed=[10, 10, 10, 10])  # shards of one size
    try:
        size = (served.local / "packed/train/0000-0000.tar").stat().st_size
        fetch = served.fetch(max_bytes=int(2.5 * size))
        url = [f"{served.url}/packed/train/0000-{part:04d}.tar" for part in range(4)]

        def cached() -> set[str]:
            entries = list(served.cache.glob("*.data"))
            assert sum(path.stat().st_size for path in entries) <= fetch.max_bytes
            return {path.name.split("-", 1)[1] for path in entries}

        remote.local_file(url[0], fetch, size=size)
        time.sleep(0.01)
        remote.local_file(url[1], fetch, size=size)
        time.sleep(0.01)
        remote.local_file(url[0], fetch, size=size)  # used again: 1 is now the least recently used
        time.sleep(0.01)
        remote.local_file(url[2], fetch, size=size)
        assert cached() == {"0000-0000_tar.data", "0000-0002_tar.data"}
        time.sleep(0.01)
        remote.local_file(url[3], fetch, size=size)
        assert cached() == {"0000-0002_tar.data", "0000-0003_tar.data"}
        assert served.requests("data/packed/train/0000-0000.tar") == 1

        # A cap below one shard: that shard alone stays, the others go.
        small = served.fetch(max_bytes=size // 2)
        remote.local_file(url[1], small, size=size)
        assert {path.name.split("-", 1)[1] for path in served.cache.glob("*.data")} == {
            "0000-0001_tar.data"
        }
    finally:
        served.server.shutdown()
        served.server.server_close()


def test_an_unreachable_or_unknown_url_is_one_line(served):
    port = served.server.server_address[1]
    with pytest.raises(
        UserError, match=r"no manifest\.json at http://127\.0\.0\.1:\d+/nowhere: not a prepared"
    ):
        ShardLoader(
            LoaderPlan(
                f"http://127.0.0.1:{port}/nowhere",
                "causal_lm",
                "train",
                micro_batch_size=4,
                fetch=served.fetch(retries=0),
            )
        )
    served.server.shutdown()
    served.server.server_close()
    with pytest.raises(UserError, match="cannot fetch the manifest") as err:
        ShardLoader(
            LoaderPlan(
                f"http://127.0.0.1:{port}/data",
                "causal_lm",
                "train",
                micro_batch_size=4,
                fetch=FetchConfig(retries=1, backoff_s=0.01),
            )
        )
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="unknown protocol 'nosuch'"):
        ShardLoader(LoaderPlan("nosuch://bucket/data", "causal_lm", "train", micro_batch_size=4))
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(UserError, match="s3fs"):
            ShardLoader(LoaderPlan("s3://bucket/data", "causal_lm", "train", micro_batch_size=4))


def test_training_from_the_url_equals_training_from_the_local_path(tiny_dataset, tmp_path):
    """launch.train end to end, one process: the same losses, step for step, and the tokenizer copied."""
    served = serve_directory(tiny_dataset, tmp_path / "cache")
    try:
        losses = []
        for name, data_dir in (("local", tiny_dataset), ("url", served.url)):
            run_dir = tmp_path / name
            command = [
                sys.executable,
                "-m",
                "launch.train",
                str(ROOT / "configs" / "tiny_gpt.yaml"),
                f"data.data_dir={data_dir}",
                f"run_dir={run_dir}",
                f"data.cache_dir={served.cache}",
                "max_steps=3",
                "model.d_model=32",
                "model.n_layers=1",
                "model.n_heads=2",
                "model.d_ff=64",
                "model.max_seq_len=64",
                "data.micro_batch_size=4",
                "data.num_workers=1",
                "eval_batches=0",
                "wandb.mode=disabled",
                "threads_per_rank=1",
                "log_every=1",
                "eval_every=0",
                "checkpoint.every_steps=0",
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
            run = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
            )
            assert run.returncode == 0, run.stderr[-4000:]
            rows = [
                json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ]
            losses.append([row["train/loss"] for row in rows if "train/loss" in row])
            assert (run_dir / "tokenizer.model").read_bytes() == (
                tiny_dataset / "tokenizer.model"
            ).read_bytes()
        assert len(losses[0]) == 3 and losses[1] == losses[0]
        assert served.shard_requests()  # the URL run read its shards over HTTP
    finally:
        served.server.shutdown()
        served.server.server_close()


def test_the_dry_run_reads_a_url_s_manifest_and_fetches_its_tokenizer(
    tmp_path, capsys, monkeypatch
):
    from dryrun import args, dry_run, make_data

    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ):
        monkeypatch.delenv(name, raising=False)
    served = serve_directory(make_data(tmp_path / "data"), tmp_path / "cache")
    try:
        code, out, problems = dry_run(
            args(served.url, tmp_path, f"data.cache_dir={served.cache}"), capsys
        )
        assert code == 0 and problems == [], out
        assert "tokenizer.model fetched, sha256 matches the manifest" in out
        (served.local / "tokenizer.model").write_bytes(b"another tokenizer")
        code, out, problems = dry_run(
            args(
                served.url,
                tmp_path,
                f"data.cache_dir={tmp_path / 'cache2'}",
                "data.fetch_backoff_s=0.01",
            ),
            capsys,
        )
        assert (
            code != 0
            and len(problems) == 1
            and "sha256" in problems[0]
            and "tokenizer.model" in problems[0]
        ), out
    finally:
        served.server.shutdown()
        served.server.server_close()


def test_evaluation_pairs_read_from_a_url_are_the_local_ones(tmp_path):
    from launch.evaluate import read_pairs

    served = serve(tmp_path, translation=[5, 9, 3])
    try:
        local = read_pairs(served.local, "train")
        pairs = read_pairs(served.url, "train", fetch=served.fetch())
        assert len(list(served.cache.glob("*.data"))) == 3
        assert len(pairs) == len(local) == 17
        assert all((a == c).all() and (b == d).all() for (a, b), (c, d) in zip(pairs, local))
    finally:
        served.server.shutdown()
        served.server.server_close()


# ----------------------------------------------------------------------------- a server that never
# answers
# Issue #28, item 3: a stop request (a signal, the STOP file) ends a job whose fetches hang, within
# seconds and as any stop does, instead of after the fetch timeouts and retries (minutes).

STOP_WITHIN_S = 10  # the step agreement, a tiny model's checkpoint, the DataLoader workers' end


def train_from(url: str, run_dir: Path, cache: Path, *overrides: str, nproc: int = 1) -> list[str]:
    """launch.train on a tiny GPT reading `url`, with the fetch timeouts and retries at their defaults."""
    from trainruns import TINY

    return [
        *python_launcher(nproc),
        "-m",
        "launch.train",
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={url}",
        f"run_dir={run_dir}",
        f"data.cache_dir={cache}",
        *TINY,
        "wandb.mode=disabled",
        "max_steps=100000",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=0",
        "data.log_sample_keys=true",
        *overrides,
    ]


def answer_the_first_shard_only(served: Served) -> None:
    """Serve the shard the trainer's stream begins with (data.seed 0); hang on every other."""
    loader = ShardLoader(LoaderPlan(str(served.local), "causal_lm", "train", micro_batch_size=1))
    next(iter(loader))
    (key,) = loader.sample_keys()
    served.server.answer_only = {
        "/" + str(Path(key.split("#")[0]).relative_to(served.local.parent))
    }


def steps_made(run_dir: Path) -> int:
    keys = run_dir / "sample_keys.rank0.jsonl"
    return len(keys.read_text().splitlines()) if keys.is_file() else 0


def wait_until_stuck(job: subprocess.Popen, served: Served, run_dir: Path) -> int:
    """Wait until a shard request hangs and training, having made a step, has made none for 3 s;
    the steps made."""
    from processes import wait_for

    wait_for(
        lambda: job.poll() is not None or (served.server.hanging and steps_made(run_dir)),
        300,
        "a shard request to hang after the first step",
    )
    last, since = -1, time.monotonic()
    while time.monotonic() - since < 3:
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before it was stopped"
        if (steps := steps_made(run_dir)) != last:
            last, since = steps, time.monotonic()
        time.sleep(0.2)
    return last


def request_stop(how: str, pid: int, run_dir: Path) -> None:
    if how == "STOP":
        (run_dir / "STOP").touch()
    else:
        os.kill(pid, getattr(signal, how))


def assert_stopped_at(run_dir: Path, stderr: str, steps: int) -> None:
    """The end of any stop: the step reached checkpointed, preempted.json, one line, no traceback."""
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": steps}
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    said = [line for line in stderr.splitlines() if line.startswith("stop requested")]
    assert said == [f"stop requested: checkpoint at step {steps} saved; exiting for a requeue"], (
        stderr[-3000:]
    )
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not (run_dir / "STOP").exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
@pytest.mark.parametrize(
    "how, workers", [("SIGTERM", 1), ("SIGUSR1", 0), ("SIGINT", 1), ("STOP", 0)]
)
def test_a_stop_request_ends_training_blocked_on_a_server_that_never_answers(
    tiny_dataset, tmp_path, how, workers
):
    """The server answers the manifest, the tokenizer and the epoch's first shard, and accepts
    every other shard request and never answers it. Once training has used up the first shard
    and waits (in a DataLoader worker, or in the rank itself without workers), a stop request
    ends the job within seconds: the step reached checkpointed, no process of the job left."""
    from processes import alive, descendants, kill_all, wait_for

    served = serve_directory(tiny_dataset, tmp_path / "cache")
    answer_the_first_shard_only(served)
    run_dir = tmp_path / "run"
    stderr = tmp_path / "stderr"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    job = subprocess.Popen(
        train_from(served.url, run_dir, served.cache, f"data.num_workers={workers}"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "w"),
    )
    processes = []
    try:
        steps = wait_until_stuck(job, served, run_dir)
        assert steps > 0
        processes = [job.pid, *descendants(job.pid)]
        assert len(processes) == 1 + workers, processes
        asked = time.monotonic()
        request_stop(how, job.pid, run_dir)
        try:
            job.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{how}: the job still runs {STOP_WITHIN_S} s after the stop request, blocked on "
                f"the server ({served.server.hanging} shard requests unanswered)"
            ) from None
        took = time.monotonic() - asked
        wait_for(
            lambda: not any(alive(pid) for pid in processes), 5, "every process of the job to end"
        )
        print(
            f"\n{how}, {workers} workers: stopped {took:.1f} s after the request, at step {steps}"
        )
        assert job.returncode == 0, stderr.read_text()[-3000:]
        assert_stopped_at(run_dir, stderr.read_text(), steps)
    finally:
        kill_all([job.pid, *processes, *descendants(job.pid)])
        served.server.release.set()
        served.server.shutdown()
        served.server.server_close()


@contextlib.contextmanager
def silent_server():
    """A TCP server on 127.0.0.1 that accepts every connection and never answers; yields its port
    and a function giving how many connections it has accepted."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    held, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], lambda: len(held)
    finally:
        done.set()
        thread.join(5)
        for connection in held:
            connection.close()
        listener.close()


def test_a_stop_request_ends_a_job_waiting_for_its_manifest(tmp_path):
    """The data server accepts the connection and never answers: the trainer waits for the
    manifest (for minutes, at the default timeout and retries). SIGTERM ends it within seconds,
    as a stop before training does: one line, nothing to checkpoint, preempted.json, exit 0."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    with silent_server() as (port, accepted):
        job = subprocess.Popen(
            train_from(f"http://127.0.0.1:{port}/data", run_dir, tmp_path / "cache"),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not accepted() and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert accepted() and job.poll() is None, job.poll()
            time.sleep(1)
            asked = time.monotonic()
            job.send_signal(signal.SIGTERM)
            try:
                _, stderr = job.communicate(timeout=STOP_WITHIN_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"the job still waits for its manifest {STOP_WITHIN_S} s after SIGTERM"
                ) from None
            print(f"\nstopped {time.monotonic() - asked:.1f} s after SIGTERM")
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    assert job.returncode == 0, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("stop requested")]
    assert said == [
        "stop requested before training began: nothing to checkpoint; exiting for a requeue"
    ], stderr
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": 0}
    assert "Traceback" not in stderr and not (run_dir / "checkpoints").exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_two_ranks_blocked_on_a_server_that_never_answers_stop_together(tiny_dataset, tmp_path):
    """Two ranks under torchrun with DataLoader workers: the STOP file, seen by a rank that has
    waited for its batch a while, ends the job within seconds. A rank that read its batches
    learns of the stop from the one that could not, in the step's first reduction, and both
    checkpoint the step they reached."""
    from processes import alive, descendants, kill_all, wait_for

    served = serve_directory(tiny_dataset, tmp_path / "cache")
    answer_the_first_shard_only(served)
    run_dir = tmp_path / "run"
    stderr = tmp_path / "stderr"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    job = subprocess.Popen(
        train_from(served.url, run_dir, served.cache, "data.num_workers=1", nproc=2),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "w"),
    )
    processes = []
    try:
        steps = wait_until_stuck(job, served, run_dir)
        assert steps > 0
        processes = [job.pid, *descendants(job.pid)]
        asked = time.monotonic()
        request_stop("STOP", job.pid, run_dir)
        try:
            job.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the ranks still run {STOP_WITHIN_S} s after the STOP file"
            ) from None
        took = time.monotonic() - asked
        wait_for(
            lambda: not any(alive(pid) for pid in processes), 5, "every process of the job to end"
        )
        print(f"\n2 ranks: stopped {took:.1f} s after the STOP file, at step {steps}")
        assert job.returncode == 0, stderr.read_text()[-3000:]
        assert_stopped_at(run_dir, stderr.read_text(), steps)
        assert steps_made(run_dir) == len(
            (run_dir / "sample_keys.rank1.jsonl").read_text().splitlines()
        )
    finally:
        kill_all([job.pid, *processes, *descendants(job.pid)])
        served.server.release.set()
        served.server.shutdown()
        served.server.server_close()
