"""Config: LMCache-compatible environment variables, a YAML file, adapter mappings, and
errors that name the variable at fault."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvconnect import Config, ConfigError
from kvconnect.config import GB


def test_defaults():
    c = Config.from_env({})
    assert c == Config()
    assert (c.chunk_size, c.local_cpu, c.max_local_cpu_size, c.save_unfull_chunk) == (0, True, 5.0, False)  # 0: chosen from the layout
    assert c.local_disk is None and c.remote_url is None and c.model_name == "" and c.cuda_transfer == "kernel"
    assert c.num_threads >= 1 and c.max_local_cpu_bytes == 5 * GB


def test_environment_variables():
    env = {
        "LMCACHE_CHUNK_SIZE": " 512 ",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
        "LMCACHE_LOCAL_DISK": "file:///tmp/kvc-disk",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "20",
        "LMCACHE_REMOTE_URL": "redis://127.0.0.1:6379",
        "LMCACHE_SAVE_UNFULL_CHUNK": "true",
        "KVCONNECT_NUM_THREADS": "3",
        "KVCONNECT_MODEL_NAME": "deepseek-v4-flash",
        "KVCONNECT_REMOTE_TIMEOUT_S": "0.25",
        "KVCONNECT_CUDA_TRANSFER": "staged",
        "LMCACHE_SOMETHING_WE_DO_NOT_USE": "whatever",  # unknown: warned (tests/test_migrating.py), ignored
        "PATH": "/usr/bin",
    }
    c = Config.from_env(env)
    assert c.chunk_size == 512 and c.local_cpu is False and c.max_local_cpu_size == 0.5
    assert c.max_local_cpu_bytes == GB // 2
    assert c.local_disk == "/tmp/kvc-disk" and c.max_local_disk_bytes == 20 * GB
    assert c.remote_url == "redis://127.0.0.1:6379" and c.save_unfull_chunk is True
    assert (c.num_threads, c.model_name, c.remote_timeout_s) == (3, "deepseek-v4-flash", 0.25)
    assert c.cuda_transfer == "staged"


@pytest.mark.parametrize("text,value", [("1", True), ("TRUE", True), ("true", True), ("0", False),
                                        ("false", False), ("FALSE", False), ("", False)])  # yes/on: tests/test_migrating.py
def test_boolean_spellings(text, value):
    assert Config.from_env({"LMCACHE_SAVE_UNFULL_CHUNK": text}).save_unfull_chunk is value


@pytest.mark.parametrize(
    "var,value",
    [
        ("LMCACHE_CHUNK_SIZE", "abc"),
        ("LMCACHE_CHUNK_SIZE", "-1"),
        ("LMCACHE_CHUNK_SIZE", "-256"),
        ("LMCACHE_CHUNK_SIZE", "25.5"),
        ("LMCACHE_LOCAL_CPU", "maybe"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "five"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "-1"),
        ("LMCACHE_MAX_LOCAL_DISK_SIZE", "-0.5"),
        ("KVCONNECT_NUM_THREADS", "0"),
        ("KVCONNECT_NUM_THREADS", "many"),
        ("KVCONNECT_REMOTE_TIMEOUT_S", "0"),
        ("LMCACHE_SAVE_UNFULL_CHUNK", "2"),
        ("KVCONNECT_CUDA_TRANSFER", "dma"),
    ],
)
def test_bad_values_name_the_variable(var, value):
    with pytest.raises(ConfigError, match=var):
        Config.from_env({var: value})


def test_yaml_file_and_env_precedence(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(
        "chunk_size: 128\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 2\n"
        "save_unfull_chunk: true\n"
        "local_disk: file:///var/cache/kvc\n"
        "remote_serde: naive   # an LMCache key kvconnect has no use for\n"
    )
    c = Config.from_env({"LMCACHE_CONFIG_FILE": str(path)})
    assert (c.chunk_size, c.max_local_cpu_size, c.save_unfull_chunk, c.local_disk) == (128, 2.0, True, "/var/cache/kvc")
    c = Config.from_env({"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_CHUNK_SIZE": "64"})
    assert c.chunk_size == 64 and c.max_local_cpu_size == 2.0  # the environment wins over the file


@pytest.mark.parametrize(
    "content,match",
    [
        ("chunk_size: [1, 2\n", "not valid YAML"),
        ("- 1\n- 2\n", "mapping"),
        ("chunk_size: abc\n", "chunk_size"),
        ("local_cpu: sometimes\n", "local_cpu"),
    ],
)
def test_bad_yaml_names_the_file_or_key(tmp_path, content, match):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as info:
        Config.from_env({"LMCACHE_CONFIG_FILE": str(path)})
    assert "bad.yaml" in str(info.value) or "LMCACHE_CONFIG_FILE" in str(info.value)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="LMCACHE_CONFIG_FILE"):
        Config.from_env({"LMCACHE_CONFIG_FILE": str(tmp_path / "absent.yaml")})


def test_empty_yaml_file_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert Config.from_env({"LMCACHE_CONFIG_FILE": str(path)}) == Config.from_env({})


def test_from_dict_for_adapters():
    """vLLM's kv_connector_extra_config passes the same keys, in YAML or env spelling."""
    base = Config(num_threads=2)
    c = Config.from_dict({"chunk_size": 64, "lmcache_save_unfull_chunk": "true", "KVCONNECT_MODEL_NAME": "m"}, base=base)
    assert (c.chunk_size, c.save_unfull_chunk, c.model_name, c.num_threads) == (64, True, "m", 2)
    with pytest.raises(ConfigError, match="chunk_size"):
        Config.from_dict({"chunk_size": 1.5})
    assert Config.from_dict({"remote_url": None}).remote_url is None
    assert Config.from_dict({"local_disk": ""}).local_disk is None


