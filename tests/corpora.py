"""The tests' tiny synthetic English->German corpus, made in the test, and its prepare: the
command-line settings, a run of `pipeline.prepare`, and a Ray head for prepares to join.

    python tests/corpora.py OUT   # the tiny dataset, prepared beforehand (TINY_DATASET)
"""

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

from repo import ROOT

EN_DE = {
    "the": "die",
    "red": "rote",
    "green": "grüne",
    "small": "kleine",
    "old": "alte",
    "cat": "Katze",
    "house": "Haus",
    "file": "Datei",
    "window": "Fenster",
    "opens": "öffnet",
    "closes": "schließt",
    "sees": "sieht",
    "a": "eine",
    "door": "Tür",
    "list": "Liste",
    "new": "neue",
    "and": "und",
}
SUBJECTS = ["cat", "file", "window", "house", "list", "door"]
ADJECTIVES = ["red", "green", "small", "old", "new"]
VERBS = ["opens", "closes", "sees"]


def synthetic_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Word-for-word translatable sentences: learnable by a tiny model, varied enough for a tokenizer."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        words = [
            "the",
            rng.choice(ADJECTIVES),
            rng.choice(SUBJECTS),
            rng.choice(VERBS),
            "a",
            rng.choice(ADJECTIVES),
            rng.choice(SUBJECTS),
        ]
        if rng.random() < 0.5:
            words += ["and", "the", rng.choice(SUBJECTS)]
        english = " ".join(words) + f" {i % 97}"
        german = " ".join(EN_DE[w] for w in words) + f" {i % 97}"
        pairs.append((english, german))
    return pairs


def write_tsv(path: Path, pairs) -> Path:
    path.write_text("".join(f"{en}\t{de}\n" for en, de in pairs), encoding="utf-8")
    return path


def prepare_args(corpus: Path, out: Path, **overrides) -> list[str]:
    """Command-line overrides for a tiny prepare of a TSV corpus."""
    settings = {
        "output_dir": str(out),
        "source.format": "tsv",
        "source.paths": f"[{corpus}]",
        "seq_len": 32,
        "tokenizer.vocab_size": 400,
        "tokenizer.sample_texts": 5000,
        "shard.max_samples": 40,
        "shard.buckets": 3,
        "split.valid": 0.1,
        "split.test": 0.1,
        "progress": "false",
    }
    settings.update({k: str(v) for k, v in overrides.items()})
    return [f"{k}={v}" for k, v in settings.items()]


# Ports Ray takes by default for its own components when not told otherwise (GCS 6379, the
# dashboard 8265, the client server 10001, the dashboard agent's HTTP 52365) and its workers'
# default range: a head started on one of them refuses to start ("is trying to use a port number
# 52365 that is used by other components").
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365}) | frozenset(range(10002, 20000))


def free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, and not one of `avoid`."""
    import socket

    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in avoid:
            return port


def prepare_command(args: list[str]) -> list[str]:
    """The command line of pipeline.prepare on the gettext config with `args`."""
    return [
        sys.executable,
        "-m",
        "pipeline.prepare",
        str(ROOT / "configs/prepare_gettext_en_de.yaml"),
        *args,
    ]


def run_prepare(
    args: list[str], ray: "RayHead | None" = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """pipeline.prepare on the gettext config with `args`; with `ray`, as a driver of that running
    cluster (`ray.address`), else starting a local Ray of its own as by default."""
    joined = [f"ray.address={ray.address}"] if ray else []
    return subprocess.run(
        prepare_command([*args, *joined]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=ray.env if ray else None,
        timeout=timeout,
    )


class RayHead:
    """A one-node Ray cluster started as slurm/common.sh starts a job's head (`ray start --head
    --block`, token authentication, no dashboard), for the prepares that join it instead of
    starting a Ray of their own: ~5 s and ~4.5 CPU-s less per prepare on 2 cores (a tiny
    prepare: 8-9 s starting Ray, 3-3.4 s joining one). A joined prepare's output is the same
    bytes (the shards never depend on scheduling); Ray's own start and stop stay with the tests
    that check them (the tiny dataset, the interruption and lock tests)."""

    def __init__(self, num_cpus: int, cwd: Path | None = None):
        """`cwd`: the workers' working directory, against which a config's relative paths resolve."""
        import secrets

        port = free_port(avoid=RAY_DEFAULT_PORTS)
        self.address = f"127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--block",
                "--disable-usage-stats",
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--include-dashboard=false",
                f"--num-cpus={num_cpus}",
            ],
            env=self.env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        seen = []
        for line in self.process.stdout:  # "Ray runtime started." once the head takes drivers
            seen.append(line)
            if "Ray runtime started" in line:
                break
        else:
            raise RuntimeError("ray start --head ended before it started:\n" + "".join(seen[-30:]))
        # never block its writes
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def stop(self) -> None:
        """SIGTERM to `ray start --block`, which stops what it started; whatever outlives it
        (workers the raylet started) is reaped as pipeline.prepare reaps a local Ray's, so no
        process of this cluster outlives the tests."""
        import psutil

        from pipeline.prepare.ray_runner import reap

        try:
            spawned = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            spawned = []
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        reap(spawned)


def write_tiny_corpus(directory: Path) -> Path:
    """600 synthetic pairs with some exact duplicates mixed in."""
    pairs = synthetic_pairs(600)
    pairs += pairs[:30]
    return write_tsv(directory / "pairs.tsv", pairs)


def prepare_tiny_dataset(corpus: Path, out: Path) -> Path:
    run = run_prepare(prepare_args(corpus, out, **{"ray.num_workers": 2}))
    assert run.returncode == 0, run.stderr[-3000:]
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        print(prepare_tiny_dataset(write_tiny_corpus(Path(scratch)), Path(sys.argv[1]).resolve()))
