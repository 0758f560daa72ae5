"""The import graph: no cycle, and no import from a higher layer into a lower one.

Layers, bottom up: `common/` (what every layer uses: the config loader and its one-line errors,
file hashing, the directory lock) -> `pipeline/` (data) and `model/` (plain PyTorch), which
never import each other -> `launch/`. Every import counts, at module level or inside a
function (a cycle hidden in a function still runs), except those under `if TYPE_CHECKING:`,
which never run.

Inside `pipeline/`, two rooms: `pipeline.prepare` (writes a dataset) and `pipeline.load` (streams
it into batches) never import each other; they meet at the modules directly under `pipeline/`
(`format`, `tokenizer`, `remote`, `validate`), which import neither room.

No library module imports another module's private name (`from pipeline.load.epoch import
_x`): what other modules use is public.

In tests/, no file imports a test module (`test_*`) or conftest (pytest loads it as a plugin; a
module import would be a second copy): what test files share is in conftest's fixtures and in
helper modules that are not test files (tests/repo.py, tests/trainruns.py, ...).

`launch.checkpoint` (the checkpoint's record, its save and restore) never imports `launch.train`.
"""

import ast
from pathlib import Path

from importgraph import runtime_nodes

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "pipeline", "model", "launch")
# What each package may import of the others.
ALLOWED = {
    "common": set(),
    "pipeline": {"common"},
    "model": {"common"},
    "launch": {"common", "pipeline", "model"},
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the project modules it imports}, for every module of PACKAGES under `root`."""
    files = {
        module_name(path, root): path
        for package in PACKAGES
        for path in (root / package).rglob("*.py")
    }
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parents = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parents + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {target for target in targets if target in files and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if target.split(".")[0] != name.split(".")[0]
        and target.split(".")[0] not in ALLOWED[name.split(".")[0]]
    ]


ROOMS = ("pipeline.prepare", "pipeline.load")


def _room(module: str) -> str | None:
    return next((room for room in ROOMS if module == room or module.startswith(room + ".")), None)


def room_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one data room into the other, or from a shared pipeline module into a room."""
    found = []
    for name, targets in sorted(graph.items()):
        if not name.startswith("pipeline.") or name in ROOMS:
            continue
        for target in sorted(targets):
            if _room(target) is not None and _room(target) != _room(name):
                found.append(f"{name} imports {target}")
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_layer_imports_a_higher_one():
    assert upward_imports(import_graph()) == []


def test_the_checkpoint_package_never_imports_the_trainer():
    """launch/checkpoint/ owns the record and its save and restore; the trainer builds the record
    (`launch.train.state.checkpoint_state`) and applies what is restored, never the reverse."""
    graph = import_graph()
    found = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if name == "launch.checkpoint" or name.startswith("launch.checkpoint.")
        for target in sorted(targets)
        if target == "launch.train" or target.startswith("launch.train.")
    ]
    assert not found, found


def test_the_data_rooms_meet_only_at_the_shared_modules():
    assert room_crossings(import_graph()) == []


