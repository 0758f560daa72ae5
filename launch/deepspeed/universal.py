"""A ZeRO checkpoint written by one world size made loadable on another: DeepSpeed's universal
checkpoint (Lian et al. 2024, arXiv:2406.18820), a copy beside it with every parameter's fp32
weights and Adam moments whole."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

from common.configure import UserError
from common.hashing import file_sha256
from launch.checkpoint import (
    INTEGRITY,
    UNIVERSAL_INFO,
    is_universal,
    is_zero_partitioned,
    universal_tag_for,
    verify,
    write_integrity,
)


def to_universal(root: str | Path, tag: str) -> tuple[Path, str]:
    """The (root, tag) that checkpoint `root/tag` loads from on any world size: itself, or a
    universal copy written beside it (`step_X.universal`), converted by DeepSpeed's
    `ds_to_universal` the first time and reused afterwards.

    What happens, by ZeRO stage and precision:
    - stage 0, fp32: nothing to convert. The module and the whole AdamW state are in
      `mp_rank_00_model_states.pt`, replicated, and load on any world size as they are.
    - stage 0, bf16: the same: bf16 there is torch's autocast over fp32 weights
      (`launch.deepspeed.config`), and AdamW is DeepSpeed's optimizer as it is. (DeepSpeed's own
      bf16 at stage 0, from a user's JSON, wraps AdamW in FP16_UnfusedOptimizer, whose fp32
      masters and moments are whole in that file too.)
    - stages 1 and 2, fp32 or bf16: converted. Each rank's `*zero_pp_rank_R_*optim_states.pt`
      holds its flat partition of the fp32 masters and moments (ZeRO-1 in bf16: BF16_Optimizer's,
      which accumulates gradients in fp32, `_bf16_accumulation`).
    - stage 3, fp32 or bf16: converted. The parameters are partitioned as well.
    A checkpoint with per-rank optimizer files (BF16_Optimizer's too) is converted whatever
    wrote it. The copy is loaded by an engine built with `deepspeed_config(...,
    load_universal=True)` under the same ZeRO stage, or 1 for 2 and back (`Engine.load`,
    which also repairs DeepSpeed's ZeRO-3 universal load); a ZeRO-3 copy does not load
    under stages 1 and 2, nor theirs under 3.

    Run it on one process (rank 0) while the others wait: it needs no process group. The copy is
    built in a hidden sibling directory and renamed into place when complete, so a crash leaves
    no half copy, and the original is never touched. DeepSpeed's console output goes to
    `conversion.log` in the copy; a failure is raised as one UserError line.
    """
    root = Path(root)
    source = root / tag
    if not source.is_dir():
        raise UserError(f"checkpoint {source}: not found")
    if is_universal(root, tag) or not is_zero_partitioned(source):
        return root, tag
    universal_tag = universal_tag_for(tag)
    target = root / universal_tag
    if (target / UNIVERSAL_INFO).is_file():
        stale = _stale_copy(source, target)
        if stale is None:
            return root, universal_tag
        print(
            f"warning: universal copy {target} {stale}: converting {source} again", file=sys.stderr
        )
    # ds_to_universal writes a `latest_universal` pointer beside its output folder: that stays
    # inside the hidden directory, and our own `latest` pointer keeps naming the original.
    partial = root / f".{universal_tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    build = partial / universal_tag
    build.mkdir(parents=True)
    log = build / "conversion.log"
    try:
        _convert(source, build, log)
    except Exception as err:  # DeepSpeed's asserts, missing files, torch.load errors
        reason = (str(err).strip().splitlines() or [""])[0]
        raise UserError(
            f"checkpoint {source}: conversion to a universal checkpoint failed: "
            f"{type(err).__name__}: {reason} (DeepSpeed's output: {log})"
        ) from err
    if target.exists():  # a copy without its info file, of an older hand conversion
        shutil.rmtree(target)
    os.replace(build, target)
    shutil.rmtree(partial, ignore_errors=True)
    return root, universal_tag


def _convert(source: Path, build: Path, log: Path) -> None:
    args = SimpleNamespace(
        input_folder=str(source),
        output_folder=str(build),
        # In this process, one file at a time: no worker pool to fork from a
        # process that may hold a process group.
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # Our checkpoints carry no Megatron `universal_checkpoint_info`; without
        # tensor or pipeline parallelism its only content is a version, which
        # this adds, so checkpoints written before this conversion existed work
        # too.
        inject_missing_state=True,
    )
    # Imported outside the redirection: DeepSpeed's logger handler keeps the stream it finds at
    # import, and must not keep the log file, which closes after the conversion.
    import deepspeed
    from deepspeed.checkpoint import ds_to_universal

    with _output_to(log):
        ds_to_universal.main(args)
    client_state = source / "client_state.json"
    if client_state.is_file():
        shutil.copy2(client_state, build / client_state.name)
    write_integrity(build)
    info = {
        "source": source.name,
        "deepspeed": deepspeed.__version__,
        "source_integrity": _integrity_sha256(source),
    }
    # written last: the copy is complete
    (build / UNIVERSAL_INFO).write_text(json.dumps(info, indent=1) + "\n")


def _stale_copy(source: Path, copy: Path) -> str | None:
    """Why universal copy `copy` of `source` must not be reused (None: it may): it was converted
    from other contents of the source's tag (one rewritten since), or fails verification.
    Copies made before either was recorded are reused as they are."""
    try:
        info = json.loads((copy / UNIVERSAL_INFO).read_text())
    except (OSError, ValueError) as err:
        return f"has an unreadable {UNIVERSAL_INFO} ({err})"
    recorded, now = info.get("source_integrity"), _integrity_sha256(source)
    if recorded and now and recorded != now:
        return f"was converted from an earlier {source.name}"
    if (copy / INTEGRITY).is_file():
        reason = verify(copy)
        if reason is not None:
            return f"fails verification ({reason})"
    return None


def _integrity_sha256(checkpoint: Path) -> str | None:
    """The sha256 of a checkpoint's integrity.json: its contents in one word."""
    path = checkpoint / INTEGRITY
    return file_sha256(path) if path.is_file() else None


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Python's and the C level's stdout and stderr (tqdm bars, prints) into `path`.

    Import deepspeed before entering: its logger's handler keeps the `sys.stdout` it finds when
    it is created, and one created in here would write to this file after it closed."""
    with (
        open(path, "ab", buffering=0) as sink,
        io.TextIOWrapper(open(path, "ab"), write_through=True) as text,
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
