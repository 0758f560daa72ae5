"""What the curation stages are worth to a model: GPT pretrained on a noisy corpus with and
without them, at the same token budget, scored on clean held-out text; prints figures, asserts
nothing.

    python benchmarks/curation_effect.py [--steps 250] [--work DIR]

The corpus is the default one's text (the English side of the system's message catalogs, a
document per 20 consecutive messages of one catalog) with noise planted by this script: every
third document copied 1-3 times with 1% of its words replaced (near-copies at Jaccard about 0.9
over 5-word shingles), navigation boilerplate (a tenth as many documents as the clean ones, a few
variants) and documents in other languages (the catalogs' German and French sides, a quarter as
many). The catalogs whose name hashes to 0 mod 10 are held out: their documents are the clean
evaluation text, never trained on.

Both runs use one tokenizer (trained on the clean training documents) so their losses compare,
`configs/small_gpt.yaml` on 2 ranks for `--steps` steps (the same tokens seen; the curated
dataset, being smaller, is read more often), exported, and scored on every block of the held-out
text. The stages on: language identification, the Gopher quality and repetition rules (C4's and
FineWeb's line rules are for web pages: they would remove most lines of UI text, which end
without punctuation), near-duplicates, and decontamination against the held-out documents.
"""

from __future__ import annotations

import argparse
import gettext
import glob
import hashlib
import io
import json
import math
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PY = sys.executable

BOILERPLATE = [
    "Home\nAbout us\nContact\nShop\nLogin\nCart (0)\nFollow us\nPrivacy policy\nTerms of use",
    "Skip to content\nMenu\nSearch\nSign in\nRegister\nHelp\nCookie settings\nAll rights reserved",
    "Home | News | Downloads | Forum | Wiki | Contact\nCopyright 2026. All rights reserved.",
]


def catalogs(lang: str) -> dict[str, list[tuple[str, str]]]:
    out = {}
    for path in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as fh:
                catalog = gettext.GNUTranslations(fh)
        except (OSError, UnicodeDecodeError):
            continue
        pairs = [
            (" ".join(k.split()), " ".join(v.split()))
            for k, v in catalog._catalog.items()  # noqa: SLF001
            if isinstance(k, str) and isinstance(v, str) and k.strip() and v.strip()
        ]
        if pairs:
            out[Path(path).stem] = pairs
    return out


def documents(pairs: list[tuple[str, str]], side: int, size: int = 20) -> list[str]:
    return ["\n".join(p[side] for p in pairs[i : i + size]) for i in range(0, len(pairs), size)]


