"""What a checkpoint records beside the engine's tensors: `CheckpointState`, typed and versioned,
to and from its two on-disk forms (the engine's client state, every field; client_state.json, the
fields a resume and an export read before loading anything), and the random streams it keeps."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from common.configure import UserError

# 1: the record as typed here; a checkpoint without a version is of the same fields, written
# before they had one.
VERSION = 1
# client_state.json leaves these out: the loader's position and every rank's random streams are
# the engine's to load, the guard's history only the trainer's.
ENGINE_ONLY = ("loader", "rng", "guard")


@dataclass
class CheckpointState:
    step: int
    tokens_seen: int
    loader: dict  # the train loader's `state_dict()`: where its stream stands
    rng: list  # every rank's random streams (`rng_state`), rank order
    # the run's resolved config, whole (what a resume compares); None in checkpoints before it
    config: Optional[dict]
    tokenizer_sha256: Optional[str]
    wandb_run_id: Optional[str]
    world_size: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum: int
    guard: dict = field(default_factory=dict)  # `Guard.state_dict()`: skip counts, loss history
    tokens_by_source: dict = field(default_factory=dict)  # training tokens per source, all ranks
    dataset: dict = field(default_factory=dict)  # what exports name the data by
    target_tokenizer_sha256: Optional[str] = None  # a translation target's own tokenizer
    version: int = VERSION

    def client_state(self) -> dict:
        """The engine's client state: every field (a target tokenizer's hash only where there
        is one, as checkpoints without it were written)."""
        state = dataclasses.asdict(self)
        if state["target_tokenizer_sha256"] is None:
            del state["target_tokenizer_sha256"]
        return state

    def listing(self) -> dict:
        """client_state.json: what is read before a load (`launch.checkpoint.layout`), the model
        config apart at the top for the resume's check of the network."""
        info = {k: v for k, v in self.client_state().items() if k not in ENGINE_ONLY}
        info["model"] = self.config["model"]
        return info

    @classmethod
    def from_client_state(cls, client: dict, where: str = "") -> "CheckpointState":
        """The state the engine's load returned; a field a checkpoint of a newer version holds
        but this code does not know is refused in one line rather than dropped."""
        version = int(client.get("version", VERSION))
        if version > VERSION:
            raise UserError(
                f"checkpoint {where} was written by a newer version of the trainer (checkpoint "
                f"record version {version}; this one reads up to {VERSION})"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {k: v for k, v in client.items() if k in known}
        values["version"] = version
        for name in ("wandb_run_id", "config", "tokenizer_sha256"):
            values.setdefault(name, None)
        # recorded since the batch shape was: older ones resume on their own world size only
        for name in ("world_size", "global_batch_size", "micro_batch_size", "grad_accum"):
            values.setdefault(name, 0)
        return cls(**values)


def rng_state() -> dict:
    """This rank's random streams, as a checkpoint records them (`set_rng_state` sets them back)."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
