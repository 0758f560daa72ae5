"""The web example's chain composes as the README and docs/slurm.md write it.

A scaled-down corpus in the layout `configs/prepare_web_example.yaml` reads is prepared with that
config and the documented prepare command's overrides (only the Ray workers are set to this
machine's; the corpus holds documents over the tokenizer's sentence limit and pairs longer than
the translation model's positions). Then every documented command of the example that checks or
submits a run is checked on it as it would run: the `launch.main ... --dry-run` line itself, and
for each `sbatch` line the preflight its batch script runs (`slurm/common.sh`: the config and
overrides, at the world size of `--nodes` x `--gpus-per-node`). Paths under `/scratch/$USER` become
the test's; an export directory that the chain writes later is checked as the training config
whose run it exports, as the dry run checks a warm start before its export exists.
"""

import json
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.configure import run_main

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs" / "slurm.md")
SCRATCH = "/scratch/$USER"

pytestmark = pytest.mark.slow


def documented_commands(path: Path) -> list[str]:
    """The web example's shell commands in `path`'s fenced blocks, continuation lines joined."""
    commands, fenced, current = [], False, ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced or line.lstrip().startswith("#"):
            continue
        current += line.rstrip().removesuffix("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if "data/web" in current or f"{SCRATCH}/exports/" in current:
                commands.append(current.strip())
            current = ""
    return commands


def write_corpus(root: Path, seed: int = 0) -> None:
    """`data/web/docs/*.jsonl.zst` and `data/web/pairs/*.tsv` under `root`: about 2.3 M tokens of
    documents (numbers tokenize a digit a piece), some over 10,000 characters, and pairs of
    which a few have more tokens a side than translation_gpu.yaml's positions hold."""
    import zstandard

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghiklmnoprstuvwz") for _ in range(6)) for _ in range(300)]

    def text(n_words: int) -> str:
        return " ".join(
            rng.choice(words) if rng.random() < 0.4 else str(rng.randrange(10**7))
            for _ in range(n_words)
        )

    docs = [text(rng.randint(150, 350)) for _ in range(1700)] + [text(2000) for _ in range(20)]
    lines = [
        json.dumps({"text": doc, "url": f"https://example.org/{i}"}) for i, doc in enumerate(docs)
    ]
    (root / "data/web/docs").mkdir(parents=True)
    (root / "data/web/pairs").mkdir(parents=True)
    (root / "data/web/docs/part-0.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("\n".join(lines).encode())
    )
    pairs = [(text(rng.randint(3, 12)), text(rng.randint(3, 12))) for _ in range(3000)]
    pairs += [(text(40), text(40)) for _ in range(30)]  # ~170 tokens a side
    (root / "data/web/pairs/en-de.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in pairs))


def words_of(command: str, scratch: Path, exports: dict[str, str]) -> list[str]:
    """The command's words with the test's paths for /scratch/$USER, and each export directory
    replaced by the config of the run it exports."""
    for directory, config in exports.items():
        command = command.replace(directory, config)
    return shlex.split(command.replace(SCRATCH, str(scratch)))


def sbatch_parts(words: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """(sbatch's --flags, the batch script, the script's arguments)."""
    script = next(i for i, word in enumerate(words) if word.endswith(".sbatch"))
    flags = dict(word[2:].split("=", 1) for word in words[1:script] if word.startswith("--"))
    return flags, words[script], words[script + 1 :]


def test_the_documented_web_example_chain_composes(tmp_path, monkeypatch, capsys):
    from launch.main.job import main as main_job
    from launch.preflight.checks import main as preflight

    commands = [command for path in DOCS for command in documented_commands(path)]
    sbatch = [command for command in commands if command.startswith("sbatch ")]
    prepares = [c for c in sbatch if "slurm/prepare.sbatch" in c]
    trainings = [c for c in sbatch if "slurm/prepare.sbatch" not in c]
    dry_runs = [c for c in commands if "--dry-run" in c]
    exported = [c for c in commands if "-m launch.export" in c]
    assert prepares and len(trainings) >= 4 and dry_runs and exported, commands

    # Prepare, once: the README and slurm.md give the same command.
    scratch = tmp_path / "scratch"
    write_corpus(tmp_path)
    assert len(set(prepares)) == 1, prepares
    _, script, args = sbatch_parts(words_of(prepares[0], scratch, {}))
    assert args[0] == "configs/prepare_web_example.yaml"
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.prepare", str(ROOT / args[0]), *args[1:]]
        + ["ray.num_workers=2", "progress=true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = scratch / "data" / "web"
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["datasets"]["packed"]["seq_len"] == 1024
    assert manifest["datasets"]["packed"]["splits"]["train"]["samples"] >= 2048
    assert manifest["tokenizer"]["sample"]["pieces_of_long_texts"] > 0

    # Each export directory stands for the training config whose run it exports.
    runs = {}
    for command in trainings:
        _, _, args = sbatch_parts(words_of(command, scratch, {}))
        run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run_dir="))
        runs[run_dir] = args[0]
    exports = {}
    for command in exported:
        settings = dict(w.split("=", 1) for w in words_of(command, scratch, {}) if "=" in w)
        exports[settings["out"].replace(str(scratch), SCRATCH)] = runs[settings["checkpoint"]]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("WANDB_MODE", "disabled")

    for command in dict.fromkeys(dry_runs):  # each once
        words = words_of(command, scratch, exports)
        module = words[words.index("-m") + 1]
        assert module == "launch.main", command
        with pytest.raises(SystemExit) as ended:
            run_main(lambda: main_job(words[words.index("-m") + 2 :]))
        said = capsys.readouterr()
        assert ended.value.code in (0, None), said.out[-4000:] + said.err[-2000:]
        assert "verdict: ready: every stage resolves, every warm start fits" in said.out
        assert not re.search(r"^\s+model\.max_seq_len: ", said.out, re.MULTILINE), said.out

    for command in dict.fromkeys(trainings):
        flags, script, args = sbatch_parts(words_of(command, scratch, exports))
        per_node = int(flags["gpus-per-node"])
        world = int(flags["nodes"]) * per_node
        argv = ["--world-size", str(world), "--ranks-per-node", str(per_node), *args]
        with pytest.raises(SystemExit) as ended:
            run_main(lambda: preflight(argv))
        said = capsys.readouterr()
        assert ended.value.code in (0, None), f"{command}\n{said.out[-4000:]}{said.err[-2000:]}"
        assert "verdict: ready" in said.out, said.out[-4000:]
        assert not re.search(r"^\s+model\.max_seq_len: ", said.out, re.MULTILINE), said.out
