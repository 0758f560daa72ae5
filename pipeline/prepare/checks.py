"""The checks a prepare makes before it takes its output's lock or reads a byte of the input:
the config, the scratch space the scan's bucket files need, the memory a Ray worker needs, the
given tokenizers against what the tasks need, and the run's own inputs (which its output must not
hold). Each refusal is one line (`UserError`).
"""

from __future__ import annotations

from pathlib import Path

from common.configure import UserError
from common.storage import byte_size
from pipeline import remote
from pipeline.format import TASKS, shard_sets
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate import minhash
from pipeline.prepare.curate.documents import check_curation
from pipeline.prepare.memory import BASE_MB, BYTES_PER_WORD, MB, available_bytes
from pipeline.prepare.readers import is_parallel
from pipeline.prepare.sources import check_sources, decompressed_size, source_list, source_where
from pipeline.tokenizer import Tokenizer, load_tokenizer
from pipeline.tokenizer_identity import difference


def check_config(cfg: PrepareConfig) -> None:
    """Refuse, in one line, a config that cannot make a dataset: unknown tasks, unusable sources
    or curation, a translation without a parallel source, a bad seq_len, split or shard size."""
    unknown = [k for k in cfg.tasks if k not in TASKS]
    if unknown or not cfg.tasks:
        raise UserError(f"tasks: {unknown or cfg.tasks} not valid; choose from {', '.join(TASKS)}")
    check_sources(cfg)
    sources = source_list(cfg)
    check_curation(cfg, sources, [source_where(cfg, i) for i in range(len(sources))])
    if "translation" in cfg.tasks and not any(is_parallel(source) for source in source_list(cfg)):
        formats = ", ".join(source.format for source in source_list(cfg))
        raise UserError(
            "tasks: translation needs a parallel source (tsv, gettext, or jsonl/parquet with "
            f"target_field), not {formats}"
        )
    if cfg.seq_len < 2:
        raise UserError(f"seq_len: must be at least 2, got {cfg.seq_len}")
    if not (0 <= cfg.split.valid and 0 <= cfg.split.test and cfg.split.valid + cfg.split.test < 1):
        raise UserError(
            "split.valid and split.test: fractions in [0, 1) that leave some training data"
        )
    if cfg.shard.buckets < 1 or cfg.shard.max_samples < 1:
        raise UserError("shard.buckets and shard.max_samples: must be at least 1")


def scratch_need(cfg: PrepareConfig, files: list[list[str]], texts: float = 0.0) -> tuple[int, str]:
    """About how many bytes the scan's bucket files (`OUTPUT_DIR.partial/_work`) take at their
    largest, and how that was counted: each text once per family of buckets it goes to (the
    monolingual texts, and `source TAB target` for translation), at most the input's
    decompressed size each (the scan drops markup and keys, never adds). The shards come on
    top, once the scan is done, while the buckets are still there."""
    need, text, twice = 0, 0, False
    for source, paths in zip(source_list(cfg), files):
        size = sum(decompressed_size(path) for path in paths)
        copies = int("packed" in shard_sets(cfg.tasks)) + int(
            "translation" in cfg.tasks and is_parallel(source)
        )
        text += size
        need += copies * size
        twice = twice or copies == 2
    why = f"{byte_size(text)} of decompressed input" + (
        ", pairs twice: as texts and as pairs" if twice else ""
    )
    near = cfg.near_dedup
    if near.enabled and "packed" in shard_sets(cfg.tasks):
        # each signed text's band records (16 bytes a band) and sketch: 4 bytes a shingle (about a
        # word of BYTES_PER_WORD bytes), at most minhash.SKETCH, + 16 of id and end
        sketch = min(text / BYTES_PER_WORD * 4, texts * minhash.SKETCH * 4) + texts * 16
        signed = int(texts * near.bands * 16 + sketch)
        need += signed
        why += (
            f", + {byte_size(signed)} of near-duplicate band records and sketches for "
            f"~{texts:,.0f} texts"
        )
    return need, why


def check_scratch(output: Path, need: int, why: str, where: Path, free: int, log) -> None:
    """Say how much scratch space the scan needs, and stop in one line when there is less."""
    log(
        f"prepare: {output}.partial-*/_work needs about {byte_size(need)} ({why}); "
        f"{byte_size(free)} free on {where}"
    )
    if need > free:
        raise UserError(
            f"{output}.partial-*/_work needs about {byte_size(need)} ({why}), but {where} has "
            f"{byte_size(free)} free; free some space or choose an output_dir on a larger file "
            "system"
        )


