"""Every LMCache / LMCache-Ascend configuration name has a kvconnect answer, in the code
(kvconnect/lmcache_names.py: read, mapped, or warned about with what kvconnect does instead)
and in docs/migrating.md.

LMCache's names are DATA read from its pinned release: tests/data/lmcache_names.json, made by
tests/lmcache_keys.py from the wheel with ``ast`` (kvconnect never imports lmcache). When the
pinned wheel is in the CI cache (.ci/setup.sh downloads it), the vendored list must equal a
fresh extraction, so bumping the pin without handling LMCache's new keys fails here.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from kvconnect import Config
from kvconnect import config as config_module
from kvconnect import lmcache_names
from kvconnect.throttled_warning import OnceWarnings

ROOT = Path(__file__).resolve().parents[1]
NAMES = json.loads((ROOT / "tests" / "data" / "lmcache_names.json").read_text())
DOC = (ROOT / "docs" / "migrating.md").read_text()
WHEEL_CACHE = Path.home() / ".cache" / "kvconnect-ci"  # where .ci/setup.sh puts the pinned wheel

CONFIG_KEYS = NAMES["config_keys"] + NAMES["old_names"] + NAMES["lmcache_ascend"]["config_keys"]
VARIABLES = NAMES["variables"] + NAMES["lmcache_ascend"]["variables"]


def handled(name: str) -> bool:
    return (name in lmcache_names.SAME or name in lmcache_names.ALIASES or name == "extra_config"
            or name in lmcache_names.INSTEAD)


def test_the_pins_agree():
    assert NAMES["release"] == lmcache_names.LMCACHE_RELEASE
    assert f"lmcache=={lmcache_names.LMCACHE_RELEASE}" in (ROOT / ".ci" / "setup.sh").read_text()
    assert f"LMCache {lmcache_names.LMCACHE_RELEASE}" in DOC


def test_the_vendored_list_is_the_pinned_release():
    wheels = sorted(WHEEL_CACHE.glob(f"lmcache-{lmcache_names.LMCACHE_RELEASE}-*.whl"))
    if not wheels:
        pytest.skip(f"no lmcache {lmcache_names.LMCACHE_RELEASE} wheel in {WHEEL_CACHE} (.ci/setup.sh downloads it); "
                    "the vendored list is checked by the other tests")
    from lmcache_keys import extract

    fresh = extract(wheels[0])
    for part in ("config_keys", "old_names", "variables", "extra_config_keys"):
        assert sorted(fresh[part]) == sorted(NAMES[part]), (
            f"LMCache {fresh['release']}'s {part} changed: regenerate tests/data/lmcache_names.json with "
            "tests/lmcache_keys.py, then give each new name its answer in kvconnect/lmcache_names.py and docs/migrating.md")


@pytest.mark.parametrize("name", CONFIG_KEYS)
def test_every_lmcache_key_has_an_answer(name):
    assert handled(name), f"LMCache key {name!r}: add it to kvconnect/lmcache_names.py (SAME, ALIASES or INSTEAD)"
    assert re.search(rf"`{re.escape(name)}`", DOC), f"docs/migrating.md does not list `{name}`"


@pytest.mark.parametrize("var", VARIABLES)
def test_every_lmcache_variable_has_an_answer(var):
    if var.endswith("_"):  # a family read by prefix
        assert var in lmcache_names.ENV_PREFIXES
    else:
        name = var.removeprefix("LMCACHE_").lower()
        assert var in lmcache_names.NOT_SETTINGS or handled(name) or lmcache_names.instead_of_variable(var), var
    assert re.search(rf"`{re.escape(var)}\*?`", DOC), f"docs/migrating.md does not list `{var}`"


@pytest.mark.parametrize("key", NAMES["extra_config_keys"])
def test_every_extra_config_key_has_an_answer(key):
    assert key in lmcache_names.EXTRA_CONFIG
    assert re.search(rf"`{re.escape(key)}`", DOC), f"docs/migrating.md does not list extra_config `{key}`"


def test_each_ignored_name_is_warned_once_with_its_answer(monkeypatch, caplog):
    """As a variable and as a YAML key: no error, one warning naming it and what kvconnect does."""
    caplog.set_level(logging.WARNING, logger="kvconnect")
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)
    ignored = sorted({n for n in CONFIG_KEYS if n in lmcache_names.INSTEAD})
    env = {f"LMCACHE_{n.upper()}": "1" for n in ignored}
    assert Config.from_env(env) == Config.from_env({})
    messages = [r.getMessage() for r in caplog.records]
    for n in ignored:
        hits = [m for m in messages if f"LMCACHE_{n.upper()} " in m]
        assert len(hits) == 1 and lmcache_names.INSTEAD[n] in hits[0], (n, hits)
    caplog.clear()
    assert Config.from_dict({n: 1 for n in ignored}, source="lmcache.yaml") == Config()
    assert len(caplog.records) == len(ignored)


def test_every_name_read_as_is_is_a_config_field():
    fields = {f.name for f in __import__("dataclasses").fields(Config)}
    assert set(lmcache_names.SAME) <= fields and set(lmcache_names.ALIASES.values()) <= fields
    assert set(lmcache_names.SAME) <= set(NAMES["config_keys"])  # same names as LMCache's, not invented
    assert not set(lmcache_names.INSTEAD) & (set(lmcache_names.SAME) | set(lmcache_names.ALIASES))