def test_the_checks_catch_a_cycle_hidden_in_a_function_and_an_upward_import(tmp_path):
    """The checker itself can fail: a cycle through a function-level import, and model/ importing
    launch/; an import under TYPE_CHECKING is neither."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "a.py").write_text("from pipeline.b import x\n")
    (tmp_path / "pipeline" / "b.py").write_text("def x():\n    from pipeline import a\n")
    (tmp_path / "model" / "m.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from model import n\nimport launch.l\n"
    )
    (tmp_path / "model" / "n.py").write_text("from model import m\n")
    (tmp_path / "launch" / "l.py").write_text("")
    for room in ROOMS:
        (tmp_path / room.replace(".", "/")).mkdir()
        (tmp_path / room.replace(".", "/") / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "prepare" / "p.py").write_text("x = 1\n")
    (tmp_path / "pipeline" / "load" / "q.py").write_text(
        "def f():\n    from pipeline.prepare import p\n"
    )
    (tmp_path / "pipeline" / "format.py").write_text("import pipeline.load.q\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["pipeline.a", "pipeline.b"]]
    assert upward_imports(graph) == ["model.m imports launch.l"]
    assert room_crossings(graph) == [
        "pipeline.format imports pipeline.load.q",
        "pipeline.load.q imports pipeline.prepare",
        "pipeline.load.q imports pipeline.prepare.p",
    ]


def test_only_the_ray_runner_imports_ray():
    """Ray is the prepare side's (pipeline/prepare/ray_runner.py runs the tasks); training, the
    loader and the model never load it."""
    importers = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                if any(name.split(".")[0] == "ray" for name in names):
                    importers.add(str(path.relative_to(ROOT)))
    assert importers == {"pipeline/prepare/ray_runner.py"}, sorted(importers)


def private_imports(root: Path = ROOT) -> list[str]:
    """Every `from PROJECT_MODULE import _name` in the library under `root`, at any depth:
    "FILE:LINE imports MODULE._name" (dunder names, `__version__` and the like, are public)."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not (isinstance(node, ast.ImportFrom) and node.module):
                    continue
                if node.level or node.module.split(".")[0] in PACKAGES:
                    found.extend(
                        f"{path.relative_to(root).as_posix()}:{node.lineno} imports "
                        f"{node.module}.{alias.name}"
                        for alias in node.names
                        if alias.name.startswith("_") and not alias.name.startswith("__")
                    )
    return found


def test_no_module_imports_another_modules_private_name():
    assert private_imports() == []


def test_the_private_import_check_catches_one_at_any_depth(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "pipeline" / "a.py").write_text(
        "from pipeline.b import public, _hidden\nfrom numpy import _private\n"
        "def f():\n    from common.c import _inner\n    from model import __version__\n"
    )
    assert private_imports(tmp_path) == [
        "pipeline/a.py:1 imports pipeline.b._hidden",
        "pipeline/a.py:4 imports common.c._inner",
    ]


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import, at any depth, of a module named test_* or conftest (by its own name or
    through its package) by a file under `root`: "FILE:LINE imports MODULE"."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                # `from test_x import y` names test_x; `from tests.launch import test_x`, test_x
                names = (
                    [base]
                    if _names_a_test_module(base)
                    else [f"{base}.{alias.name}".lstrip(".") for alias in node.names]
                )
            else:
                continue
            found.extend(
                f"{path.relative_to(root).as_posix()}:{node.lineno} imports {name}"
                for name in names
                if _names_a_test_module(name)
            )
    return found


def _names_a_test_module(name: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in name.split("."))


def test_no_test_module_imports_another_or_conftest():
    assert imports_of_test_modules(ROOT / "tests") == []


def test_the_check_catches_a_test_module_imported_at_any_depth(tmp_path):
    """At module level or in a function, `import` or `from ... import`, by its own name or through
    its package; a helper module, and a name that only contains test_, are not test modules."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "test_a.py").write_text(
        "import pytest_timeout\nfrom trainruns import TINY\nimport test_b\n"
        "def test_x():\n    from test_c import helper\n"
    )
    (tmp_path / "test_d.py").write_text(
        "from tests.launch.test_a import x\nfrom tests.launch import test_e, trainruns\n"
        "from latest_results import y\n"
    )
    (tmp_path / "conftest.py").write_text("def f():\n    import test_f\n")
    (tmp_path / "trainruns.py").write_text(
        "from shardtools import make_dataset\nfrom conftest import ROOT\nimport my_conftest_notes\n"
    )
    assert imports_of_test_modules(tmp_path) == [
        "conftest.py:2 imports test_f",
        "launch/test_a.py:3 imports test_b",
        "launch/test_a.py:5 imports test_c",
        "test_d.py:1 imports tests.launch.test_a",
        "test_d.py:2 imports tests.launch.test_e",
        "trainruns.py:2 imports conftest",
    ]
