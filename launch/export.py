"""`python -m launch.export [CONFIG.yaml] checkpoint=RUN_DIR out=DIR [format=hf]`: a DeepSpeed
checkpoint to a self-contained model directory.

The checkpoint is a run directory, its `checkpoints/` directory (the latest complete
checkpoint is taken) or one `step_*` checkpoint, of any ZeRO stage. `out` receives, in our
format (the default):

    model.safetensors   consolidated fp32 weights (tied tensors stored once)
    config.json         {"model": ModelConfig, "task", "step", "tokens_seen", "tokenizer_sha256",
                        "source"}
    tokenizer files     the tokenizer the weights were trained with, as the dataset held it:
                        tokenizer.model, or a Hugging Face tokenizer.json (+ tokenizer_config.json)
    provenance.json     what made the weights (`provenance`)

Fine-tuning (`init.*`), evaluation and the Hugging Face converters (`model.hf`) read this
directory: safetensors and JSON, nothing unpickled. With `format=hf`, `out` is a directory in
Hugging Face's `save_pretrained` layout instead (model.safetensors, config.json,
generation_config.json where it applies), of the class `model.hf_dir.hf_config_for` picks (GPT-2,
Llama, BERT, or a BERT + GPT-2 EncoderDecoderModel), with its tokenizer for `AutoTokenizer`: a
Hugging Face tokenizer's own files as the dataset held them, or our SentencePiece model converted
to a fast tokenizer (`launch.hf_tokenizer`) with tokenizer.model beside it; and provenance.json. A
model the class cannot compute is refused in one line naming the option, before the weights are
read.

`out` is replaced only when it is an earlier export or empty, never when it holds anything else or
is the run directory being read or holds it (`check_out`); it is written under OUT.lock in a
staging directory of the run's own, which a failure removes (`writing`, `common.outputs`). The
run's tokenizer file must be the one its checkpoint recorded.

The checkpoint is verified against its integrity.json and read weights-only
(`launch.deepspeed.safe_load.consolidated_state_dict`): a damaged or partial checkpoint, a universal
copy, or a torch file holding anything but tensors and plain data (a planted pickle payload) is
refused in one line, exit status 2.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from common.configure import (
    UserError,
    config_to_dict,
    load_config,
    parse_cli,
    run_main,
)
from common.hashing import file_sha256
from common.lock import dir_lock
from common.optional import need
from common.outputs import (
    check_replaceable,
    clear_leftovers,
    real_output,
)
from common.progress import meter
from common.terminal import leave_terminal
from launch.checkpoint import checkpoint_root, latest_tag
from launch.config import ExportConfig, TrainConfig
from launch.model_dir import (
    CONFIG,
    PROVENANCE,
    WEIGHTS,
    read_json,
    save_hf_dir,
    save_model_dir,
)
from model import ModelConfig
from pipeline.format import TARGET_DIR
from pipeline.tokenizer import SENTENCEPIECE_FILE, tokenizer_file_in

USAGE = """usage: python -m launch.export [CONFIG.yaml] checkpoint=RUN_DIR out=DIR [format=ours|hf]

A training checkpoint of any ZeRO stage to plain weights, config.json and its tokenizer
(format=hf: a Hugging Face model directory with its tokenizer)."""
FORMATS = ("ours", "hf")


def locate_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints root, tag) for a run dir, a checkpoints dir or a step_* dir."""
    path = Path(path)
    for root in (checkpoint_root(path), path):
        tag = latest_tag(root)
        if tag:
            return root, tag
    if path.is_dir() and path.name.startswith("step_"):
        return path.parent, path.name
    raise UserError(f"no complete checkpoint at {path}")


# What an export writes (ours, or format=hf with its tokenizer and, for a large model, its weights
# in shards): a directory holding only these, and saying it is an export, is replaced; no other.
EXPORT_NAMES = {
    WEIGHTS,
    CONFIG,
    SENTENCEPIECE_FILE,
    PROVENANCE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
    TARGET_DIR,  # a translation target's own tokenizer
}
WEIGHT_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
LOCK_SUFFIX = ".lock"  # OUT.lock, beside `out`: held while an export writes it