def test_reads_the_process_environment(clean_env, monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "1024")
    monkeypatch.setenv("KVCONNECT_NUM_THREADS", "5")
    c = Config.from_env()
    assert c.chunk_size == 1024 and c.num_threads == 5
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "zero")
    with pytest.raises(ConfigError, match="LMCACHE_CHUNK_SIZE"):
        Config.from_env()


def test_config_is_frozen_and_validated_directly():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.chunk_size = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="LMCACHE_CHUNK_SIZE"):
        Config(chunk_size=-1)
    assert Config(local_disk="file:///x").local_disk == "/x"


@pytest.mark.parametrize("var, value", [
    ("KVCONNECT_REMOTE_TIMEOUT_S", "nan"), ("KVCONNECT_REMOTE_TIMEOUT_S", "inf"), ("KVCONNECT_REMOTE_TIMEOUT_S", "0"),
    ("LMCACHE_MAX_LOCAL_CPU_SIZE", "inf"), ("LMCACHE_MAX_LOCAL_CPU_SIZE", "1e400"), ("LMCACHE_MAX_LOCAL_CPU_SIZE", "nan"),
    ("LMCACHE_MAX_LOCAL_DISK_SIZE", "inf"), ("LMCACHE_MAX_LOCAL_DISK_SIZE", "nan"), ("LMCACHE_MAX_LOCAL_DISK_SIZE", "-1"),
    ("KVCONNECT_PD_WAIT_TIMEOUT_S", "nan"), ("KVCONNECT_PD_POLL_INTERVAL_S", "inf"), ("KVCONNECT_LOG_INTERVAL_S", "nan"),
    ("LMCACHE_CHUNK_SIZE", "1e400"), ("KVCONNECT_NUM_THREADS", "0"), ("KVCONNECT_METRICS_PORT", "65536"),
    ("KVCONNECT_RESTORE_INTERVAL_TOKENS", "-1"), ("KVCONNECT_MIN_LOAD_TOKENS", "99999999999"),
    ("LMCACHE_LOOKUP_TIMEOUT_MS", "nan"), ("LMCACHE_LOOKUP_TIMEOUT_MS", "inf"),
])
def test_no_numeric_setting_disables_or_crashes(var, value):
    """NaN, infinities and values out of range are a ConfigError naming the setting, never a
    tier silently turned off (a NaN timeout made every deadline test false) or an OverflowError
    from the byte sizes derived later."""
    with pytest.raises(ConfigError) as err:
        config = Config.from_env({var: value})
        (config.max_local_cpu_bytes, config.max_local_disk_bytes)  # what used to raise OverflowError
    text = str(err.value)
    assert var in text or var.removeprefix("LMCACHE_").lower() in text or "remote_timeout_s" in text, text


