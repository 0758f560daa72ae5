"""A loader's position in its stream, as a checkpoint keeps it: the epoch and the samples consumed
at a step boundary, with the fingerprint of the stream they count in (its shards, seed, global
batch, mixture and length grouping), so that a resume onto another stream is refused by name,
carried over (another mixture, `allow_mixture_change`) or restarted (`allow_data_change`)."""

from __future__ import annotations

import hashlib
import json
import logging

from common.configure import UserError
from pipeline.load.mixture import Source, describe_shares
from pipeline.load.plan import LoaderPlan

log = logging.getLogger(__name__)

# 3: the order is cut in global batches, and the state counts samples (1 and 2 cut it by rank,
# so their position cannot be carried over: such a run resumes with the code that wrote it).
STATE_VERSION = 3


def stream_fingerprint(plan: LoaderPlan, entries: list[dict], sources: list[Source]) -> dict:
    """What fixes the order of the stream's samples, but for the rank's share of it."""
    listing = json.dumps([[e["path"], int(e["samples"]), e.get("sha256")] for e in entries])
    fingerprint = {
        "task": plan.task,
        "split": plan.split,
        "seed": plan.seed,
        "global_batch_size": plan.global_batch_size,
        "shards_sha256": hashlib.sha256(listing.encode()).hexdigest(),
        # Samples per epoch of each mixed source: what the weights fix (None: unmixed).
        "mixture": {s.name: s.per_epoch for s in sources} if plan.mixture else None,
    }
    # grouping changes which samples share a step: k bands of 1/k global batch (already in the
    # fingerprint), each round dealt to the ranks (the loader design, 9)
    if plan.length_grouping:
        fingerprint["length_grouping"] = f"{plan.length_bands} length band(s) a step, rounds dealt"
    return fingerprint


def position_state(plan: LoaderPlan, epoch: int, consumed: int, num_batches: int, fingerprint):
    """The loader state after `consumed` of the epoch's `num_batches` batches, which must be a
    step boundary (a multiple of grad_accum)."""
    if consumed % plan.grad_accum:
        raise RuntimeError(
            f"loader state asked for mid-step: {consumed} batches of {plan.grad_accum} per step"
        )
    if consumed >= num_batches:  # a finished epoch resumes at the start of the next
        epoch, consumed = epoch + 1, 0
    return {
        "version": STATE_VERSION,
        "epoch": epoch,
        "samples_consumed": consumed * plan.micro_batch_size * plan.world_size,
        "fingerprint": dict(fingerprint),
    }


def saved_position(
    state: dict, plan: LoaderPlan, fingerprint: dict, num_batches: int, saved_data: str = ""
) -> tuple[int, int] | str:
    """(epoch, batches consumed) of a loader state (`position_state`) in this stream, or, with
    `allow_data_change` and another stream, what differs (the stream is then read from its first
    sample). One of another stream (the fingerprint, but for the mixture) is refused otherwise,
    naming what differs and `saved_data` (the overrides of the data it read, where the caller
    knows them). Another mixture alone is refused unless `allow_mixture_change`, which keeps the
    position."""
    version = state.get("version")
    if version in (1, 2):
        raise UserError(
            f"the loader state is of version {version}, whose order was cut by rank: its "
            "position cannot be carried into this version's order (resume with the version "
            "that wrote it, or start anew)"
        )
    if version != STATE_VERSION:
        raise UserError(f"loader state version {version!r}, expected {STATE_VERSION}")
    saved = state.get("fingerprint", {})
    differences = [
        f"{key}: saved {saved.get(key)!r}, now {fingerprint.get(key)!r}"
        for key in sorted(set(fingerprint) | set(saved))
        if saved.get(key) != fingerprint.get(key) and key != "mixture"
    ]
    if differences and plan.allow_data_change:
        return "; ".join(differences)
    mixture_changed = saved.get("mixture") != fingerprint["mixture"]
    if mixture_changed and not plan.allow_mixture_change:
        raise UserError(
            "data.mixture: the checkpoint's run drew "
            f"{describe_shares(saved.get('mixture'))} per epoch, this run would draw "
            f"{describe_shares(fingerprint['mixture'])}; pass "
            "data.allow_mixture_change=true to continue from the "
            "same position with the new weights"
        )
    if differences:
        as_saved = f" ({saved_data})" if saved_data else ""
        raise UserError(
            "the loader state does not match this loader, so the batches "
            "after a resume would differ: " + "; ".join(differences) + "; resume on the data "
            f"it read{as_saved}, or pass data.allow_data_change=true to carry the "
            "checkpoint's weights, optimizer and step over onto this data, read from its "
            "first sample"
        )
    epoch, samples = int(state["epoch"]), int(state["samples_consumed"])
    consumed, remainder = divmod(samples, plan.micro_batch_size * plan.world_size)
    if mixture_changed:
        if consumed >= num_batches:  # the new mixture's epoch is shorter: it is over
            epoch, consumed, remainder = epoch + 1, 0, 0
        log.warning(
            "data.mixture changed on resume (data.allow_mixture_change=true): was %s per "
            "epoch, now %s; continuing at epoch %d, batch %d with the new weights",
            describe_shares(saved.get("mixture")),
            describe_shares(fingerprint["mixture"]),
            epoch,
            consumed,
        )
    if epoch < 0 or remainder or consumed % plan.grad_accum or not 0 <= consumed <= num_batches:
        raise UserError(
            f"loader state epoch {epoch}, {samples} samples consumed: not a whole "
            f"number of global batches of {plan.global_batch_size} within the "
            f"epoch's {num_batches // plan.grad_accum}"
        )
    return epoch, consumed
