"""Typed configuration for every entry point: one YAML file plus `key.sub=value` overrides.

The dataclasses of each package are the schema (OmegaConf structured configs); a YAML file
under `configs/` is an instance; command-line overrides come last. Precedence is
command line > YAML > dataclass defaults. An unknown key, a wrong type, a missing
required value (a field defaulting to OmegaConf's `MISSING`), a value that is not valid YAML
(a `!!python/...` tag, which the YAML loader refuses in a file and an override alike; a
duplicate key, named with its line), a file holding a list rather than keys, a list where the
schema has a section (or the reverse), or a list item set by its index on the command line
fails with one line naming the key and where it came from. So does a config file that sets no
key at all (empty, only comments, `{}`, `null`, or only empty sections: it would run the built-in
defaults, a 23 M-parameter model for training, without a word); a tool run with no file and its
keys on the command line is not such a file.

Every entry point has the same command-line grammar (`parse_cli`):

    python -m ENTRY CONFIG.yaml [key.sub=value ...]      training, prepare, the main job
    python -m ENTRY [CONFIG.yaml] [key.sub=value ...]    the tools (evaluate, translate,
                                                         export, ...)

and `--help` prints the usage with every key of the schema, its default and its description:
the comment written with the field (`field_comments`, which the configuration reference,
docs/configuration.md, is generated from too by `launch.config_reference`).

This module also holds `UserError` and `run_main`, the one place where a bad input becomes
a one-line message and a non-zero exit instead of a traceback. It lives in `pipeline/`
because `pipeline` sits at the bottom of the import graph (`launch` imports it, never the
reverse) and imports nothing from the other packages.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import os
import re
import shutil
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.atomic import atomic_write

T = TypeVar("T")


class UserError(Exception):
    """A problem with the user's input (config, files, data): reported in one line, exit 2."""


