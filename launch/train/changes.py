"""What a resumed job may change from the config its checkpoint was trained with (the checkpoint
records it whole: `client_state.json`'s and the engine's client state's "config"). Every key that
differs falls in one of two classes, none in a third: applied from the resumed step on, each said
in one line on stderr (`applied_lines`), or refused before anything trains, in one line naming
each key, both values and the way forward (`refusal`). config.yaml, which the resumed job
rewrites, then records what trains.

Applied: every key that the job reads as it starts and that no state in the checkpoint replaces,
and the optimizer's and the schedule's, which the checkpoint's state would replace but which the
resume sets back from this config after the load (`launch.deepspeed.engine.Engine.load`'s
caller, `launch.train.resume.restore`): AdamW's betas, eps, weight_decay and kernel from `optim.*`,
the schedule's peak from `optim.lr`, and the rate of the next step recomputed from it at the
restored step, with this job's `schedule.*` and `max_steps` (a jump, not a new warmup). The data's
keys are applied where the loader's stream is the checkpoint's (`ShardLoader.load_state_dict`
refuses another one, or with `data.allow_data_change=true` reads it from its first sample); the
batch's where the global batch is the checkpoint's (`launch.train.resume.find_resume` refuses
another).

Refused (`REFUSED`, `_refusal_reason`): what the checkpoint's state replaces and a resume cannot
set back (the seed and the initialisation: its weights and random streams; the network itself:
`model.*` but `TRAINING_ONLY_FIELDS`, refused by `find_resume` first), and what its files cannot
load into (the precision, optimizer offload and ZeRO stage that wrote them, but for 1 <-> 2,
whose files are the same).
"""

from __future__ import annotations

from pathlib import Path

from common.configure import config_to_dict, show
from launch.config import TrainConfig
from model.config import TRAINING_ONLY_FIELDS

# The checkpoint's state replaces what these set, or its files do not load under another value:
# key -> why, as the refusal line gives it.
_WEIGHTS = "the checkpoint's weights replace what it sets"
REFUSED = {
    "task": "the checkpoint's network and loader are another task's",
    "seed": "the checkpoint's weights and random streams replace what it sets",
    "model.init_std": _WEIGHTS,
    "init.model": _WEIGHTS,
    "init.encoder": _WEIGHTS,
    "init.decoder": _WEIGHTS,
    "deepspeed.precision": "the checkpoint's optimizer files are the writer's precision's",
    "deepspeed.offload_optimizer": "the checkpoint's optimizer state is laid out for the writer's",
    "deepspeed.offload_params": "the checkpoint's optimizer state is laid out for the writer's",
}

# Not compared: the key that chose the checkpoint.
NOT_COMPARED = ("resume",)

# Compared whole (a dict whose keys are the user's, not the schema's).
WHOLE = ("data.mixture",)


def leaves(values: dict, prefix: str = "") -> dict:
    """A config dict as {"optim.lr": 3e-4, "data.mixture": {...}, ...}: keys as overrides name
    them."""
    out = {}
    for key, value in values.items():
        name = prefix + key
        if isinstance(value, dict) and name not in WHOLE:
            out.update(leaves(value, name + "."))
        else:
            out[name] = value
    return out


def differences(saved: dict | None, cfg: TrainConfig) -> list[tuple[str, object, object]]:
    """(key, the checkpoint's value, this job's) of each compared key whose values differ; keys
    one of the two configs lacks (a checkpoint older than the key) are not compared. `saved`:
    the checkpoint's config as a plain dict; None (unrecorded): no differences."""
    if not saved:
        return []
    there, here = leaves(saved), leaves(config_to_dict(cfg))
    return [
        (key, there[key], here[key])
        for key in here
        if key in there and key not in NOT_COMPARED and there[key] != here[key]
    ]


def _refusal_reason(key: str, old, new, saved: dict) -> str | None:
    """Why a change of `key` from `old` to `new` cannot be applied on a resume; None: applied."""
    if key in REFUSED:
        return REFUSED[key]
    if key.startswith("model.") and key.removeprefix("model.") not in TRAINING_ONLY_FIELDS:
        return "the checkpoint holds that network"
    if key == "deepspeed.zero_stage" and {old, new} != {1, 2}:
        return "the checkpoint's files are laid out for the writer's stage, and only 1 and 2 share"
    if (
        key == "deepspeed.initial_scale_power"
        and leaves(saved).get("deepspeed.precision") == "fp16"
    ):
        return "the checkpoint's dynamic loss scale replaces it"
    return None


def refusal(checkpoint: Path, saved: dict | None, cfg: TrainConfig) -> str | None:
    """One line for a job whose config changes keys that a resume cannot apply (each with both
    values and why), with the way forward: the overrides that resume as saved, or a new run_dir
    started from these weights (an export, `init.model`: step 0, a fresh optimizer); None if
    every change applies."""
    refused = [
        (key, old, new, why)
        for key, old, new in differences(saved, cfg)
        if (why := _refusal_reason(key, old, new, saved or {}))
    ]
    if not refused:
        return None
    values = "; ".join(
        f"{key} {show(old)} there, {show(new)} here ({why})" for key, old, new, why in refused
    )
    as_saved = " ".join(f"{key}={show(old)}" for key, old, _, _ in refused)
    return (
        f"checkpoint {checkpoint} cannot be resumed with this job's settings: {values}; resume "
        f"it with {as_saved}, or carry its weights into a new run_dir: python -m launch.export "
        f"checkpoint={checkpoint} out=DIR, then train with init.model=DIR run_dir=NEW (step 0, a "
        "fresh optimizer)"
    )


def applied_lines(saved: dict | None, cfg: TrainConfig, step: int) -> list[str]:
    """One line per changed key that this job applies (the refused ones stopped it before)."""
    return [
        f"resume: {key} {show(old)} -> {show(new)} applied from step {step}"
        for key, old, new in differences(saved, cfg)
    ]
