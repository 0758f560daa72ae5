"""One line for a weights file that would not load (a truncated safetensors file, a torch pickle
the weights-only unpickler refuses), for every reader of weights: `launch.deepspeed.safe_load`
for checkpoints, `launch.model_dir.load_model_dir` and `model.hf_dir.load_hf_dir` for exported
directories. torch's own refusal is 48 lines that end by suggesting `weights_only=False`."""

from __future__ import annotations

import re


def load_failure(err: BaseException) -> str:
    """What the weights-only unpickler refused, or the error's type and first line."""
    message = str(err)
    refused = re.search(r"GLOBAL (\S+) was not an allowed global", message)
    if refused:
        return f"it holds {refused.group(1)}, which unpickling would call: refused"
    if "WeightsUnpickler error:" in message:
        detail = [
            line.strip()
            for line in message.split("WeightsUnpickler error:", 1)[1].splitlines()
            if line.strip()
        ]
        return f"a weights-only load refused it: {detail[0] if detail else 'unknown'}"
    return f"{type(err).__name__}: {(message.strip().splitlines() or [''])[0]}"
