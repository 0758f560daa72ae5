"""The imports that run: a module's AST without what sits under `if TYPE_CHECKING:` (never run),
for the import-graph checks of tests/test_layers.py and benchmarks/code_shape.py."""

import ast


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING"
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)
