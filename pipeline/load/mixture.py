"""Mixtures of sources: which sources an epoch draws from and how many samples each gives it
(`epoch_sources`, `mixture_shares`), and how a log line says so."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from common.configure import UserError
from pipeline.load.shards import Shard

DEFAULT_SOURCE = "default"  # the source of shard records that name none (one-source datasets)


@dataclass(frozen=True)
class Source:
    """One source's shards (manifest order) and what it gives each epoch of the stream."""

    name: str
    tag: int  # keeps its shard orders apart from the other sources' (a hash of the name)
    shards: tuple[Shard, ...]
    samples: int  # N_s, in its shards
    per_epoch: int  # n_s: its samples in one epoch (N_s unmixed)


def epoch_sources(
    by_source: dict[str, list[Shard]], mixture: dict[str, float], where: str
) -> tuple[Source, ...]:
    """The sources an epoch draws from: unmixed, one holding every shard in manifest order;
    mixed, the named ones, each with its share of the epoch (see `mixture_shares`)."""
    if not mixture:
        shards = tuple(
            sorted(
                (shard for shards in by_source.values() for shard in shards), key=lambda s: s.index
            )
        )
        total = sum(shard.samples for shard in shards)
        return (
            Source(
                DEFAULT_SOURCE if len(by_source) != 1 else next(iter(by_source)),
                0,
                shards,
                total,
                total,
            ),
        )
    unknown = [name for name in mixture if name not in by_source]
    if unknown:
        raise UserError(
            f"data.mixture: {where} has no source {unknown[0]!r}; its sources: "
            f"{', '.join(sorted(by_source))}"
        )
    for name, weight in mixture.items():
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise UserError(
                f"data.mixture.{name}: a weight must be a positive number, got {weight!r}"
            )
    sizes = {name: sum(shard.samples for shard in by_source[name]) for name in mixture}
    empty = [name for name, size in sizes.items() if size == 0]
    if empty:
        raise UserError(f"data.mixture: source {empty[0]!r} has no samples in {where}")
    shares = mixture_shares(sizes, mixture)
    return tuple(
        Source(name, _name_tag(name), tuple(by_source[name]), sizes[name], shares[name])
        for name in mixture
    )


def mixture_shares(sizes: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """Samples per epoch of each source: the epoch has as many samples as the sources together,
    divided in proportion to the weights, rounded by largest remainder (ties to the earlier
    name in `weights`), so the counts add up exactly."""
    total, weight_sum = sum(sizes.values()), sum(weights.values())
    exact = {name: total * weight / weight_sum for name, weight in weights.items()}
    shares = {name: int(math.floor(value)) for name, value in exact.items()}
    names = list(weights)
    by_remainder = sorted(
        names, key=lambda name: (-(exact[name] - shares[name]), names.index(name))
    )
    for name in by_remainder[: total - sum(shares.values())]:
        shares[name] += 1
    return shares


def describe_mixture(sources: tuple[Source, ...]) -> str:
    total = sum(source.per_epoch for source in sources)
    return ", ".join(
        f"{s.name} {s.per_epoch / total:.3f} ({s.per_epoch} of {total} samples per epoch, "
        f"{s.per_epoch / s.samples:.2f} passes over its {s.samples})"
        for s in sources
    )


def describe_shares(per_epoch: dict[str, int] | None) -> str:
    if not per_epoch:
        return "every source as it is (no mixture)"
    total = sum(per_epoch.values())
    return (
        "{" + ", ".join(f"{name}: {count / total:.3f}" for name, count in per_epoch.items()) + "}"
    )


def _name_tag(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
