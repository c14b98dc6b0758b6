"""Every KV-cache spec class an installed engine defines, found in its source (no import needed).

A spec class is ``KVCacheSpec`` or a class whose base names one (followed to a fixpoint over the
whole package): specs defined outside ``kv_cache_interface`` (a model's own, a platform's) are
found too, and so is a module that cannot be imported on this machine.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def spec_classes(*packages: str) -> dict[str, str]:
    """{class name: the file that defines it} of every spec class in the packages' sources."""
    bases: dict[str, tuple[set, str]] = {}
    for package in packages:
        root = package_dir(package)
        for path in root.rglob("*.py"):
            text = path.read_text(encoding="utf-8", errors="replace")
            if "Spec" not in text:
                continue
            for node in ast.walk(ast.parse(text)):  # real class statements, not examples in docstrings
                if isinstance(node, ast.ClassDef):
                    names = {ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases}
                    known, _ = bases.setdefault(node.name, (set(), str(path.relative_to(root.parent))))
                    known |= names
    found = {"KVCacheSpec"}  # the root, defined with no bases
    while True:
        more = {name for name, (names, _) in bases.items() if names & found} - found
        if not more:
            break
        found |= more
    return {name: bases[name][1] for name in sorted(found)}
