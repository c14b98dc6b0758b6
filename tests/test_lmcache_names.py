"""Every LMCache / LMCache-Ascend configuration name has a kvconnect answer, in the code
(kvconnect/lmcache_names.py: read, mapped, or warned about with what kvconnect does instead)
and in docs/migrating.md.

LMCache's names are DATA read from each release kvconnect answers for (0.4.5, which
LMCache-Ascend runs on; 0.5.6, the newest on PyPI): tests/data/lmcache_names_RELEASE.json, made
by tests/support/lmcache_keys.py from the wheel with ``ast`` (kvconnect never imports lmcache). When a
wheel is in the CI cache (.ci/setup.sh downloads them), its vendored list must equal a fresh
extraction, so adding a release without handling its new keys fails here.
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
WHEEL_CACHE = Path.home() / ".cache" / "kvconnect-ci"  # where .ci/setup.sh puts the wheels
DOC = (ROOT / "docs" / "migrating.md").read_text()
RELEASES = {r: json.loads((ROOT / "tests" / "data" / f"lmcache_names_{r}.json").read_text())
            for r in lmcache_names.LMCACHE_RELEASES}


def _union(part: str) -> list[str]:
    names = {n for data in RELEASES.values() for n in data[part]}
    names |= {n for data in RELEASES.values() for n in data.get("lmcache_ascend", {}).get(part, [])}
    return sorted(names)


CONFIG_KEYS = sorted(set(_union("config_keys")) | set(_union("old_names")))
VARIABLES = _union("variables")
EXTRA_CONFIG_KEYS = _union("extra_config_keys")


def handled(name: str) -> bool:
    return (name in lmcache_names.SAME or name in lmcache_names.ALIASES or name == "extra_config"
            or name in lmcache_names.INSTEAD)


@pytest.mark.parametrize("release", lmcache_names.LMCACHE_RELEASES)
def test_the_pins_agree(release):
    assert RELEASES[release]["release"] == release
    assert f"lmcache=={release}" in (ROOT / ".ci" / "setup.sh").read_text()
    assert f"LMCache {release}" in DOC


@pytest.mark.parametrize("release", lmcache_names.LMCACHE_RELEASES)
def test_the_vendored_list_is_the_release(release):
    wheels = sorted(WHEEL_CACHE.glob(f"lmcache-{release}-*.whl"))
    if not wheels:
        pytest.skip(f"no lmcache {release} wheel in {WHEEL_CACHE} (.ci/setup.sh downloads it); "
                    "the vendored list is checked by the other tests")
    from support.lmcache_keys import extract

    fresh = extract(wheels[0])
    for part in ("config_keys", "old_names", "variables", "extra_config_keys", "vllm_extra_config_keys",
                 "vllm_extra_config_prefixes"):
        assert sorted(fresh[part]) == sorted(RELEASES[release][part]), (
            f"LMCache {fresh['release']}'s {part} changed: regenerate tests/data/lmcache_names_{release}.json with "
            "tests/support/lmcache_keys.py, then give each new name its answer in kvconnect/lmcache_names.py and docs/migrating.md")


def test_lmcache_05_names_users_bring_are_answered_not_called_unknown(monkeypatch, caplog):
    """LMCache 0.5.6's own names (issue 34) get what kvconnect does instead, never 'neither ... one'."""
    caplog.set_level(logging.WARNING, logger="kvconnect")
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)
    env = {"LMCACHE_MP_HOST": "0.0.0.0", "LMCACHE_LOCAL_CPU_USE_HUGEPAGES": "true", "LMCACHE_DISABLE_BANNER": "0",
           "LMCACHE_ENABLE_HIDDEN_STATE_CACHE": "true", "LMCACHE_COORDINATOR_URL": "http://c:1",
           "LMCACHE_DEVICE_BACKEND": "cuda"}
    assert Config.from_env(env) == Config.from_env({})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(env) and not any("neither" in m for m in messages), messages
    assert all("LMCache setting kvconnect does not use" in m for m in messages)


def test_yaml_keys_named_lmcache_something_are_lmcaches_not_unknown(monkeypatch, caplog):
    """config.py strips an ``lmcache_`` prefix; LMCache's own YAML keys that start with it keep it."""
    caplog.set_level(logging.WARNING, logger="kvconnect")
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)
    keys = ["lmcache_instance_id", "lmcache_worker_ports", "lmcache_worker_ids", "lmcache_worker_heartbeat_time"]
    assert Config.from_dict({k: "x" for k in keys} | {"lmcache_chunk_size": 128}, source="lmcache.yaml") == Config(chunk_size=128)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(keys) and not any("neither" in m for m in messages), messages
    assert all(lmcache_names.INSTEAD[k] in m for k, m in zip(keys, messages))


def test_lmcache_mooncake_extra_config_says_where_kvconnect_reads_it(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)
    extra = {"master_server_address": "10.0.0.1:50051", "global_segment_size": 3355443200, "protocol": "tcp",
             "metadata_server": "P2PHANDSHAKE", "mooncake_device_name": "mlx5_0"}
    Config.from_dict({"extra_config": extra}, source="lmcache.yaml")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(extra) and all("MOONCAKE_CONFIG_PATH" in m for m in messages), messages
    assert not any("not an extra_config key" in m for m in messages)


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


@pytest.mark.parametrize("key", EXTRA_CONFIG_KEYS)
def test_every_extra_config_key_has_an_answer(key):
    assert key in lmcache_names.EXTRA_CONFIG
    assert re.search(rf"`{re.escape(key)}`", DOC), f"docs/migrating.md does not list extra_config `{key}`"