def test_every_numeric_field_is_validated():
    """The one numeric check covers every int and float setting (a new one cannot be missed)."""
    from kvconnect.config import NUMERIC_RANGES

    numeric = {f.name for f in dataclasses.fields(Config) if f.type in ("int", "float")}
    assert numeric == set(NUMERIC_RANGES)
    for name in numeric:
        with pytest.raises(ConfigError, match=name):
            Config(**{name: float("nan")})


# --- LMCache 0.5.6's vLLM keys (kv_connector_extra_config), issue 41 item 2 ----------------------
def test_lmcache_dot_keys_are_lmcaches_config_keys_over_the_environment():
    """LMCache's vllm_v1_adapter._apply_extra_config: ``lmcache.<key>`` sets config key <key> over
    the file and the environment; kvconnect reads <key> as it reads it anywhere (aliases too)."""
    base = Config.from_env({"LMCACHE_MAX_LOCAL_CPU_SIZE": "2", "LMCACHE_CHUNK_SIZE": "128"})
    c = Config.from_vllm_extra_config({"lmcache.max_local_cpu_size": 7.5, "lmcache.save_decode_cache": "true",
                                       "lmcache.cache_policy": "LRU", "lmcache.lookup_timeout_ms": 250}, base=base)
    assert (c.max_local_cpu_size, c.chunk_size, c.save_decode_cache, c.eviction, c.remote_timeout_s) == (7.5, 128, True, "lru", 0.25)


def test_lmcache_dot_is_never_a_kvconnect_only_setting():
    """``lmcache.server_url`` is LMCache's server, ``lmcache.num_threads`` no LMCache key: neither sets kvconnect's."""
    c = Config.from_vllm_extra_config({"lmcache.server_url": "ipc:///tmp/lm", "lmcache.num_threads": 3}, base=Config(num_threads=2))
    assert c == Config(num_threads=2)


def test_one_setting_given_twice_with_two_values_is_refused():
    with pytest.raises(ConfigError, match=r"chunk_size=128 and lmcache.chunk_size=256 both set 'chunk_size'"):
        Config.from_vllm_extra_config({"chunk_size": 128, "lmcache.chunk_size": 256})
    assert Config.from_vllm_extra_config({"chunk_size": 128, "lmcache.chunk_size": 128}).chunk_size == 128


@pytest.mark.parametrize("save_unfull, discard, stored", [
    (True, True, False), (True, False, True), (False, False, False), (False, True, False), (True, None, True)])
def test_discard_partial_chunks_as_lmcache_reads_it(save_unfull, discard, stored):
    """LMCache: ``discard = discard_partial_chunks or not save_unfull_chunk``; stored = not discard."""
    extra = {"lmcache.save_unfull_chunk": save_unfull} | ({} if discard is None else {"discard_partial_chunks": discard})
    assert Config.from_vllm_extra_config(extra).save_unfull_chunk is stored


def test_discard_partial_chunks_refuses_a_word_it_cannot_read():
    with pytest.raises(ConfigError, match="discard_partial_chunks .*not a boolean"):
        Config.from_vllm_extra_config({"discard_partial_chunks": "yes"})


def test_skip_last_n_tokens_is_read_and_checked():
    assert Config.from_vllm_extra_config({"skip_last_n_tokens": 16}).skip_last_n_tokens == 16
    assert Config.from_env({"KVCONNECT_SKIP_LAST_N_TOKENS": "8"}).skip_last_n_tokens == 8
    with pytest.raises(ConfigError, match="skip_last_n_tokens"):
        Config.from_vllm_extra_config({"skip_last_n_tokens": -1})


def test_absurdly_small_remote_timeout_is_refused_and_a_small_one_warns(caplog):
    """Issue 39 item 3: 1e-6 s turned Mooncake into all misses without a word."""
    with pytest.raises(ConfigError, match="KVCONNECT_REMOTE_TIMEOUT_S"):
        Config.from_env({"KVCONNECT_REMOTE_TIMEOUT_S": "1e-6"})
    with caplog.at_level(logging.WARNING, logger="kvconnect.config"):
        config = Config.from_env({"KVCONNECT_REMOTE_TIMEOUT_S": "0.0123", "LMCACHE_REMOTE_URL": "redis://127.0.0.1:6379"})
    assert config.remote_timeout_s == 0.0123
    assert any("0.0123 s" in r.getMessage() and "miss" in r.getMessage() for r in caplog.records)
