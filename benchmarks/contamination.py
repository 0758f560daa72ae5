"""How many valid/test translation pairs have a near-copy in the training split of a prepared
dataset, read back from its shards (decoded with the dataset's own tokenizer): a pair counts
when a training pair's source or target side has the same normalized form (case, punctuation,
digits and printf/brace format specifiers folded: `curate.decontaminate.normalized`).

    python benchmarks/contamination.py DATASET [DATASET ...]

Prints one row per dataset: valid and test pairs, and how many of each have such a copy. Run on
the main job's dataset prepared without and with `decontamination.enabled=true`.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.format import dataset_tokenizer, has_target_tokenizer, read_manifest  # noqa: E402
from pipeline.prepare.curate.decontaminate import normalized  # noqa: E402


def pairs(data_dir: Path, manifest: dict, split: str) -> list[tuple[str, str]]:
    """The split's (source, target) pairs as text, decoded with the dataset's tokenizers."""
    source_side = dataset_tokenizer(data_dir, manifest)
    target_side = (
        dataset_tokenizer(data_dir, manifest, side="target")
        if has_target_tokenizer(manifest)
        else source_side
    )
    out = []
    for shard in manifest["datasets"]["translation"]["splits"][split]["shards"]:
        with tarfile.open(data_dir / shard["path"]) as tar:
            members: dict[str, dict[str, np.ndarray]] = {}
            for member in tar.getmembers():
                key, _, field = member.name.partition(".")
                data = tar.extractfile(member).read()
                members.setdefault(key, {})[field] = np.load(io.BytesIO(data))
        for key in sorted(members):
            sample = members[key]
            out.append(
                (
                    source_side.decode(sample["src_ids.npy"].tolist()),
                    target_side.decode(sample["tgt_ids.npy"].tolist()),
                )
            )
    return out


def contaminated(data_dir: Path) -> dict:
    manifest = read_manifest(data_dir)
    train = pairs(data_dir, manifest, "train")
    forms = {normalized(side) for pair in train for side in pair} - {""}
    row = {"train": len(train)}
    for split in ("valid", "test"):
        held_out = pairs(data_dir, manifest, split)
        row[split] = len(held_out)
        row[f"{split}_with_copy"] = sum(
            any(normalized(side) in forms for side in pair) for pair in held_out
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("datasets", nargs="+", type=Path)
    args = parser.parse_args()
    print(f"{'dataset':<40}{'train':>9}{'valid':>9}{'w/ copy':>9}{'test':>9}{'w/ copy':>9}")
    for data_dir in args.datasets:
        row = contaminated(data_dir)
        print(
            f"{str(data_dir):<40}{row['train']:>9,}{row['valid']:>9,}{row['valid_with_copy']:>9,}"
            f"{row['test']:>9,}{row['test_with_copy']:>9,}"
        )


if __name__ == "__main__":
    main()
