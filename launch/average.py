"""`python -m launch.average [CONFIG.yaml] checkpoint=RUN last=N out=DIR`: the mean of a
run's last N checkpoints.

Checkpoint averaging as in "Attention Is All You Need" (Vaswani et al. 2017, 6.1: the base model
averages the last 5 checkpoints, the big one the last 20). The run's last N complete checkpoints
(oldest first, none newer than the one the `latest` pointer names: a save that never finished is
not a checkpoint) are each turned into plain fp32 weights by the function export uses
(`launch.deepspeed.safe_load.consolidated_state_dict`: verified, weights-only, any ZeRO stage),
averaged elementwise (`average_state_dicts`), and written by `launch.model_dir.save_model_dir`:
`out` is an exported model directory like any other, which `launch.evaluate`, `launch.translate`
and warm starts read unchanged. Exports store fp32, so the mean is stored as computed.

A command of its own rather than an option of `launch.export`: export takes one checkpoint
(a run, a checkpoints/ or a step_* directory), averaging takes a run and a count, and the
two share every step after the weights are read. The grammar is the project's one
(`common.configure.parse_cli`: key=value, an optional YAML first), so `last=5`, not `--last 5`.
Keep `checkpoint.keep_last` >= N (and `checkpoint.every_steps` set) in the training run, or
there are not N checkpoints to average.

Refused in one line (UserError, exit status 2): fewer than N checkpoints; checkpoints whose
weights differ in names or shapes (a different model config) or that were trained with
different tokenizers (`client_state.json`'s tokenizer_sha256).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from common.configure import UserError, parse_cli, run_main
from common.progress import meter
from launch.checkpoint import checkpoint_root, checkpoint_tags, latest_tag
from launch.config import AverageConfig
from launch.export import (
    check_tokenizer,
    claiming,
    interrupt_on_signals,
    provenance,
    read_run_checkpoint,
)
from launch.model_dir import read_json, save_model_dir

USAGE = """usage: python -m launch.average [CONFIG.yaml] checkpoint=RUN last=N out=DIR

The elementwise mean of a run's last N checkpoints, written as launch.export writes one."""


def last_tags(run_dir: str | Path, last: int) -> tuple[Path, list[str]]:
    """(checkpoints root, the last `last` complete tags, oldest first)."""
    if last < 1:
        raise UserError(f"last: must be at least 1, not {last}")
    root = checkpoint_root(run_dir)
    current = latest_tag(root)
    if current is None:
        raise UserError(f"no complete checkpoint at {run_dir}")
    tags = [tag for tag in checkpoint_tags(root) if tag <= current]
    if len(tags) < last:
        raise UserError(
            f"last: {run_dir} has {len(tags)} complete checkpoint(s) ({', '.join(tags)}), not "
            f"{last}; train with checkpoint.keep_last >= last"
        )
    return root, tags[-last:]


def average_state_dicts(
    states: list[dict[str, torch.Tensor]], names: list[str]
) -> dict[str, torch.Tensor]:
    """The elementwise mean of state dicts with the same keys and shapes, in their dtype (`names`
    label them in the error when they differ). Summed in float64, one tensor at a time: the sum
    of a few fp32 numbers is exact there, so the mean is the fp32 mean correctly rounded, and N
    identical checkpoints average to themselves bit for bit."""
    first = states[0]
    for state, name in zip(states[1:], names[1:]):
        if state.keys() != first.keys():
            odd = sorted(state.keys() ^ first.keys())[:3]
            raise UserError(
                f"{name} and {names[0]} hold different weights "
                f"({', '.join(odd)}): not the same model config"
            )
        for key, tensor in state.items():
            if tensor.shape != first[key].shape:
                raise UserError(
                    f"{name} and {names[0]} differ in {key} ({tuple(tensor.shape)} vs "
                    f"{tuple(first[key].shape)}): not the same model config"
                )
    mean = {}
    for key, tensor in first.items():
        total = torch.zeros(tensor.shape, dtype=torch.float64)
        for state in states:
            total += state[key].double()
        mean[key] = (total / len(states)).to(tensor.dtype)
    return mean


def average(run_dir: str | Path, last: int, out: str | Path) -> dict:
    # DeepSpeed is imported by launch/deepspeed/ alone
    from launch.deepspeed.safe_load import consolidated_state_dict
    from launch.preconditions import check_writable_dir

    check_writable_dir(Path(out).absolute().parent, "out")
    root, tags = last_tags(run_dir, last)
    run = read_run_checkpoint(root / tags[-1])
    check_tokenizer(run)
    clients = [
        read_json(root / tag / "client_state.json")
        if (root / tag / "client_state.json").is_file()
        else {}
        for tag in tags
    ]
    tokenizers = {client.get("tokenizer_sha256") for client in clients}
    if len(tokenizers) > 1:
        raise UserError(
            f"checkpoints {tags[0]}..{tags[-1]} of {run_dir} were trained with different tokenizers"
        )
    with claiming(out, root.parent, what="average"):
        states = []
        with meter(len(tags), "average", "checkpoint") as shown:
            for tag in tags:
                states.append(consolidated_state_dict(root, tag))
                shown.update()
        mean = average_state_dicts(states, [str(root / tag) for tag in tags])
        meta = {
            "task": run.config.task,
            "step": run.client.get("step"),
            "tokens_seen": run.client.get("tokens_seen"),
            "source": str((root / tags[-1]).resolve()),
            "averaged": [str((root / tag).resolve()) for tag in tags],
        }
        save_model_dir(
            out,
            mean,
            run.config.model,
            run.tokenizer,
            meta,
            provenance(run) | {"averaged": meta["averaged"]},
            run.target_tokenizer,
        )
    return meta


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(
        AverageConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True
    )
    meta = average(cfg.checkpoint, cfg.last, cfg.out)
    print(
        f"averaged {len(meta['averaged'])} checkpoints of {meta['task']} (last: step "
        f"{meta['step']}) into {cfg.out}"
    )
    return 0


if __name__ == "__main__":
    interrupt_on_signals()
    run_main(main)
