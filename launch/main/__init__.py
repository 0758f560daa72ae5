"""`python -m launch.main CONFIG.yaml [key.sub=value ...]`: the whole chain, stage by stage, with a summary.

prepare (Ray) -> pretrain GPT and BERT (torchrun, DeepSpeed ZeRO) -> export -> fine-tune a
translation model from each requested start (encoder/decoder: random, bert or gpt) for the
same number of steps -> evaluate BLEU and chrF on valid and test -> a report directory
(OUT/report: summary.md and .json with the table, loss curves as PNG), the table printed.

Each stage runs the project's own entry points as subprocesses, writes into its own
directory under `out_dir`, and is skipped when its output already exists and is complete
(the dataset must also pass `pipeline.validate`); a re-run says what it skipped. While a stage
runs, its latest progress line and the job's overall ETA (`StageClock`) are printed every
PROGRESS_EVERY_S seconds. A failed stage stops the run with its error and leaves earlier
stages' outputs as they were. SIGTERM, SIGINT or SIGHUP to the main job stops the stage it runs
too (a training stage checkpoints), and a re-run continues from there.
`configs/transfer.yaml` is the transfer experiment (all four starts; Rothe et al. 2020);
`configs/transfer_gpu.yaml` the same at GPT-2 small / BERT-base size on 8 GPUs.

`--dry-run` checks the whole chain and starts nothing (`launch.main.preflight`): every stage's
config resolved as the stage would resolve it, each training run's preflight, and the
pretrained models' shapes against the translation model they will warm-start; exit 2 if any
problem. Exit status otherwise: 2 for a bad input found before a stage ran (a config, a key),
1 for a stage that failed, 128 + N for signal N.

The room: `job.py` (main -> main_job -> the stages, each a subprocess; signals), `plan.py` (the
stages and the overrides each is given, the overall ETA; what the dry run reads too),
`preflight.py` (`--dry-run`), `summary.py` (the results table and the report directory).
"""
