"""The training loop, one room: `python -m launch.train CONFIG [key=value ...]` for causal_lm,
mlm and translation.

The same command runs alone, under `torchrun`, under the `deepspeed` launcher and under `srun`
(see `launch.distributed`). Read it top-down, in the order a batch meets it:

    cli.py      the command line: the dry run, or a training job
    loop.py     train -> fit: the job around the loop, and the loop
    step.py     train_step: one optimizer step over the micro batches, guarded
    evaluation.py  evaluate: the valid split's figures
    setup.py    config, data, model config, process group, engine, run directory and tracker
    resume.py   which checkpoint to resume, restoring it; RNG state, metrics truncation
    changes.py  what a resumed job changes from its checkpoint's config: applied, or refused
    guard.py    guarded steps: which step is skipped and why; it returns a verdict, the loop saves
    harness.py  lm-evaluation-harness tasks on the model in training, every lm_eval.every steps
    state.py    what the loop carries: Run (the resolved config, engine, data), Progress, Data

DeepSpeed is reached only through `launch.deepspeed.engine.Engine`; checkpoints are saved through
`launch.checkpoint.save`.
"""