def is_export(directory: Path) -> bool:
    """Whether `directory` is an export of ours (`launch.export`, `launch.average`) and nothing
    else."""
    return not foreign_to_export(directory)


def foreign_to_export(directory: Path) -> list[str]:
    """What in `directory` an export did not write: everything, unless its provenance.json or
    config.json says it is an export; otherwise the names an export never writes."""
    names = sorted(path.name for path in directory.iterdir())
    for name, key in ((PROVENANCE, "checkpoint"), (CONFIG, "model")):
        try:
            if key in json.loads((directory / name).read_text()):
                break
        except (OSError, ValueError, TypeError):
            continue
    else:
        return names
    return [name for name in names if name not in EXPORT_NAMES and not WEIGHT_SHARD.fullmatch(name)]


def check_out(out: Path, run_dir: Path) -> None:
    """UserError, one line, for an `out` an export must not replace: the run directory being read,
    a directory inside it or above it; a file, or a directory holding anything but an export of
    ours (`common.outputs.check_replaceable`)."""
    out = real_output(out, "out")
    target, run = out.resolve(), run_dir.resolve()
    where = "is" if target == run else "is inside" if run in target.parents else "holds"
    if target == run or run in target.parents or target in run.parents:
        raise UserError(
            f"out: {out} {where} the run directory {run_dir} being exported; choose a directory "
            "outside it"
        )
    check_replaceable(out, "out", "an export", foreign_to_export, None)


@contextlib.contextmanager
def claiming(out: str | Path, run_dir: Path, what: str = "export"):
    """Hold OUT.lock (`common.lock`) while `out` is written, so that a second export into it fails
    at once naming the first; `out` is checked (`check_out`) once the lock is held."""
    check_out(Path(out), run_dir)  # before anything is written, the lock file included
    out = real_output(out, "out")
    with dir_lock(out, what=what, lock_file=out.with_name(out.name + LOCK_SUFFIX)):
        clear_leftovers(out)  # what an export killed outright left
        check_out(out, run_dir)  # as it is now, no other export writing it
        yield


@dataclass(frozen=True)
class RunCheckpoint:
    """A training run's checkpoint with what it was trained with."""

    root: Path  # RUN_DIR/checkpoints
    tag: str
    config: TrainConfig
    tokenizer: Path
    client: dict  # client_state.json: step, tokens_seen, tokenizer_sha256, ...
    # a translation target's own tokenizer (RUN_DIR/target/), None when both sides share one
    target_tokenizer: Path | None = None


def read_run_checkpoint(path: str | Path) -> RunCheckpoint:
    """The checkpoint a run dir, checkpoints dir or step_* dir names, with its run's config."""
    root, tag = locate_checkpoint(path)
    config_file = root.parent / "config.yaml"
    if not config_file.is_file():
        raise UserError(f"{config_file} not found: the run directory of {root / tag} is incomplete")
    client_file = root / tag / "client_state.json"
    client = read_json(client_file) if client_file.is_file() else {}
    return RunCheckpoint(
        root,
        tag,
        load_config(TrainConfig, config_file),
        tokenizer_file_in(root.parent),
        client,
        target_tokenizer_in(root.parent),
    )


def target_tokenizer_in(directory: Path) -> Path | None:
    """The file of a translation target's own tokenizer in a run or export directory, if it has
    one (DIR/target/)."""
    target = directory / TARGET_DIR
    return tokenizer_file_in(target) if target.is_dir() else None


def provenance(run: RunCheckpoint) -> dict:
    """The one record every export carries: what trained the weights and on what. The dataset's
    fingerprints are those the run recorded at the checkpoint (`launch.train`; null for a checkpoint
    written before it recorded them): the manifest's, and the train shards' listing
    with their sha256s."""
    dataset = run.client.get("dataset") or {}
    return {
        "task": run.config.task,
        "step": run.client.get("step"),
        "tokens_seen": run.client.get("tokens_seen"),
        "tokens_by_source": run.client.get("tokens_by_source"),
        "tokenizer_sha256": file_sha256(run.tokenizer),
        **(
            {"target_tokenizer_sha256": file_sha256(run.target_tokenizer)}
            if run.target_tokenizer
            else {}
        ),
        "dataset": {
            "data_dir": run.config.data.data_dir,
            "manifest_sha256": dataset.get("manifest_sha256"),
            "train_shards_sha256": dataset.get("train_shards_sha256"),
        },
        "mixture": {
            "weights": dict(run.config.data.mixture),
            "samples_per_epoch": dataset.get("mixture"),
        },
        "checkpoint": str((run.root / run.tag).resolve()),
        "config": config_to_dict(run.config),
    }


