"""The module layering: lower modules never import higher ones (no import cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvconnect

ROOT = Path(kvconnect.__file__).resolve().parent


def _imports(module: Path) -> set[str]:
    """Every kvconnect module ``module`` imports, at runtime or for type checking."""
    tree = ast.parse(module.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against kvconnect/<package>
                base = module.parent.relative_to(ROOT.parent).parts[: len(module.parent.relative_to(ROOT.parent).parts) - node.level + 1]
                name = ".".join(base + ((node.module,) if node.module else ()))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n.startswith("kvconnect")}


def test_metrics_depends_on_nothing_above_it():
    imported = set().union(*(_imports(path) for path in ROOT.glob("metrics/*.py")))
    assert not {n for n in imported if n.startswith(("kvconnect.engine", "kvconnect.storage", "kvconnect.integrations",
                                                      "kvconnect.server", "kvconnect.cli"))}, imported

