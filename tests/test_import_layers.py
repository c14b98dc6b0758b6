"""The package layering (docs/design.md, the map): every kvconnect module imports only from
floors below its own, so an arrow upward or a circle fails here.

A unit is a package under kvconnect/ (``layout``, ``restore``, ...) or a top-level module
(``engine``, ``config``, ...). Imports within a unit are its own business. No module imports
another's private (``_``) names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvconnect

ROOT = Path(kvconnect.__file__).resolve().parent

# Lowest first. A unit may import the units of the floors below its own, never one beside
# or above it.
FLOORS = (
    {"errors", "lmcache_names", "throttled_warning", "events", "engine_stats"},  # leaves
    {"config", "layout"},  # the one reader of the environment; what a KV cache looks like
    {"chunks", "metrics", "transfer"},  # keys and the stored format; counters; byte movers
    {"storage"},  # the pool and the lower tiers
    {"restore", "server"},  # restore points: what is stored, found and loaded; the node cache server and its client
    {"engine", "sizing"},  # the Python API every adapter calls (its default pool reaches the server); what a layout stores
    {"page_store"},  # pages under engine keys, over an engine
    {"integrations"},  # engine adapters and the presets of their allocations
    {"cli"},  # the kvconnect command
)
FLOOR = {unit: n for n, units in enumerate(FLOORS) for unit in units}
FACE = "kvconnect"  # the package's __init__: the public names of the core only
CORE_TOP = FLOOR["page_store"]

def _unit(name: str) -> str:
    """The unit of a dotted kvconnect module name (``kvconnect.restore.gate`` -> ``restore``)."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] == "__init__":
        return FACE
    return parts[1]


def _imports(module: Path) -> set[str]:
    """Every kvconnect module ``module`` imports, at runtime or for type checking."""
    tree = ast.parse(module.read_text())
    package = list(module.relative_to(ROOT.parent).with_suffix("").parts)
    package = package[:-1]  # a module's package; an __init__'s is its own folder
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if node.module is None or name == "kvconnect":  # ``from . import x``: x is the module
                found.update(f"{name}.{a.name}" for a in node.names)
            else:
                found.add(name)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n == "kvconnect" or n.startswith("kvconnect.")}


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _known_unit(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and ((ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").exists())


def test_every_unit_has_a_floor():
    units = {_unit(".".join(p.relative_to(ROOT.parent).with_suffix("").parts)) for p in _modules()}
    assert units - {FACE} <= set(FLOOR), f"units without a floor in FLOORS: {sorted(units - {FACE} - set(FLOOR))}"


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_from_floors_below(module: Path):
    me = _unit(".".join(module.relative_to(ROOT.parent).with_suffix("").parts))
    wrong = []
    for name in sorted(_imports(module)):
        if not _known_unit(name):
            continue  # a compiled extension (kvconnect._cpu_kernels) or the package itself
        other = _unit(name)
        if other == me:
            continue
        if me == FACE:
            if FLOOR[other] > CORE_TOP:
                wrong.append(f"{name} (the package face exports the core only)")
        elif FLOOR[other] >= FLOOR[me]:
            wrong.append(f"{name} ({other}, floor {FLOOR[other]}, is not below {me}, floor {FLOOR[me]})")
    assert not wrong, f"{module.relative_to(ROOT.parent)} imports upward or sideways: {wrong}"


def _private_imports(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {f"{node.module}.{a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for a in node.names if a.name.startswith("_") and not _is_extension(node, a.name)}


def _is_extension(node: ast.ImportFrom, name: str) -> bool:
    """``from .. import _cpu_kernels`` and the like: a compiled module of the package (no Python
    source in the tree, built or not), private by its build's choice."""
    from_package = node.module in (None, "kvconnect")
    return from_package and not (ROOT / f"{name}.py").exists() and not (ROOT / name).is_dir()


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_is_imported_from_another_module(module: Path):
    private = _private_imports(module)
    assert not private, f"{module.relative_to(ROOT.parent)} imports private names: {sorted(private)}"