def export(checkpoint: str | Path, out: str | Path, format: str = "ours") -> dict:
    from launch.deepspeed.safe_load import consolidated_state_dict
    from launch.preconditions import check_writable_dir

    if format not in FORMATS:
        raise UserError(f"format: {format!r} is not one of {', '.join(FORMATS)}")
    # Before the weights are consolidated: an export that cannot be written fails in one line.
    check_writable_dir(Path(out).absolute().parent, "out")
    run = read_run_checkpoint(checkpoint)
    check_tokenizer(run)
    if format == "hf":
        need("transformers", "format=hf")
        check_hf_exportable(run.config.model)
    record = provenance(run)
    with (
        claiming(out, run.root.parent),
        # verify and consolidate; write
        meter(2, f"export {run.tag}", "phase") as shown,
    ):
        state = consolidated_state_dict(run.root, run.tag)
        shown.update()
        if format == "hf":
            save_hf_dir(out, state, run.config.model, run.tokenizer, record, run.target_tokenizer)
        else:
            meta = {key: record[key] for key in ("task", "step", "tokens_seen")} | {
                "source": record["checkpoint"]
            }
            save_model_dir(
                out, state, run.config.model, run.tokenizer, meta, record, run.target_tokenizer
            )
        shown.update()
    return record


def check_tokenizer(run: RunCheckpoint) -> None:
    """UserError, one line, unless the run's tokenizer file is there and is the one its
    checkpoint recorded (client_state.json's sha256): a damaged or replaced file would travel
    with the weights under its new hash."""
    recorded_target = run.client.get("target_tokenizer_sha256")
    if recorded_target and run.target_tokenizer is None:
        raise UserError(
            f"{run.root.parent / TARGET_DIR} not found: checkpoint {run.root / run.tag} was "
            "trained with a target tokenizer of its own; copy the dataset's target/ back"
        )
    for tokenizer, recorded in (
        (run.tokenizer, run.client.get("tokenizer_sha256")),
        (run.target_tokenizer, recorded_target),
    ):
        if tokenizer is None:
            continue
        if not tokenizer.is_file():
            raise UserError(f"{tokenizer} not found")
        if recorded and (actual := file_sha256(tokenizer)) != recorded:
            raise UserError(
                f"{tokenizer} (sha256 {actual[:12]}...) is not the tokenizer checkpoint "
                f"{run.root / run.tag} was trained with ({recorded[:12]}...): damaged or replaced; "
                f"copy the dataset's {tokenizer.name} back"
            )


def check_hf_exportable(model_cfg: ModelConfig) -> None:
    """UserError, one line naming the option, for a model no Hugging Face class computes."""
    from model.hf_dir import hf_config_for

    try:
        hf_config_for(model_cfg)
    except ValueError as err:
        raise UserError(f"format=hf: {err}") from None
    except ImportError as err:
        raise UserError(f"format=hf needs transformers (pip install -e '.[hf]'): {err}") from None


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(
        ExportConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True
    )
    record = export(cfg.checkpoint, cfg.out, cfg.format)
    print(
        f"exported {record['task']} step {record['step']} from {record['checkpoint']} "
        f"to {cfg.out} ({cfg.format})"
    )
    return 0


def interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, through the clean-up of the staging directory and
    OUT.lock;
    Python's default would end the process on the spot and leave them. For the commands' own
    processes (`__main__`), not for a caller of `main`."""

    def interrupt(signum: int, frame) -> None:
        if signum == signal.SIGHUP:
            leave_terminal()  # gone: a line written to it would fail before the clean-up
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)


if __name__ == "__main__":
    interrupt_on_signals()
    run_main(main)
