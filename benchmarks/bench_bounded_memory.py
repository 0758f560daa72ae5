"""A corpus larger than the cluster's memory, prepared with every curation stage.

The "cluster" is this machine's processes in a memory cgroup made here (version 1 or 2, root
needed): the prepare command, its Ray head and its workers all run inside it, under a limit
smaller than the corpus. The kernel kills a process of the group that goes over the limit, so a
run that completes held the whole job under it. Prints the corpus size, the limit, the group's
peak use and the times the limit was hit (the kernel reclaiming page cache, not a kill), the
prepare's own estimate and measured peaks per worker, and the manifest's counts.

    python benchmarks/bench_bounded_memory.py --gb 1.5 --limit-mb 1400 --work /tmp/bm

The corpus and config are bench_curation's (`--work` may hold its corpus.jsonl already).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_curation import CONFIG, MB, write_corpus  # noqa: E402
from bench_near_dup import cpu_name  # noqa: E402


def make_group(limit: int) -> tuple[Path, str]:
    """A new memory cgroup with `limit` bytes: (its folder, version)."""
    name = f"bounded-prepare-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").is_file():
        group = v2 / name
        group.mkdir()
        (group / "memory.max").write_text(str(limit))
        (group / "memory.swap.max").write_text("0")
        return group, "2"
    group = Path("/sys/fs/cgroup/memory") / name
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    swap = group / "memory.memsw.limit_in_bytes"
    if swap.exists():
        swap.write_text(str(limit))
    return group, "1"


def group_facts(group: Path, version: str) -> dict:
    if version == "2":
        events = dict(
            line.split() for line in (group / "memory.events").read_text().splitlines() if line
        )
        peak = group / "memory.peak"
        return {
            "peak_mb": int(peak.read_text()) / MB if peak.exists() else None,
            "limit_hits": int(events.get("max", 0)),
            "oom_kills": int(events.get("oom_kill", 0)),
        }
    oom = dict(
        line.split() for line in (group / "memory.oom_control").read_text().splitlines() if line
    )
    return {
        "peak_mb": int((group / "memory.max_usage_in_bytes").read_text()) / MB,
        "limit_hits": int((group / "memory.failcnt").read_text()),
        "oom_kills": int(oom.get("oom_kill", 0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.5, help="corpus size (made if absent)")
    parser.add_argument("--limit-mb", type=int, default=1400, help="the cgroup's memory limit")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="prepare's key=value overrides")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    if not corpus.exists():
        started = time.perf_counter()
        made = write_corpus(corpus, args.gb)
        print(f"corpus: {json.dumps(made)} in {time.perf_counter() - started:.0f} s", flush=True)
    size = corpus.stat().st_size
    limit = args.limit_mb * MB
    config = work / "prepare.yaml"
    config.write_text(CONFIG.format(corpus=corpus, eval=work / "eval.txt"))
    out = work / "bounded"
    group, version = make_group(limit)
    procs = group / "cgroup.procs"
    try:
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.prepare",
                str(config),
                f"output_dir={out}",
                "overwrite=true",
                f"ray.num_workers={args.workers}",
                *args.overrides,
            ],
            cwd=Path(__file__).resolve().parent.parent,
            # the child joins the group before it runs: Ray's processes are its children
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
        facts = group_facts(group, version)
    finally:
        for _ in range(300):  # Ray's last processes leave the group as they exit
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)
        else:
            print(f"warning: {group} still has processes: remove it with rmdir when they end")
    said = [
        line
        for line in done.stderr.splitlines()
        if "each Ray worker needs" in line or "peak memory of a Ray worker" in line
    ]
    print(
        f"machine: {os.cpu_count()} cores, {cpu_name()}; cgroup v{version}, {args.workers} workers"
    )
    print(
        f"corpus {size / MB:,.0f} MiB; limit {args.limit_mb:,} MiB (the whole job: driver, Ray); "
        f"corpus larger than the limit: {size > limit}"
    )
    print(f"prepare exit status {done.returncode}, {wall:,.0f} s")
    print(
        f"group peak {facts['peak_mb']:,.0f} MiB (page cache included, reclaimed at the limit); "
        f"allocations refused at the limit {facts['limit_hits']:,}; processes killed for memory: "
        f"{facts['oom_kills']}"
    )
    for line in said:
        print(line)
    if done.returncode != 0:
        print(done.stderr[-3000:])
        sys.exit(1)
    manifest = json.loads((out / "manifest.json").read_text())
    train = manifest["datasets"]["packed"]["splits"]["train"]
    print(f"train tokens {train['tokens']:,}, shards {len(train['shards'])}")


if __name__ == "__main__":
    main()