def held_out(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 10 == 0


def write_corpora(work: Path, seed: int = 0) -> dict:
    rng = random.Random(seed)
    german, french = catalogs("de"), catalogs("fr")
    clean, evaluation, other = [], [], []
    for name, pairs in german.items():
        (evaluation if held_out(name) else clean).extend(documents(pairs, 0))
        if not held_out(name):
            other.extend(documents(pairs, 1))
    for name, pairs in french.items():
        if not held_out(name):
            other.extend(documents(pairs, 1))
    vocab = [w for doc in clean[:500] for w in doc.split()]
    noisy = list(clean)
    for doc in clean[::3]:
        for _ in range(rng.randint(1, 3)):
            words = doc.split(" ")
            for _ in range(max(1, len(words) // 100)):
                words[rng.randrange(len(words))] = rng.choice(vocab)
            noisy.append(" ".join(words))
    # each page's boilerplate with its own page number, so exact de-duplication leaves it
    noisy += [
        f"{rng.choice(BOILERPLATE)}\nPage {rng.randint(1, 10**6)}" for _ in range(len(clean) // 10)
    ]
    noisy += rng.sample(other, min(len(other), len(clean) // 4))
    rng.shuffle(noisy)
    for name, docs in (("clean", clean), ("noisy", noisy), ("heldout", evaluation)):
        with open(work / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            for doc in docs:
                fh.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    (work / "heldout.txt").write_text(
        "".join(" ".join(doc.split()) + "\n" for doc in evaluation), encoding="utf-8"
    )
    return {"clean": len(clean), "noisy": len(noisy), "heldout": len(evaluation)}


def prepare(work: Path, name: str, source: str, *overrides: str) -> Path:
    out = work / f"data-{name}"
    cmd = [
        PY, "-m", "pipeline.prepare", str(ROOT / "configs/prepare_gettext_en_de.yaml"),
        f"output_dir={out}", "overwrite=true", "progress=false", "tasks=[causal_lm]",
        "source.format=jsonl", f"source.paths=[{work / source}]", "source.target_lang=en",
        "split.valid=0.02", "split.test=0.0", *overrides,
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return out


def train_and_export(work: Path, data: Path, name: str, steps: int) -> Path:
    run_dir, export = work / f"run-{name}", work / f"export-{name}"
    subprocess.run(
        [
            PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "launch.train", str(ROOT / "configs/small_gpt.yaml"),
            f"data.data_dir={data}", f"run_dir={run_dir}", f"max_steps={steps}",
            "deepspeed.zero_stage=1", "wandb.mode=disabled",
        ],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    subprocess.run(
        [PY, "-m", "launch.export", f"checkpoint={run_dir}", f"out={export}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return export


def blocks(data: Path) -> np.ndarray:
    manifest = json.loads((data / "manifest.json").read_text())
    out = []
    for split in manifest["datasets"]["packed"]["splits"].values():
        for shard in split["shards"]:
            with tarfile.open(data / shard["path"]) as tar:
                for member in sorted(tar.getmembers(), key=lambda m: m.name):
                    if member.name.endswith(".input_ids.npy"):
                        out.append(np.load(io.BytesIO(tar.extractfile(member).read())))
    return np.stack(out).astype(np.int64)


def loss_on(export: Path, ids: np.ndarray) -> float:
    import torch

    from launch.model_dir import load_model_dir
    from launch.tasks import TASKS

    torch.set_num_threads(2)
    model, _ = load_model_dir(export)
    task = TASKS["causal_lm"]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), 32):
            batch = torch.from_numpy(ids[start : start + 32])
            inputs = task.model_inputs(
                {"input_ids": batch, "attention_mask": torch.ones_like(batch)}
            )
            n = int(task.target_mask(inputs).sum())
            total += float(model(**inputs).loss) * n
            count += n
    return total / count


def train_tokens(data: Path) -> int:
    manifest = json.loads((data / "manifest.json").read_text())
    return manifest["datasets"]["packed"]["splits"]["train"]["tokens"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--work", type=Path, default=Path("/tmp/curation-effect"))
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    counts = write_corpora(work)
    print(f"documents: {counts}", flush=True)
    tokenizer_data = prepare(work, "clean", "clean.jsonl")
    given = f"tokenizer.path={tokenizer_data / 'tokenizer.model'}"
    raw = prepare(work, "raw", "noisy.jsonl", given)
    curated = prepare(
        work, "curated", "noisy.jsonl", given,
        "source.language.enabled=true", "source.quality.enabled=true",
        "source.quality.c4.enabled=false", "source.quality.fineweb.enabled=false",
        "near_dedup.enabled=true", "decontamination.enabled=true",
        f"decontamination.eval_files=[{{path: {work / 'heldout.txt'}}}]",
    )  # fmt: skip
    heldout = prepare(work, "heldout", "heldout.jsonl", given, "split.valid=0.0")
    ids = blocks(heldout)
    print(f"held-out text: {len(ids)} blocks of {ids.shape[1]} tokens", flush=True)
    rows = []
    for name, data in (("without the stages", raw), ("with the stages", curated)):
        export = train_and_export(work, data, name.split()[0], args.steps)
        loss = loss_on(export, ids)
        rows.append((name, train_tokens(data), loss))
        print(f"{name}: loss {loss:.4f}", flush=True)
    from bench_near_dup import cpu_name

    from pipeline.inspect import curation_table

    print()
    print(
        f"machine: {os.cpu_count()} cores, {cpu_name()}; {args.steps} steps of configs/small_gpt.yaml "
        f"on 2 ranks (the same tokens seen); {time.perf_counter() - started:.0f} s in all"
    )
    print(f"{'corpus':<22}{'train tokens':>14}{'held-out loss':>15}{'perplexity':>12}")
    for name, tokens, loss in rows:
        print(f"{name:<22}{tokens:>14,}{loss:>15.4f}{math.exp(loss):>12.1f}")
    manifest = json.loads((curated / "manifest.json").read_text())
    print("\nwhat the stages dropped:")
    for line in curation_table(manifest):
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
