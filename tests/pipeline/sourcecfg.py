"""A corpus source's config as prepare reads it (`source.*` of PrepareConfig), from keyword
overrides: `source_cfg(paths="[a.txt]", format="text")`."""

from common.configure import load_config
from pipeline.prepare.config import PrepareConfig


def source_cfg(**overrides):
    return load_config(
        PrepareConfig, None, [f"source.{k}={v}" for k, v in overrides.items()]
    ).source
