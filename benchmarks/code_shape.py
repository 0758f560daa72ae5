"""The shape of the library code at one or more revisions: the files over the size limit, the
largest functions, the signatures that take the whole training `Run`, and the import ties between
packages that should not know each other.

    python benchmarks/code_shape.py [REV ...]     (no REV: this checkout, uncommitted changes in)

Counts the modules of common/, pipeline/, model/ and launch/ (tests and benchmarks aside): lines
per file (the limit: 450), lines per function or method (decorators to the last line), parameters
annotated `Run`, and every import at module level or inside a function (not under
`if TYPE_CHECKING:`) from launch.checkpoint into launch.train and between launch.config and
launch.lm_eval. A revision is read with `git archive`, nothing checked out.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from importgraph import runtime_nodes  # noqa: E402

PACKAGES = ("common", "pipeline", "model", "launch")
FILE_LIMIT = 450
# (importer prefix, imported prefix): ties that should not exist
TIES = (
    ("launch.checkpoint", "launch.train"),
    ("launch.config", "launch.lm_eval"),
    ("launch.lm_eval", "launch.config"),
)


def sources(rev: str | None) -> dict[str, str]:
    """{path: text} of the library's .py files at `rev` (None: the working tree)."""
    if rev is None:
        return {
            str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
            for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))
        }
    archive = subprocess.run(
        ["git", "archive", rev, *PACKAGES], cwd=ROOT, capture_output=True, check=True
    ).stdout
    out = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                out[member.name] = tar.extractfile(member).read().decode("utf-8")
    return out


def module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def shape(files: dict[str, str]) -> dict:
    functions, run_params, ties = [], [], []
    for path, text in files.items():
        tree = ast.parse(text)
        module = module_of(path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                functions.append((node.end_lineno - start + 1, f"{path}:{node.name}"))
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(
                    a.annotation is not None and ast.unparse(a.annotation) == "Run" for a in args
                ):
                    run_params.append(f"{path}:{node.name}")
        for node in runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for importer, imported in TIES:
                if module == importer or module.startswith(importer + "."):
                    hit = [t for t in targets if t == imported or t.startswith(imported + ".")]
                    if hit:
                        ties.append(f"{module} imports {hit[0]} (line {node.lineno})")
    sizes = sorted(((text.count("\n"), path) for path, text in files.items()), reverse=True)
    return {
        "files": len(files),
        "over_limit": [(n, p) for n, p in sizes if n > FILE_LIMIT],
        "largest_functions": sorted(functions, reverse=True)[:8],
        "run_params": sorted(run_params),
        "ties": sorted(set(ties)),
    }


def report(label: str, found: dict) -> None:
    print(f"== {label}: {found['files']} library files")
    print(f"files over {FILE_LIMIT} lines: {len(found['over_limit'])}")
    for n, path in found["over_limit"]:
        print(f"  {n:5d}  {path}")
    print("largest functions:")
    for n, name in found["largest_functions"]:
        print(f"  {n:5d}  {name}")
    print(f"signatures taking Run: {len(found['run_params'])}")
    print(f"ties ({', '.join(f'{a} -> {b}' for a, b in TIES)}): {len(found['ties'])}")
    for tie in found["ties"]:
        print(f"  {tie}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", help="git revisions; none: this checkout")
    args = parser.parse_args()
    for rev in args.revs or [None]:
        report(rev or "working tree", shape(sources(rev)))


if __name__ == "__main__":
    main()
