"""Checkpoints of a training run, one room: where they live, whether they are intact, whether a
save fits, when a run saves and the save itself.

    layout.py     the directories and tags, the `latest` pointer, retention, what a checkpoint
                  records of itself, which checkpoints a resume may continue from
    integrity.py  integrity.json: written at a save, verified at a resume (the newest intact
                  checkpoint) and by every reader; checkpoints older than it
    space.py      what a save needs, and the one line for a save its file system cannot hold
    state.py      `CheckpointState`: the record beside the tensors, typed and versioned, in its
                  two on-disk forms; the random streams it keeps
    save.py       when a run saves (`Checkpointer`) and the save, on every rank
    restore.py    the engine's load and the record read back (`load_state`)

Callers use the names below (`from launch import checkpoint as ckpt`), and `space`, `state`, `save`
and `restore` by their modules: `save` and `restore` run with the engine and the process group, so
that importing this package (export, the dry run, the DeepSpeed glue) loads neither DeepSpeed nor
torch.distributed (tests/launch/test_checkpoint_integrity.py). The two DeepSpeed calls of a
checkpoint stay in its glue, the only importer of deepspeed: the engine's write
(`launch.deepspeed.engine.Engine.save`) and the conversion to another world size
(`launch.deepspeed.universal`).
"""

from launch.checkpoint.integrity import (
    INTEGRITY,
    check_archives,
    choose_resume,
    files_for_rank,
    files_on_disk,
    first_intact,
    hash_files,
    hashing_shares,
    require_intact,
    resume_verdict,
    verify,
    write_integrity,
)
from launch.checkpoint.layout import (
    MODEL_STATES,
    POINTER,
    RANK_FILE,
    UNIVERSAL_INFO,
    UNIVERSAL_SUFFIX,
    checkpoint_root,
    checkpoint_tags,
    client_info,
    discard,
    is_universal,
    is_zero_partitioned,
    latest_tag,
    move_pointer,
    prune,
    resume_candidates,
    saved_model_config,
    saved_shape,
    saved_world_size,
    tag_for,
    universal_tag_for,
)

__all__ = [
    "INTEGRITY",
    "MODEL_STATES",
    "POINTER",
    "RANK_FILE",
    "UNIVERSAL_INFO",
    "UNIVERSAL_SUFFIX",
    "check_archives",
    "checkpoint_root",
    "checkpoint_tags",
    "choose_resume",
    "client_info",
    "discard",
    "files_for_rank",
    "files_on_disk",
    "first_intact",
    "hash_files",
    "hashing_shares",
    "is_universal",
    "is_zero_partitioned",
    "latest_tag",
    "move_pointer",
    "prune",
    "require_intact",
    "resume_candidates",
    "resume_verdict",
    "saved_model_config",
    "saved_shape",
    "saved_world_size",
    "tag_for",
    "universal_tag_for",
    "verify",
    "write_integrity",
]
