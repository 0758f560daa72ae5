"""What a `ShardLoader` reads and how: one dataset's task and split, cut for one rank of a world
into micro batches of a step, in a seeded order. A plan is checked before anything is read
(`check`), and built from the trainer's `data.*` section by `from_config`."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from common.configure import UserError
from pipeline import remote
from pipeline.load.config import LoaderConfig, global_batch_size


@dataclass(frozen=True)
class LoaderPlan:
    data_dir: str  # a directory, or a URL (`pipeline.remote`)
    task: str  # causal_lm | mlm | translation
    split: str  # train | valid | test
    _: KW_ONLY
    micro_batch_size: int
    grad_accum: int = 1
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0  # DataLoader worker processes (0: in this process)
    seed: int = 0
    epoch: int = 0  # the first epoch iterated
    mlm_probability: float = 0.15
    mlm_mask_fraction: float = 0.8
    mlm_random_fraction: float = 0.1
    # the tokenizer the model was built for; a dataset prepared with another is refused
    expected_tokenizer_sha256: str | None = None
    pin_memory: bool = False
    mixture: dict[str, float] | None = None  # {source: weight}; None or {}: as they are
    allow_mixture_change: bool = False
    allow_data_change: bool = False
    fetch: remote.FetchConfig | None = None  # how a URL's shards are fetched
    document_mask: bool = False
    length_grouping: bool = False
    length_bands: int = 2

    @property
    def global_batch_size(self) -> int:
        return global_batch_size(self.micro_batch_size, self.grad_accum, self.world_size)

    def check(self) -> None:
        """A UserError naming the first setting that cannot make a loader."""
        if self.micro_batch_size < 1 or self.grad_accum < 1:
            raise UserError(
                f"micro_batch_size ({self.micro_batch_size}) and grad_accum "
                f"({self.grad_accum}) must be at least 1"
            )
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UserError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if self.num_workers < 0:
            raise UserError(f"num_workers must be 0 or more, got {self.num_workers}")
        if not 0.0 < self.mlm_probability <= 1.0:
            raise UserError(f"mlm_probability must be in (0, 1], got {self.mlm_probability}")
        mask, random = self.mlm_mask_fraction, self.mlm_random_fraction
        if mask < 0 or random < 0 or mask + random > 1:
            raise UserError(
                f"mlm_mask_fraction ({mask}) and mlm_random_fraction "
                f"({random}) must be non-negative and add up to at most 1"
            )
        if self.length_grouping and (
            self.length_bands < 1 or self.global_batch_size % self.length_bands
        ):
            raise UserError(
                f"data.length_bands: {self.length_bands} must be a positive divisor of the global "
                f"batch ({self.global_batch_size} samples)"
            )

    @classmethod
    def from_config(
        cls,
        cfg: LoaderConfig,
        task: str,
        split: str,
        *,
        rank: int,
        world_size: int,
        grad_accum: int = 1,
        expected_tokenizer_sha256: str | None = None,
        pin_memory: bool = False,
        fetch: remote.FetchConfig | None = None,
    ) -> LoaderPlan:
        """The plan of one split from the trainer's `data.*` section; `fetch`: the settings the
        dataset was opened with (default: the section's)."""
        return cls(
            cfg.data_dir,
            task,
            split,
            micro_batch_size=cfg.micro_batch_size,
            grad_accum=grad_accum,
            rank=rank,
            world_size=world_size,
            num_workers=cfg.num_workers,
            seed=cfg.seed,
            mlm_probability=cfg.mlm_probability,
            mlm_mask_fraction=cfg.mlm_mask_fraction,
            mlm_random_fraction=cfg.mlm_random_fraction,
            expected_tokenizer_sha256=expected_tokenizer_sha256,
            pin_memory=pin_memory,
            # Only training draws by weight: validation reads every source as it is.
            mixture=dict(cfg.mixture) if split == "train" else None,
            allow_mixture_change=cfg.allow_mixture_change,
            allow_data_change=cfg.allow_data_change,
            fetch=fetch or remote.FetchConfig.from_loader_config(cfg),
            document_mask=cfg.document_mask,
            length_grouping=cfg.length_grouping,
            length_bands=cfg.length_bands,
        )
