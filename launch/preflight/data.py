"""The dataset checked against the run before it starts: its manifest, tokenizer, splits, shards and
mixture, or the dataset a prepare stage will make."""

from __future__ import annotations

import math
from pathlib import Path

from common.configure import UserError
from common.hashing import file_sha256
from launch.config import TrainConfig
from launch.preflight.report import SHOWN_SHARDS, DataInfo, PlannedData, Report
from launch.resolve import DatasetHandle
from launch.tasks import Task
from pipeline import remote
from pipeline.format import ManifestError, shard_entries
from pipeline.load.mixture import DEFAULT_SOURCE


def check_data(
    cfg: TrainConfig, task: Task | None, handle: DatasetHandle | None, report: Report
) -> DataInfo | None:
    """Of the dataset as resolved (None: its manifest could not be read, a problem already), the
    tokenizer it names and every shard of the splits training reads (of a URL, the tokenizer,
    fetched; its shards are checked when they are fetched)."""
    if handle is None:
        return None
    url = remote.is_url(cfg.data.data_dir)
    data_dir = cfg.data.data_dir if url else Path(cfg.data.data_dir)
    fetch, manifest = handle.fetch, handle.manifest
    info = DataInfo(
        vocab_size=handle.vocab_size,
        tokenizer_sha256=handle.tokenizer_sha256,
        specials=handle.specials,
        target=handle.target,
    )
    name = handle.tokenizer_files[0]
    tokenizer_file = remote.join(data_dir, name)
    tokenizer_state = "missing"
    if url:
        try:
            remote.local_file(tokenizer_file, fetch, sha256=info.tokenizer_sha256)
            tokenizer_state = "fetched, sha256 matches the manifest"
        except UserError as err:
            report.problem(
                "data.data_dir",
                f"{err} (the manifest's tokenizer, which training copies into run_dir)",
            )
    elif not Path(tokenizer_file).is_file():
        report.problem(
            "data.data_dir",
            f"{tokenizer_file}: missing (the manifest's tokenizer, which training copies "
            "into run_dir)",
        )
    elif (actual := file_sha256(tokenizer_file)) != info.tokenizer_sha256:
        tokenizer_state = "sha256 differs from the manifest's"
        report.problem(
            "data.data_dir",
            f"{tokenizer_file}: sha256 {actual[:12]}... differs from the manifest's "
            f"{str(info.tokenizer_sha256)[:12]}...: not the tokenizer the shards were made with",
        )
    else:
        tokenizer_state = "sha256 matches the manifest"
    report.facts["dataset"] = (
        f"{data_dir}: manifest readable; {name} {tokenizer_state}, vocabulary {info.vocab_size}"
        + (
            f"; targets: {info.target.files[0]}, vocabulary {info.target.vocab_size}"
            if info.target is not None
            else ""
        )
    )
    if task is None:
        return info

    checked = []
    for split in ("train", "valid"):
        try:
            entries = shard_entries(manifest, task.name, split)
        except UserError as err:
            # Without a train split nothing runs; without a valid one the trainer only skips
            # evaluation; a damaged shard list (a repeat, a count below one) stops it in either.
            if split == "train" or isinstance(err, ManifestError):
                report.problem("data.data_dir", f"{data_dir}: {err}")
            else:
                report.warn("data.data_dir", f"{data_dir}: {err}")
            continue
        info.samples[split] = sum(int(entry["samples"]) for entry in entries)
        info.tokens[split] = sum(int(entry.get("tokens", 0)) for entry in entries)
        if split == "train" and cfg.data.mixture:
            check_mixture(cfg, task, entries, report)
        if url:
            checked.append(f"{split} {len(entries)} shards listed (remote: checked when fetched)")
            continue
        checked.append(
            f"{split} "
            f"{len(entries) - _check_shards(data_dir, task.dataset, split, entries, report)}"
            f"/{len(entries)} shards"
        )
    report.facts["shards"] = (
        f"{task.dataset}: {', '.join(checked) or 'none'} present with the manifest's sizes"
    )

    dataset = manifest.get("datasets", {}).get(task.dataset, {})
    if task.dataset == "packed" and "seq_len" in dataset:
        info.block_length = int(dataset["seq_len"])
    elif task.dataset == "translation" and "max_tokens" in (
        manifest.get("config", {}).get("translation") or {}
    ):
        # The longest pair side plus one special token: the source's </s>, the decoder input's <s>.
        info.block_length = int(manifest["config"]["translation"]["max_tokens"]) + 1
    return info


