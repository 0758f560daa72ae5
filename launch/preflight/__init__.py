"""`python -m launch.train CONFIG [key=value ...] --dry-run`: what a run would be, and every reason it would fail, in seconds.

For a login node before `sbatch`, and for the batch scripts (`slurm/common.sh`, once, before
any rank starts): no process group, no DeepSpeed engine, no GPU, nothing written. The config
is resolved the trainer's way; the model is built on the meta device, which costs no memory
and gives the exact parameter count. The report: world size and global batch as they would
be, tokens per step, steps per epoch and the epochs `max_steps` covers, parameters, FLOPs per
step and per token (`model.flops`), memory per GPU (DeepSpeed's estimator for the model
states, `launch.deepspeed.estimate.estimate_model_state_memory`, plus our estimate of the micro batch's
activations), and the dataset checked against its manifest, its tokenizer, the model and any
warm-start source. Every problem found is listed at once, each naming its key; the exit
status is 2 if there is any, else 0. Warnings (no evaluation, fp16 needing a GPU, ...) are
listed too but do not fail the run.

A warm-start source (`init.encoder`, `init.decoder`) is an exported directory; before it
exists, the training config that will produce it (a YAML) stands in: its model is checked
against the stack it would fill, with a warning that the run itself needs the export. The main
job's `--dry-run` (`launch.main.preflight`) checks a chain whose dataset is not prepared yet
against what its prepare config will make (`PlannedData`).

    python -m launch.preflight [--world-size N] [--ranks-per-node N] [--json] CONFIG.yaml [key.sub=value ...]

is the same report (`--dry-run` is not needed there). The world size is read from the
environment as `launch.distributed.read_env` reads it (torchrun, the deepspeed launcher,
srun), or given with `--world-size` to plan a job from a login node; `--ranks-per-node`
(default: the environment's, else 1) only sets how ranks group into nodes for DeepSpeed's
per-node CPU figures.

The room: `checks.py` (the dry run and its checks), `data.py` (the dataset), `figures.py` (batch,
FLOPs, memory), `report.py` (what it found and prints).
"""
