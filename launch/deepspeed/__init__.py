"""DeepSpeed ZeRO (Rajbhandari et al. 2020): the only module of the project that imports deepspeed.

The training loop talks to `Engine` (forward, backward, step, save, load); the DeepSpeed JSON
is derived from the run config here, from the batch arithmetic computed once in
`launch.config.BatchPlan`. AdamW and its parameter groups are built by the caller
(`launch.optim`) and handed in, as is the learning-rate schedule, which DeepSpeed then
steps at every accumulation boundary and saves with the checkpoint; with ZeRO-Offload that
AdamW is DeepSpeed's CPU Adam, built here (`cpu_adam`) for `launch.optim`.

ZeRO checkpoints are tied to the world size that wrote them (DeepSpeed #2898): `to_universal`
turns one into DeepSpeed's universal checkpoint (Lian et al. 2024, "Universal Checkpointing",
arXiv:2406.18820), a copy written beside it with every parameter's fp32 weights and Adam
moments whole, which an engine built with `deepspeed_config(..., load_universal=True)` loads
on any world size.

Reading a checkpoint runs no code from it wherever we read it ourselves (`consolidated_state_dict`
for export, evaluation and translation; the ZeRO-3 universal repair): torch's weights-only
unpickler, with the few classes DeepSpeed's files hold allowed (`checkpoint_globals`), also for
the torch.load calls inside DeepSpeed's consolidation. `Engine.load` is DeepSpeed's
`load_checkpoint`, which unpickles in full: a run directory resumed from is trusted like code.

The room, the only part of the project that imports deepspeed (tests/launch/test_universal.py):
`engine.py` (the facade), `config.py` (the JSON), `safe_load.py`, `universal.py`, `estimate.py`.
"""