def planned_data(
    cfg: TrainConfig, task: Task | None, planned: PlannedData, report: Report
) -> DataInfo:
    """What the run will read from a dataset not made yet: its vocabulary, and its inputs'
    lengths against `model.max_seq_len` (packed blocks exactly; translation pairs by their bound,
    which only a warning can hold against the model, since the pairs themselves may be shorter)."""
    report.facts["dataset"] = (
        f"{cfg.data.data_dir}: not there yet; {planned.source} will make it: vocabulary "
        f"{planned.vocab_size}, blocks of {planned.seq_len}, pairs of at most {planned.max_tokens} "
        "tokens a side (sample counts unknown until then)"
    )
    info = DataInfo(vocab_size=planned.vocab_size)
    if task is None:
        return info
    if task.name not in planned.tasks:
        report.problem(
            "data.data_dir",
            f"{planned.source} makes no {task.name} data (its tasks: {', '.join(planned.tasks)})",
        )
    if task.dataset == "packed":
        info.block_length = planned.seq_len
        if planned.seq_len > cfg.model.max_seq_len:
            report.problem(
                "model.max_seq_len",
                f"model.max_seq_len={cfg.model.max_seq_len} is shorter than the packed "
                f"blocks of seq_len {planned.seq_len} that {planned.source} will make; set "
                f"model.max_seq_len={planned.seq_len} or more",
            )
    else:
        # a side plus </s> (source) or <s> (decoder input)
        info.block_length = planned.max_tokens + 1
        if info.block_length > cfg.model.max_seq_len:
            report.warn(
                "model.max_seq_len",
                f"model.max_seq_len={cfg.model.max_seq_len} is shorter than the bound "
                f"of the pairs {planned.source} will make ({planned.max_tokens} tokens a "
                "side, + 1): the training run checks the pairs themselves",
            )
    return info


def check_mixture(cfg: TrainConfig, task: Task, entries: list[dict], report: Report) -> None:
    """`data.mixture`'s sources against the train split's, as the loader checks them
    (`pipeline.load.loader`)."""
    samples: dict[str, int] = {}
    for entry in entries:
        name = str(entry.get("source", DEFAULT_SOURCE))
        samples[name] = samples.get(name, 0) + int(entry["samples"])
    for name, weight in cfg.data.mixture.items():
        if name not in samples:
            report.problem(
                "data.mixture",
                f"{cfg.data.data_dir} {task.name}/train has no source {name!r}; its sources: "
                f"{', '.join(sorted(samples))}",
            )
        elif not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            report.problem(
                f"data.mixture.{name}", f"a weight must be a positive number, got {weight!r}"
            )


def _check_shards(
    data_dir: Path, dataset: str, split: str, entries: list[dict], report: Report
) -> int:
    """Report the split's missing shards and those whose size is not the
    manifest's; how many are bad.
    Sizes only: hashing every shard is `pipeline.validate`'s job, not a seconds-long check's."""
    missing, resized = [], []
    for entry in entries:
        path = data_dir / entry["path"]
        if not path.is_file():
            missing.append(entry["path"])
        elif entry.get("bytes") is not None and path.stat().st_size != int(entry["bytes"]):
            resized.append(f"{entry['path']} ({path.stat().st_size} bytes, not {entry['bytes']})")
    for what, names in (("missing", missing), ("of another size than the manifest's", resized)):
        if names:
            shown = ", ".join(names[:SHOWN_SHARDS]) + (", ..." if len(names) > SHOWN_SHARDS else "")
            report.problem(
                "data.data_dir",
                f"{dataset}/{split}: {len(names)} of {len(entries)} shards {what}: {shown}",
            )
    return len(missing) + len(resized)