def check_memory(cfg: PrepareConfig, estimate, log) -> int:
    """Say how much memory a Ray worker will need at its peak (`pipeline.prepare.memory`), and
    stop in one line when a local Ray's workers would not have it; returns the estimate."""
    need = (
        f"each Ray worker needs about {byte_size(estimate.peak_bytes)} at its peak ({estimate.why})"
    )
    if cfg.ray.address:
        log(f"prepare: {need}; not checked here: the workers run on the nodes of {cfg.ray.address}")
        return estimate.peak_bytes
    available = available_bytes()
    # the driver and Ray's own processes first; the workers share the rest
    rest = max(0, available - estimate.head_bytes)
    each = rest // cfg.ray.num_workers if cfg.ray.num_workers > 0 else rest
    head = f"{byte_size(estimate.head_bytes)} of it for the driver and Ray's own processes"
    if estimate.peak_bytes > each:
        raise UserError(
            f"{need}, but this machine has {byte_size(available)} available for "
            f"ray.num_workers={cfg.ray.num_workers} ({head}, {byte_size(each)} for each worker); "
            f"{estimate.remedy}, or lower ray.num_workers"
        )
    # between the scan and the encode the driver trains the tokenizer beside idle workers
    training = estimate.head_bytes + estimate.train_bytes + cfg.ray.num_workers * BASE_MB * MB
    if estimate.train_bytes and training > available:
        raise UserError(
            f"training the tokenizer on its sample needs about {byte_size(estimate.train_bytes)} "
            f"in the driver, beside Ray's processes and {cfg.ray.num_workers} idle workers: "
            f"{byte_size(training)} in all, but this machine has {byte_size(available)} "
            "available; lower tokenizer.sample_texts, or give tokenizer.path"
        )
    log(
        f"prepare: {need}; {byte_size(available)} available, {head}, {byte_size(each)} for each "
        f"of {cfg.ray.num_workers}"
    )
    return estimate.peak_bytes


def given_tokenizer(cfg: PrepareConfig) -> Tokenizer | None:
    """`tokenizer.path`'s tokenizer, checked against what the tasks need; None: one is trained."""
    if not cfg.tokenizer.path:
        return None
    try:
        tokenizer = load_tokenizer(cfg.tokenizer.path, cfg.tokenizer.lang_tags)
    except UserError as err:
        raise UserError(f"tokenizer.path: {err}") from None
    check_tokenizer(tokenizer, cfg, f"tokenizer.path {cfg.tokenizer.path}")
    return tokenizer


def target_tokenizer(cfg: PrepareConfig) -> Tokenizer | None:
    """`tokenizer.target_path`'s tokenizer for translation targets; None: the targets use the
    source side's. It must end a sentence (an eos) and start the decoder (a bos, or the eos)."""
    if not cfg.tokenizer.target_path:
        return None
    if not cfg.tokenizer.path:
        raise UserError(
            "tokenizer.target_path: a target tokenizer of its own needs the source side's given "
            "too (tokenizer.path)"
        )
    if "translation" not in cfg.tasks:
        raise UserError(
            "tokenizer.target_path: only translation has a target side; add translation to tasks "
            "or drop the key"
        )
    try:
        tokenizer = load_tokenizer(cfg.tokenizer.target_path)
    except UserError as err:
        raise UserError(f"tokenizer.target_path: {err}") from None
    if tokenizer.specials.eos is None:
        raise UserError(
            f"tokenizer.target_path {cfg.tokenizer.target_path}: translation ends each target with "
            "an eos token, and this tokenizer has none"
        )
    # The source side's tokenizer by the ids it gives (the same file, or one transformers saved
    # again): one tokenizer.
    if difference(load_tokenizer(cfg.tokenizer.path), tokenizer) is None:
        return None
    return tokenizer


def check_tokenizer(tokenizer: Tokenizer, cfg: PrepareConfig, where: str) -> None:
    """Refuse, in one line, a tokenizer that lacks a special token the tasks need."""
    specials = tokenizer.specials
    if "mlm" in cfg.tasks and specials.mask is None:
        raise UserError(
            f"tasks: mlm replaces tokens by a mask token, and {where} has none "
            "(drop mlm from tasks, or give a tokenizer with one)"
        )
    if "translation" in cfg.tasks and specials.eos is None:
        raise UserError(
            f"tasks: translation ends each sentence with an eos token, and {where} has none"
        )
    if "packed" in shard_sets(cfg.tasks) and not specials.document[1]:
        raise UserError(
            f"tasks: packed documents need a token between them, and {where} has no eos token "
            "and adds none after a text"
        )


def prepare_inputs(cfg: PrepareConfig, files: list[list[str]]) -> list[tuple[str, str]]:
    """The local files this run reads, each with the key that names it: what its output must not
    hold."""
    inputs = [
        (f"{source_where(cfg, index)}.paths", path)
        for index, paths in enumerate(files)
        for path in paths
        if not remote.is_url(path)
    ]
    for key in ("path", "target_path"):
        path = getattr(cfg.tokenizer, key)
        if path and not remote.is_url(path):
            inputs.append((f"tokenizer.{key}", path))
    return inputs
