"""Configuration of the lm-eval command (`python -m launch.lm_eval`), beside the code it drives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from omegaconf import MISSING

from launch.tracking import WandbConfig


@dataclass
class LmEvalConfig:
    """A GPT's scores on lm-evaluation-harness tasks built from held-out text
    (`python -m launch.lm_eval checkpoint=DIR`)."""

    checkpoint: str = MISSING  # an exported GPT directory (launch.export, format=ours or format=hf)
    # cloze | choice (docs/design.md#scoring-with-lm-evaluation-harness)
    tasks: List[str] = field(default_factory=lambda: ["cloze", "choice"])
    # the prepared dataset the tasks are built from; "" = the one the model was trained on
    data_dir: str = ""
    split: str = "valid"  # the held-out split read: valid | test
    limit: int = 0  # the first N docs of each task; 0 = all
    seed: int = 1234  # draws the choice task's distractors and their order
    # ours: our model through launch.lm_eval's OurLM; hf: lm-eval's HFLM over a Hugging Face export;
    # auto: hf where the directory is a Hugging Face one (its config.json has no "model" section)
    format: str = "auto"
    out: str = ""  # the results JSON written; "" = CHECKPOINT/lm_eval-SPLIT.json
    micro_batch_size: int = 16  # requests per forward
    device: str = ""  # torch device; "" = cuda if available, else cpu
    bootstrap_iters: int = 0  # lm-eval's bootstrap resamples for standard errors; 0 = none
    # W&B run of the scores (mode disabled: none)
    wandb: WandbConfig = field(default_factory=WandbConfig)
