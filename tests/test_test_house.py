"""The test house's rules, read from the test sources with ``ast`` (nothing is imported).

- a module never imports a ``test_*`` module: shared helpers live in ``tests/support`` (shared by
  suites) or in a suite's own non-test helper module beside its tests;
- ``tests/support`` imports no suite's modules (only the standard library, third-party
  packages, kvconnect, the examples and itself);
- no module takes a private name (``_name``) from a test helper module, by import or by
  attribute: what two modules share is public.
"""

from __future__ import annotations

import ast
from pathlib import Path


TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _helper_modules() -> set[str]:
    """Names a test file can import a helper of the tree by: every module stem under tests/, and ``support``."""
    names = {p.stem for p in _sources() if p.stem not in ("__init__", "conftest")}
    return names | {"support"}


def _imports(tree: ast.AST):
    """(line, module, names, bound-as) for every import; ``names`` are (name, bound-as) pairs, empty for ``import x``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, (), alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, tuple((a.name, a.asname or a.name) for a in node.names), None


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[-1].startswith("test_")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imports_of_test_modules(source: str) -> list[str]:
    """Imports of a ``test_*`` module, as "line: module [names]"."""
    found = []
    for line, module, names, _ in _imports(ast.parse(source)):
        if _is_test_module(module) or any(_is_test_module(f"{module}.{n}") for n, _ in names):
            found.append(f"{line}: {module} {[n for n, _ in names]}")
    return found


def private_uses(source: str, helpers: set[str]) -> list[str]:
    """Private names taken from a test helper module: ``from h import _x`` and ``h._x``."""
    tree = ast.parse(source)
    bound = set()  # the local names of imported helper modules
    found = []
    for line, module, names, as_name in _imports(tree):
        if module.split(".")[0] not in helpers:
            continue
        if as_name is not None:
            bound.add(as_name)
        for name, local in names:
            if _private(name):
                found.append(f"{line}: from {module} import {name}")
            elif name in helpers:  # from support import zoo
                bound.add(local)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and _private(node.attr):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def _rel(path: Path) -> str:
    return str(path.relative_to(TESTS.parent))


def test_no_module_imports_a_test_module():
    found = [f"{_rel(p)}:{f}" for p in _sources() for f in imports_of_test_modules(p.read_text())]
    assert not found, "test modules imported as helpers (move the helper to tests/support or a suite helper):\n" + "\n".join(found)


def test_support_imports_no_suite_module():
    suite_modules = {p.stem for p in _sources() if SUPPORT not in p.parents and p.stem not in ("__init__", "conftest")}
    found = []
    for path in sorted(SUPPORT.glob("*.py")):
        for line, module, _, _ in _imports(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] in suite_modules | {"conftest"}:
                found.append(f"{_rel(path)}:{line}: {module}")
    assert SUPPORT.joinpath("__init__.py").is_file()
    assert not found, "tests/support must not depend on a suite:\n" + "\n".join(found)


def test_no_private_name_crosses_test_helper_modules():
    helpers = _helper_modules()
    found = [f"{_rel(p)}:{f}" for p in _sources() for f in private_uses(p.read_text(), helpers)]
    assert not found, "private names used across test helper modules:\n" + "\n".join(found)


def test_the_checks_catch_what_they_name():
    """Each check reports a snippet that breaks its rule and passes the public form (they are not vacuous)."""
    helpers = _helper_modules()
    assert {"support", "zoo", "harness", "server_rig"} <= helpers
    assert imports_of_test_modules("from test_disk import make_item\n") == ["1: test_disk ['make_item']"]
    assert imports_of_test_modules("import test_host_pools as h\n") and imports_of_test_modules("from server import test_server\n")
    assert imports_of_test_modules("from chunk_items import make_item\nimport zoo\n") == []
    assert private_uses("from harness import _module\n", helpers) == ["1: from harness import _module"]
    assert private_uses("import harness\nharness._module(object)\n", helpers) == ["2: harness._module"]
    assert private_uses("import reference as ref\nref._x\n", helpers) == ["2: ref._x"]
    assert private_uses("from support import zoo\nzoo._hidden\n", helpers) == ["2: zoo._hidden"]
    assert private_uses("from support.npu_stand_ins import bare_module\nimport harness\nharness.setup()\n", helpers) == []
    assert private_uses("import torch\ntorch._C\n", helpers) == []  # not a test helper
