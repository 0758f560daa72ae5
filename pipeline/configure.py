"""Typed configuration for every entry point: one YAML file plus `key.sub=value` overrides.

The dataclasses of each package are the schema (OmegaConf structured configs); a YAML file
under `configs/` is an instance; command-line overrides come last. Precedence is
command line > YAML > dataclass defaults. An unknown key, a wrong type or a missing
required value fails with one line naming the key and where it came from.

This module also holds `UserError` and `run_main`, the one place where a bad input becomes
a one-line message and a non-zero exit instead of a traceback. It lives in `pipeline/`
because `pipeline` sits at the bottom of the import graph (`launch` imports it, never the
reverse) and imports nothing from the other packages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


class UserError(Exception):
    """A problem with the user's input (config, files, data): reported in one line, exit 2."""


def _describe(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if "not in" in msg and "Key" in msg:
        msg = "unknown key"
    return f"{key}: {msg}" if key else msg


def load_config(schema: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Build a `schema` instance from defaults, then the YAML at `path`, then `overrides`."""
    base = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            from_file = OmegaConf.load(path)
        except Exception as err:  # yaml.YAMLError and friends: keep only the first line
            raise UserError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from err
        try:
            base = OmegaConf.merge(base, from_file)
        except OmegaConfBaseException as err:
            raise UserError(f"{path}: {_describe(err)}") from err
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key.sub=value")
        try:
            base = OmegaConf.merge(base, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            raise UserError(f"command line {item!r}: {_describe(err)}") from err
    try:
        return OmegaConf.to_object(base)
    except OmegaConfBaseException as err:
        raise UserError(f"{path or 'config'}: {_describe(err)}") from err


def config_from_dict(schema: type[T], values: dict, source: str = "config") -> T:
    """A `schema` instance from a plain dict (a saved config), validated like a YAML file."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as err:
        raise UserError(f"{source}: {_describe(err)}") from err


def config_to_dict(cfg: Any) -> dict:
    """A plain, JSON-serialisable dict of a (resolved) config dataclass."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML beside a run's outputs."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def parse_cli(schema: type[T], argv: Sequence[str] | None = None, *, usage: str) -> T:
    """`CONFIG [key=value ...]` from the command line into a `schema` instance."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        raise SystemExit(0 if argv else 2)
    return load_config(schema, argv[0], argv[1:])


def run_main(main: Callable[[], Any]) -> None:
    """Run an entry point; a `UserError` becomes `error: ...` on stderr and exit status 2."""
    try:
        code = main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(code or 0)
