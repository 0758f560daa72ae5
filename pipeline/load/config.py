"""Configuration schema of the loader: how the trainer streams a prepared dataset.

`LoaderConfig` is embedded by the trainer's config (`launch.config.TrainConfig.data`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


@dataclass
class LoaderConfig:
    """How the trainer streams a prepared dataset (embedded in the training config)."""

    # A dataset written by pipeline.prepare: a directory, or a URL (http(s)://, s3://, any
    # fsspec protocol whose package is installed) whose shards are fetched into `cache_dir`.
    data_dir: str = "data/gettext-en-de"
    # A URL's shards are downloaded here, whole, then read; ranks and workers of one node may
    # share it (one download per shard, none read half-written). "" =
    # ~/.cache/pretrain-pipeline/shards.
    cache_dir: str = ""
    # Size cap of cache_dir: the least recently used shards are removed to stay under it. Give
    # it room for (prefetch_shards + 2) shards per DataLoader worker at least.
    cache_max_gb: float = 50.0
    # Retries of a failed download, after waits of fetch_backoff_s, doubling each time; a shard
    # that still fails is skipped like a corrupt one (counted; fillers keep the ranks in step).
    fetch_retries: int = 3
    fetch_backoff_s: float = 1.0  # the first wait before retrying a download
    fetch_timeout_s: float = 60.0  # a connection or a read that waits longer fails (and is retried)
    # shards downloaded ahead of the reader, per DataLoader worker (0: none)
    prefetch_shards: int = 2
    micro_batch_size: int = 8  # sequences per rank per forward pass
    num_workers: int = 1  # DataLoader worker processes per rank (0: in the main process)
    seed: int = 0  # shard and sample order, and MLM masks
    mlm_probability: float = 0.15  # fraction of tokens selected for MLM prediction
    # Of the selected tokens: replaced by <mask>, by a random token, or kept (BERT's 80/10/10).
    mlm_mask_fraction: float = 0.8
    mlm_random_fraction: float = 0.1  # of the selected tokens: replaced by a random token
    # End training when fillers (batches standing in for unreadable shards or samples) exceed
    # this fraction of an epoch's batches.
    max_bad_fraction: float = 0.01
    # Append each step's sample keys ("shard.tar#member") to RUN_DIR/sample_keys.rankN.jsonl.
    log_sample_keys: bool = False
    # causal_lm / mlm: each token attends only within its own document of the packed block
    # (block-causal for GPT, block-diagonal for BERT), positions restarting at 0 at each
    # document, as if each were run alone. FlexAttention on CUDA (SDPA with a dense mask where
    # it cannot run: on the CPU, without Triton, with attention dropout); the run logs which.
    # Needs a dataset prepared with document boundaries (its packed shards hold `doc_starts`).
    document_mask: bool = False
    # Translation: each shard's samples, in their seeded order, are sorted by length and cut into
    # bands of 1/length_bands global batch, which are then shuffled, length_bands of them to a
    # step, and each of the step's rounds (grad_accum) is dealt to the ranks: a batch holds pairs
    # of about one length, so it pads little (fairseq's and tensor2tensor's length bucketing,
    # within a shard), and every rank gets about the same tokens, so none waits long for
    # another. The samples of an epoch are the same; which of them share a batch changes.
    length_grouping: bool = False
    # Length bands a step draws from (a divisor of the global batch). One band gives every step
    # pairs of one length (short labels in one, long sentences in the next); two keep two lengths
    # a step, and score at least as well as one-batch groups over five sample orders
    # (docs/results.md). Where bands outnumber a step's rounds (grad_accum), a batch mixes bands
    # and pads to the longest.
    length_bands: int = 2
    # Weighted mixture of the dataset's sources for the train split, {source name: weight}
    # (weights are normalized; sources left out are not read). An epoch of the mixture has as
    # many samples as the named sources together, a share of them in proportion to its weight:
    # a source whose share exceeds its size is repeated, a larger one is read in part, each
    # epoch continuing where the last stopped. {} = every source in its natural proportion.
    mixture: Dict[str, float] = field(default_factory=dict)
    # Resume with other mixture weights than the checkpoint's (refused otherwise): the run
    # continues at the same (epoch, sample) position, drawing with the new weights from there.
    allow_mixture_change: bool = False
    # Resume onto other train data than the checkpoint's loader read (another dataset with the
    # same tokenizer, another data.seed or length grouping; refused otherwise): the weights,
    # optimizer, schedule and step carry over, and this data is read from its first sample. No
    # effect where the data is the checkpoint's.
    allow_data_change: bool = False


def loader_problems(data: LoaderConfig) -> list[str]:
    """`data.*`'s problems that the types cannot express, each message starting with its key."""
    checks = [
        (data.micro_batch_size > 0, "data.micro_batch_size: must be positive"),
        (0 <= data.max_bad_fraction <= 1, "data.max_bad_fraction: must be in [0, 1]"),
    ]
    return [message for ok, message in checks if not ok]


def global_batch_size(micro_batch_size: int, grad_accum: int, world_size: int) -> int:
    """Samples per optimizer step: micro batch x accumulation x ranks. The one owner of the
    product: the loader cuts the epoch's stream by it and the trainer's BatchPlan reports it."""
    return micro_batch_size * grad_accum * world_size