def _describe(err: OmegaConfBaseException, schema: type | None = None) -> str:
    """One line for OmegaConf's error; an unknown key that `schema.RENAMED` lists ({old: new}, a
    key a release renamed) names its new spelling, one that `schema.RETIRED` lists ({key: why})
    says why it is gone."""
    key = getattr(err, "full_key", None)
    msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if "not in" in msg and "Key" in msg:
        msg = "unknown key"
        renamed = getattr(schema, "RENAMED", {}).get(key)
        retired = getattr(schema, "RETIRED", {}).get(key)
        if renamed:
            msg += f" (renamed: {renamed})"
        elif retired:
            msg = f"no longer a key: {retired}"
    return f"{key}: {msg}" if key else msg


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _yaml_problem(err: Exception, where: bool = True) -> str:
    """One line for a YAML error: its problem (a duplicate key names the key), and with `where` the
    line and column of the file it is at, and the construct it interrupted; yaml's own message
    spreads these over several lines, the first of which alone names neither."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if not problem:
        return _first_line(err)
    if not where or mark is None:
        return problem
    place = f"line {mark.line + 1}, column {mark.column + 1}"
    context, at = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and at is not None:
        place += f"; {context} at line {at.line + 1}"
    return f"{problem} ({place})"


def _mismatch(base: Any, other: Any, prefix: str = "") -> str:
    """The first dotted key where `other` has a list and `base` a section (or the reverse), and
    what belongs there: what OmegaConf's merge refuses as "incompatible container types" without
    naming it."""
    if not (isinstance(base, DictConfig) and isinstance(other, DictConfig)):
        return ""
    for key in other.keys():
        if key not in base:
            continue
        mine, theirs = base._get_node(key), other._get_node(key)
        if isinstance(mine, ListConfig) and isinstance(theirs, DictConfig):
            return f"{prefix}{key}: a list ([...]) belongs here, not keys and values"
        if isinstance(mine, DictConfig) and isinstance(theirs, ListConfig):
            return f"{prefix}{key}: keys and values belong here (a section), not a list"
        if found := _mismatch(mine, theirs, f"{prefix}{key}."):
            return found
    return ""


def _merge_refusal(base: Any, other: Any, err: Exception, schema: type | None) -> str:
    if found := _mismatch(base, other):
        return found
    if isinstance(err, OmegaConfBaseException):
        return _describe(err, schema)
    return _first_line(err)


# `${oc.env:NAME}` anywhere in a value, nested ones included, and escaped ones (`\${...}`): a
# literal is saved unescaped, to become an interpolation where the saved config is read.
_ENV_INTERPOLATION = re.compile(r"\$\{\s*oc\.env\s*:")
ENV_REFUSED = (
    "${oc.env:...} is refused: configs are stored resolved (config.yaml, checkpoints, W&B, "
    "exports' provenance.json), so the variable's value (a token, say) would leave the machine "
    "inside a model; write the value (key=$VAR on the command line) and leave secrets to the "
    "variables their libraries read (WANDB_API_KEY)"
)


def _env_interpolation(values: Any, key: str = "") -> str:
    """The dotted key of the first value in `values` (plain containers) that reads the
    environment through `${oc.env:...}`, or ""."""
    if isinstance(values, dict):
        items = [(f"{key}.{name}" if key else str(name), value) for name, value in values.items()]
    elif isinstance(values, list):
        items = [(f"{key}[{i}]", value) for i, value in enumerate(values)]
    else:
        return key if _ENV_INTERPOLATION.search(str(values)) else ""
    return next((found for name, value in items if (found := _env_interpolation(value, name))), "")


def _refuse_env(values: Any, where: str) -> None:
    key = _env_interpolation(values)
    if key:
        raise UserError(f"{where}: {key}: {ENV_REFUSED}")


def _list_index(key: str) -> str:
    """The part of a dotted key up to its first list index (`sources[1].name` ->
    `sources`), or ""."""
    return key.partition("[")[0] if "[" in key else ""


def _sets_nothing(node: DictConfig) -> bool:
    """Whether a YAML file's mapping sets no value at all: it, and every section in it, is empty
    (an empty file, only comments, `{}`, `null`, `model: {}`). Merged onto the defaults such a
    file changes nothing, so what runs is the built-in defaults."""
    for key in node.keys():
        child = node._get_node(key)
        if not (isinstance(child, DictConfig) and not child._is_none() and _sets_nothing(child)):
            return False
    return True


def load_config(
    schema: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()
) -> T:
    """Build a `schema` instance from defaults, then the YAML at `path`, then `overrides`. A file
    that sets no key (`_sets_nothing`: empty, only comments, `{}`, `null`, only empty sections)
    is refused: it would run the built-in defaults without a word. No file at all (`path` None:
    a tool's keys given on the command line alone) is not."""
    base = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            from_file = OmegaConf.load(path)
        except OSError as err:  # a file that is a bare number or string: not a YAML mapping
            raise UserError(
                f"{path}: holds a single value ({_first_line(err).rpartition(' ')[2]}), not keys "
                "and values (key: value lines)"
            ) from err
        except Exception as err:  # yaml.YAMLError and friends
            raise UserError(f"{path}: not valid YAML: {_yaml_problem(err)}") from err
        if not isinstance(from_file, DictConfig):
            raise UserError(f"{path}: holds a YAML list, not keys and values (key: value lines)")
        if _sets_nothing(from_file):
            raise UserError(
                f"{path}: sets no key (empty, only comments, {{}}, null, or only empty sections); "
                "refused rather than run on the built-in defaults: write the keys to set in it "
                "(--help lists them)"
            )
        _refuse_env(OmegaConf.to_container(from_file, resolve=False), str(path))
        try:
            base = OmegaConf.merge(base, from_file)
        # a list in the file where the schema has a section, or the reverse, is either
        except (OmegaConfBaseException, TypeError, ValueError) as err:
            raise UserError(f"{path}: {_merge_refusal(base, from_file, err, schema)}") from err
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key.sub=value")
        key, _, value = item.partition("=")
        if listed := _list_index(key):
            raise UserError(
                f"command line {item!r}: {key}: a list's items are not set one by one; give the "
                f"whole list ({listed}=[...]) or set it in the YAML"
            )
        try:
            parsed = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as err:
            raise UserError(f"command line {item!r}: {_describe(err, schema)}") from err
        # the value as YAML: a tag it refuses (`!!python/name:...`), a bad `!!int`, `[1`
        except Exception as err:
            raise UserError(
                f"command line {item!r}: {key}: value {value!r} is not valid YAML: "
                f"{_yaml_problem(err, where=False)}"
            ) from err
        _refuse_env(OmegaConf.to_container(parsed, resolve=False), f"command line {item!r}")
        try:
            base = OmegaConf.merge(base, parsed)
        except (OmegaConfBaseException, TypeError, ValueError) as err:
            raise UserError(
                f"command line {item!r}: {_merge_refusal(base, parsed, err, schema)}"
            ) from err
    # Named here, all at once: OmegaConf would report only the first, in a sentence about the
    # dataclass rather than the command line.
    missing = sorted(OmegaConf.missing_keys(base))
    if missing:
        given_as = " ".join(f"{key}=..." for key in missing)
        raise UserError(f"{', '.join(missing)}: required, not given ({given_as})")
    try:
        return OmegaConf.to_object(base)
    except OmegaConfBaseException as err:
        raise UserError(f"{path or 'config'}: {_describe(err, schema)}") from err


def config_from_dict(schema: type[T], values: dict, source: str = "config") -> T:
    """A `schema` instance from a plain dict (a saved config), validated like a YAML file."""
    _refuse_env(values, source)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as err:
        raise UserError(f"{source}: {_describe(err)}") from err


def config_to_dict(cfg: Any) -> dict:
    """A plain, JSON-serialisable dict of a (resolved) config dataclass."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML beside a run's outputs, whole or not at all (a full disk
    leaves the config that was there, not a truncated one)."""
    atomic_write(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))


