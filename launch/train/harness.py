"""lm-evaluation-harness during pretraining: every `lm_eval.every` steps, the local tasks
(`launch.lm_eval.tasks`) on the model in training, as lm_eval/TASK/METRIC at that step.

Every rank runs the same requests in the same batches, the same forwards: under ZeRO-3 each
forward gathers the parameters from every rank (transformers#20130), and elsewhere the other
ranks would wait for rank 0 at the next collective anyway. Only rank 0's figures are logged.
The documents are read from the held-out split once per process; `lm_eval.limit` keeps it cheap.
"""

from __future__ import annotations

import functools

import torch

from launch.train.state import Run
from pipeline.format import dataset_tokenizer, read_manifest
from pipeline.tokenizer import Tokenizer


def due(run: Run) -> bool:
    every = run.cfg.lm_eval.every
    return bool(every) and run.step % every == 0


@torch.compiler.set_stance("force_eager")  # as `loop.evaluate`: no eval graphs or their recompiles
def lm_eval_metrics(run: Run) -> dict[str, float]:
    from launch.lm_eval.ours import OurLM
    from launch.lm_eval.score import flat_metrics, score

    cfg = run.cfg
    tokenizer = _tokenizer(cfg.data.data_dir, run.data.tokenizer_sha256)
    # where the engine put it
    lm = OurLM(run.engine.module, tokenizer, batch_size=cfg.data.micro_batch_size)
    results = score(
        lm,
        list(cfg.lm_eval.tasks),
        _texts(cfg.data.data_dir, cfg.lm_eval.split, run.data.tokenizer_sha256),
        limit=cfg.lm_eval.limit,
        seed=cfg.seed,
    )
    return flat_metrics(results)


@functools.lru_cache(maxsize=2)
def _tokenizer(data_dir: str, tokenizer_sha256: str) -> Tokenizer:
    """The dataset's tokenizer (its sha256 in the key: the one the run checked at start)."""
    return dataset_tokenizer(data_dir, read_manifest(data_dir))


@functools.lru_cache(maxsize=2)
def _texts(data_dir: str, split: str, tokenizer_sha256: str) -> list[str]:
    from launch.lm_eval.tasks import held_out_texts

    return held_out_texts(data_dir, split, tokenizer_sha256)
