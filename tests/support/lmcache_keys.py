"""LMCache's configuration names, read as DATA from an LMCache wheel (never imported).

    python3 tests/support/lmcache_keys.py WHEEL > tests/data/lmcache_names_RELEASE.json   # a new release

Reads, with ``ast`` only:
- ``lmcache/v1/config.py``: the keys of ``_CONFIG_DEFINITIONS`` (each is a YAML key and an
  ``LMCACHE_<KEY>`` variable), ``_CONFIG_ALIASES`` and ``_DEPRECATED_CONFIGS`` (old names);
- every ``.py`` of the wheel: string constants ``LMCACHE_*`` (variables read outside the
  config module, e.g. ``LMCACHE_LOG_LEVEL``) and the keys of ``extra_config`` it reads
  (``get_extra_config_value("k")``, ``extra_config.get("k")``, ``extra_config["k"]``);
- ``lmcache/integration`` and ``lmcache/v1/lookup_client``: the keys its vLLM connectors read from
  vLLM's ``kv_connector_extra_config`` (``get_from_extra_config("k")``, ``kv_extra.get("k")``, a
  module constant handed to ``_get_extra_config_value``) and the prefixes they read a family of
  keys by (``key.startswith("lmcache.")`` in a function that reads ``kv_connector_extra_config``).

tests/test_lmcache_names.py compares each vendored list (tests/data/lmcache_names_*.json, one per
release kvconnect answers for) with this extraction when that wheel is in the CI cache
(.ci/setup.sh downloads them).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

CONFIG_MODULE = "lmcache/v1/config.py"
_VAR = re.compile(r"^LMCACHE_[A-Z0-9_]+$")


def _dict_keys(tree: ast.Module, name: str) -> list[str]:
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
            return [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    raise ValueError(f"{CONFIG_MODULE} has no dict {name}: LMCache changed how it declares its configuration")


def _extra_config_keys(tree: ast.AST) -> set[str]:
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get_extra_config_value":
                keys.add(node.args[0].value)
            elif (isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Attribute)
                  and f.value.attr == "extra_config"):
                keys.add(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "extra_config"
              and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            keys.add(node.slice.value)
    return keys


_VLLM_FILES = ("lmcache/integration/", "lmcache/v1/lookup_client/")
_VLLM_MAPPINGS = ("kv_extra", "kv_connector_extra_config")  # local names of vLLM's mapping in LMCache's code


def _constants(tree: ast.Module) -> dict[str, str]:
    return {node.targets[0].id: node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _vllm_extra_config(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(keys, prefixes) LMCache's vLLM connectors read from ``kv_connector_extra_config``."""
    constants = _constants(tree)
    keys: set[str] = set()
    prefixes: set[str] = set()

    def text(node: ast.AST):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Attribute, ast.Name)):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id
        if name == "get_from_extra_config" and node.args:
            keys.add(text(node.args[0]))
        elif (name == "get" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
              and f.value.id in _VLLM_MAPPINGS and node.args):
            keys.add(text(node.args[0]))
        elif name == "_get_extra_config_value" and len(node.args) >= 2:
            keys.add(text(node.args[1]))
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        reads = any(isinstance(n, ast.Attribute) and n.attr == "kv_connector_extra_config" for n in ast.walk(function))
        for node in ast.walk(function) if reads else ():
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
                    and node.args and text(node.args[0])):
                prefixes.add(text(node.args[0]))
    keys.discard(None)
    return keys, prefixes


def extract(wheel: Path) -> dict:
    """The names of the LMCache release in ``wheel``, as tests/data/lmcache_names_*.json hold them."""
    with zipfile.ZipFile(wheel) as z:
        config = ast.parse(z.read(CONFIG_MODULE).decode())
        variables: set[str] = set()
        extra: set[str] = set()
        vllm_keys: set[str] = set()
        vllm_prefixes: set[str] = set()
        for name in z.namelist():
            if not name.endswith(".py") or not name.startswith("lmcache/"):
                continue
            tree = ast.parse(z.read(name).decode())
            variables |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                          and _VAR.match(n.value)}
            extra |= _extra_config_keys(tree)
            if name.startswith(_VLLM_FILES):
                keys, prefixes = _vllm_extra_config(tree)
                vllm_keys |= keys
                vllm_prefixes |= prefixes
    version = re.match(r"lmcache-([^-]+)-", wheel.name)
    return {
        "release": version.group(1) if version else "",
        "wheel": wheel.name,
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "config_keys": _dict_keys(config, "_CONFIG_DEFINITIONS"),
        "old_names": sorted(set(_dict_keys(config, "_CONFIG_ALIASES")) | set(_dict_keys(config, "_DEPRECATED_CONFIGS"))),
        "variables": sorted(variables),
        "extra_config_keys": sorted(extra),
        "vllm_extra_config_keys": sorted(vllm_keys),
        "vllm_extra_config_prefixes": sorted(vllm_prefixes),
    }


if __name__ == "__main__":
    data = extract(Path(sys.argv[1]))
    vendored = Path(__file__).resolve().parents[1] / "data" / f"lmcache_names_{data['release']}.json"
    if vendored.exists():  # the provenance text and the LMCache-Ascend part are not in LMCache's wheel: keep them
        old = json.loads(vendored.read_text())
        data = {"provenance": old["provenance"], **data, **({"lmcache_ascend": old["lmcache_ascend"]} if "lmcache_ascend" in old else {})}
    print(json.dumps(data, indent=1))
