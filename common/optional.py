"""The optional packages (`pip install -e '.[hf]'`: transformers, lm-eval): imported where a
command needs them, and their absence one line that names the key that asked and the extra that
brings them, instead of an ImportError's traceback."""

from __future__ import annotations

import importlib
from types import ModuleType

from common.configure import UserError

EXTRA = {"transformers": "hf", "lm_eval": "hf"}


def need(module: str, asked_by: str) -> ModuleType:
    """`module` imported; UserError naming `asked_by` (a key and its value) and the extra if it
    is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRA.get(module, "hf")
        raise UserError(
            f"{asked_by} needs the {module} package, which the base install leaves out: "
            f"pip install -e '.[{extra}]'"
        ) from None