def test_each_ignored_name_is_warned_once_with_its_answer(monkeypatch, caplog):
    """As a variable and as a YAML key: no error, one warning naming it and what kvconnect does."""
    caplog.set_level(logging.WARNING, logger="kvconnect")
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)
    ignored = sorted({n for n in CONFIG_KEYS if n in lmcache_names.INSTEAD})
    # a value that changes behaviour (AS_KVCONNECT's values are read silently: tested below)
    value = {n: 0 if True in lmcache_names.AS_KVCONNECT.get(n, ()) else 1 for n in ignored}
    env = {f"LMCACHE_{n.upper()}": str(value[n]) for n in ignored}
    assert Config.from_env(env) == Config.from_env({})
    messages = [r.getMessage() for r in caplog.records]
    for n in ignored:
        hits = [m for m in messages if f"LMCACHE_{n.upper()} " in m]
        assert len(hits) == 1 and lmcache_names.INSTEAD[n] in hits[0], (n, hits)
    caplog.clear()
    assert Config.from_dict(value, source="lmcache.yaml") == Config()
    assert len(caplog.records) == len(ignored)


def test_every_name_read_as_is_is_a_config_field():
    fields = {f.name for f in __import__("dataclasses").fields(Config)}
    assert set(lmcache_names.SAME) <= fields and set(lmcache_names.ALIASES.values()) <= fields
    assert set(lmcache_names.SAME) <= set(_union("config_keys"))  # same names as LMCache's, not invented
    assert not set(lmcache_names.INSTEAD) & (set(lmcache_names.SAME) | set(lmcache_names.ALIASES))


VLLM_KEYS = _union("vllm_extra_config_keys")


def test_lmcaches_vllm_prefix_is_the_one_kvconnect_reads():
    assert _union("vllm_extra_config_prefixes") == [lmcache_names.VLLM_CONFIG_PREFIX]


@pytest.mark.parametrize("key", VLLM_KEYS)
def test_every_lmcache_vllm_key_has_an_answer(key):
    """Each key LMCache's vLLM connectors read from kv_connector_extra_config is read or answered."""
    assert key in lmcache_names.VLLM_READ or lmcache_names.vllm_extra_config(key) is not None, key
    assert re.search(rf"`{re.escape(key)}`", DOC) or any(
        key.startswith(p) and f"`{p}*`" in DOC for p in lmcache_names.VLLM_EXTRA_CONFIG_PREFIXES), key


def _warnings(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)
    return lambda: [r.getMessage() for r in caplog.records]


# an ordinary LMCache file (the shape of LMCache's own example configs): every value of it either is
# read or means what kvconnect does, so kvconnect starts without a word
ORDINARY = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 5.0, "local_disk": None,
            "max_local_disk_size": 0, "remote_url": None, "remote_serde": "naive", "use_layerwise": False,
            "save_decode_cache": False, "enable_blending": False, "enable_p2p": False, "enable_controller": False,
            "enable_pd": False, "local_cpu_use_hugepages": False, "py_enable_gc": True, "lookup_timeout_ms": 3000,
            "extra_config": {"save_only_first_rank": True}}


def test_an_ordinary_lmcache_file_starts_without_warnings(monkeypatch, caplog, tmp_path):
    messages = _warnings(monkeypatch, caplog)
    path = tmp_path / "lmcache.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in ORDINARY.items()))
    env = {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_ENABLE_P2P": "False", "LMCACHE_TRACK_USAGE": "0"}
    assert Config.from_env(env).remote_timeout_s == 3.0
    assert messages() == []


def test_only_values_that_change_behaviour_are_warned(monkeypatch, caplog):
    messages = _warnings(monkeypatch, caplog)
    Config.from_dict({"enable_p2p": True, "enable_blending": False, "remote_serde": "cachegen"}, source="lmcache.yaml")
    assert len(messages()) == 2 and "enable_p2p" in messages()[0] and "remote_serde" in messages()[1], messages()


def test_every_quiet_value_belongs_to_a_name_kvconnect_does_not_use():
    for name in lmcache_names.AS_KVCONNECT:
        assert (lmcache_names.instead(name) or name in lmcache_names.EXTRA_CONFIG
                or lmcache_names.vllm_extra_config(name)), name


def test_lmcache_vllm_keys_warn_only_where_kvconnect_differs(monkeypatch, caplog):
    messages = _warnings(monkeypatch, caplog)
    extra = {"lmcache.max_local_cpu_size": 1.0, "discard_partial_chunks": True, "skip_last_n_tokens": 4,
             "lmcache.max_tokens_per_load": 0, "lmcache.enable_p2p": False}
    assert Config.from_vllm_extra_config(extra).max_local_cpu_size == 1.0
    assert messages() == []
    Config.from_vllm_extra_config({"lmcache.max_tokens_per_load": 131072, "lmcache.mp.port": 5555,
                                   "lmcache.no_such_key": 1, "lmcache_rpc_port": 7})
    got = messages()
    assert len(got) == 4 and not any("neither" in m for m in got), got
    assert lmcache_names.VLLM_EXTRA_CONFIG["lmcache.max_tokens_per_load"] in got[0]
    assert "LMCache's configuration has no key 'no_such_key'" in got[2]


def test_each_warning_once_per_process_and_none_from_a_quiet_reader(monkeypatch, caplog):
    """vLLM builds the connector in its scheduler and in each worker: the workers read quietly, and
    a process that reads the same settings twice warns once."""
    messages = _warnings(monkeypatch, caplog)
    env = {"LMCACHE_ENABLE_P2P": "true"}
    extra = {"lmcache.enable_blending": True}
    for quiet in (True, True):
        Config.from_vllm_extra_config(extra, base=Config.from_env(env, quiet=quiet), quiet=quiet)
    assert messages() == []
    for _ in range(2):
        Config.from_vllm_extra_config(extra, base=Config.from_env(env))
    assert len(messages()) == 2, messages()