CONFIG_SUFFIXES = (".yaml", ".yml")
HELP_FLAGS = ("-h", "--help")


def parse_cli(
    schema: type[T], argv: Sequence[str] | None = None, *, usage: str, config_optional: bool = False
) -> T:
    """The command line into a `schema` instance: `CONFIG.yaml [key.sub=value ...]`, or with
    `config_optional` `[CONFIG.yaml] [key.sub=value ...]`, where a first argument is the file
    when it ends in .yaml/.yml and has no `=`.

    `-h`/`--help` anywhere prints `usage` and the schema's keys, exit 0. No arguments where
    some are needed (the file, or a key without a default) prints `usage` on stderr, exit 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in HELP_FLAGS for arg in argv):
        try:
            print(help_text(schema, usage), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader stopped early, which is no error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    if not argv and (not config_optional or required_keys(schema)):
        print(f"{usage}\n\n--help lists every key with its default.", file=sys.stderr)
        raise SystemExit(2)
    if config_optional:
        if argv and "=" not in argv[0] and argv[0].endswith(CONFIG_SUFFIXES):
            return load_config(schema, argv[0], argv[1:])
        return load_config(schema, None, argv)
    if "=" in argv[0]:
        raise UserError(
            f"{argv[0]!r}: the first argument is the CONFIG.yaml file; "
            "key.sub=value overrides follow it"
        )
    return load_config(schema, argv[0], argv[1:])


def strip_launcher_args(argv: Sequence[str]) -> list[str]:
    """`argv` without the `--local_rank=N` (or `--local_rank N`) the deepspeed launcher appends;
    the rank is read from the environment instead."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--local_rank":
            skip = True
        elif not arg.startswith("--local_rank="):
            out.append(arg)
    return out


def required_keys(schema: type) -> list[str]:
    """The dotted keys of `schema` that have no default (OmegaConf's MISSING)."""
    return sorted(OmegaConf.missing_keys(OmegaConf.structured(schema)))


def help_text(schema: type, usage: str, width: int | None = None) -> str:
    """`usage`, then one entry per leaf key: `key=default` and the field's comment."""
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 100)
    rows = leaf_rows(schema)
    required = "; ??? = required, no default" if required_keys(schema) else ""
    lines = [usage, "", f"Keys (command line > YAML > defaults{required}):"]
    column = min(max(len(f"{key}={show(value)}") for key, _, value, _ in rows) + 4, 36)
    for key, kind, value, text in rows:
        head = f"  {key}={show(value)}"
        body = f"{text} [{kind}]" if text else f"[{kind}]"
        indent = " " * column
        if len(head) >= column - 1:  # a long key=default gets a line of its own
            lines.append(head)
            head = ""
        lines.append(
            textwrap.fill(body, width, initial_indent=head.ljust(column), subsequent_indent=indent)
        )
    return "\n".join(lines)


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment text: the `#` lines directly above it, then its trailing comment."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    described = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        # not a field: RENAMED
        if ast.unparse(node.annotation).startswith(("ClassVar", "typing.ClassVar")):
            continue
        above, n = [], node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        described[node.target.id] = " ".join(above + trailing)
    return described


def leaf_rows(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default value, description) of every leaf field of `cls`, in field
    order; a required field's default is MISSING."""
    defaults, comments = cls(), field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            rows += leaf_rows(type(value), f"{prefix}{f.name}.")
        else:
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            rows.append((prefix + f.name, kind, value, comments.get(f.name, "")))
    return rows


def show(value: Any) -> str:
    """A default as one would write it in the YAML (MISSING is `???` there too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return repr(value)


def run_main(main: Callable[[], Any]) -> None:
    """Run an entry point; a `UserError` becomes `error: ...` on stderr and exit status 2."""
    try:
        code = main()
    except UserError as err:
        # One write, newline included: print's two would let the ranks of a job, which all say
        # the same line into one stream, splice their lines together.
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(code or 0)
