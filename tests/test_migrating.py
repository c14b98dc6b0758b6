"""Switching from LMCache / LMCache-Ascend: LMCache's names mean what they mean there, the
configuration block LMCache-Ascend's DeepSeek V4 connector publishes (seed 003) reads as its
users expect, and every LMCache name kvconnect ignores is warned about once, saying why."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from kvconnect import Config, ConfigError, GroupSpec, KVCacheEngine, KVLayout
from kvconnect import config as config_module
from kvconnect.errors import StorageError
from kvconnect.layout.spec import Fingerprint
from kvconnect.storage.manager import open_tiers
from kvconnect.throttled_warning import OnceWarnings

# the block of seed 003 ("LMCache configuration (tag v0.4.5)"), as a shell leaves it
SEED_003_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "70",
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_LOG_LEVEL": "INFO",
    "LMCACHE_USE_LAYERWISE": "False",
    "LMCACHE_NUMA_MODE": "auto",
    "LMCACHE_CHUNK_SIZE": "1024",
    "LMCACHE_EXTRA_CONFIG": '{"save_only_first_rank": false}',
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings again."""
    monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)


def warnings_of(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_the_seed_block_reads_as_in_lmcache_and_warns_where_kvconnect_differs(caplog):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    c = Config.from_env(SEED_003_ENV)
    assert (c.chunk_size, c.local_cpu, c.max_local_cpu_size) == (1024, True, 70.0)
    text = warnings_of(caplog)
    for var, why in [("LMCACHE_LOG_LEVEL", "logger"), ("LMCACHE_NUMA_MODE", "OpenMP binding"),
                     ("save_only_first_rank", "replicated")]:
        assert var in text and why in text, (var, text)
    # read, or switched off as kvconnect runs anyway (no usage data, no layer-by-layer): nothing to warn about
    for var in ("LMCACHE_CHUNK_SIZE", "LMCACHE_LOCAL_CPU", "LMCACHE_MAX_LOCAL_CPU_SIZE", "LMCACHE_TRACK_USAGE",
                "LMCACHE_USE_LAYERWISE"):
        assert var not in text
    caplog.clear()
    Config.from_env(SEED_003_ENV)
    assert warnings_of(caplog) == ""  # once per process, not once per engine


def test_the_same_block_as_quoted_values_of_an_env_file():
    """docker --env-file and systemd keep the quotes; LMCache strips matching quotes."""
    quoted = {k: f'"{v}"' if not v.startswith("{") else v for k, v in SEED_003_ENV.items()}
    quoted["LMCACHE_SAVE_UNFULL_CHUNK"] = "'1'"
    c = Config.from_env(quoted)
    assert (c.chunk_size, c.local_cpu, c.max_local_cpu_size, c.save_unfull_chunk) == (1024, True, 70.0, True)


@pytest.mark.parametrize("text,value", [("1", True), ("true", True), ("TRUE", True), (" True ", True),
                                        ("0", False), ("false", False), ("False", False), ("", False)])
def test_booleans_as_lmcache_reads_them(text, value):
    assert Config.from_env({"LMCACHE_SAVE_UNFULL_CHUNK": text}).save_unfull_chunk is value


@pytest.mark.parametrize("text", ["yes", "on", "no", "off", "Y", "enabled", "2"])
def test_booleans_lmcache_reads_as_false_are_refused_not_guessed(text):
    with pytest.raises(ConfigError, match="LMCACHE_LOCAL_CPU.*LMCache reads any other word"):
        Config.from_env({"LMCACHE_LOCAL_CPU": text})


def test_yaml_booleans_follow_yaml_as_in_lmcache(tmp_path):
    """Both read the file with yaml.safe_load: unquoted yes/on are YAML true; quoted "yes" is a word."""
    path = tmp_path / "c.yaml"
    path.write_text("save_unfull_chunk: yes\nlocal_cpu: off\nchunk_size: '512'\n")
    c = Config.from_env({"LMCACHE_CONFIG_FILE": str(path)})
    assert (c.save_unfull_chunk, c.local_cpu, c.chunk_size) == (True, False, 512)
    path.write_text("save_unfull_chunk: 'yes'\n")
    with pytest.raises(ConfigError, match="save_unfull_chunk"):
        Config.from_env({"LMCACHE_CONFIG_FILE": str(path)})


@pytest.mark.parametrize("raw,path", [("file:///mnt/nvme0/", "/mnt/nvme0/"), ("/mnt/nvme0", "/mnt/nvme0"),
                                      ("file:///mnt/nvme0/,", "/mnt/nvme0/"), (" file://local_disk/ ", "local_disk/"),
                                      (",", None)])
def test_local_disk_as_lmcache_parses_it(raw, path):
    assert Config.from_env({"LMCACHE_LOCAL_DISK": raw}).local_disk == path


def test_several_disk_directories_are_refused_with_a_reason():
    with pytest.raises(ConfigError, match=r"names 2 directories \['/mnt/nvme0/', '/mnt/nvme1/'\].*one directory"):
        Config.from_env({"LMCACHE_LOCAL_DISK": "file:///mnt/nvme0/,file:///mnt/nvme1/"})


def test_lmcache_aliases_are_read_where_the_meaning_maps(caplog):
    c = Config.from_env({"LMCACHE_MIN_RETRIEVE_TOKENS": "512", "LMCACHE_CACHE_POLICY": "LRU",
                         "LMCACHE_LOOKUP_TIMEOUT_MS": "250"})
    assert (c.min_load_tokens, c.eviction, c.remote_timeout_s) == (512, "lru", 0.25)
    assert Config.from_env({"LMCACHE_MIN_RETRIEVE_TOKENS": "0"}).min_load_tokens == 1  # LMCache: no minimum
    # kvconnect's own name wins over the LMCache alias of it
    assert Config.from_env({"LMCACHE_CACHE_POLICY": "LRU", "KVCONNECT_EVICTION": "arc"}).eviction == "arc"
    assert Config.from_dict({"lookup_timeout_ms": 2000}).remote_timeout_s == 2.0
    caplog.set_level(logging.WARNING, logger="kvconnect")
    assert Config.from_env({"LMCACHE_CACHE_POLICY": "LFU"}).eviction == "s3fifo"
    assert "LFU" in warnings_of(caplog) and "no kvconnect policy" in warnings_of(caplog)
    with pytest.raises(ConfigError, match="LMCACHE_MIN_RETRIEVE_TOKENS"):
        Config.from_env({"LMCACHE_MIN_RETRIEVE_TOKENS": "-1"})
    with pytest.raises(ConfigError, match="LMCACHE_LOOKUP_TIMEOUT_MS"):
        Config.from_env({"LMCACHE_LOOKUP_TIMEOUT_MS": "0"})


def test_extra_config_is_parsed(caplog):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    Config.from_env({"LMCACHE_EXTRA_CONFIG": '{"save_only_first_rank": false, "s3_region": "x"}'})
    text = warnings_of(caplog)
    assert "save_only_first_rank=False" in text and "s3_region" in text and "not an extra_config key of LMCache 0.4.5 / 0.5.6" in text
    Config.from_dict({"extra_config": {"save_only_first_rank": False}})  # the YAML form
    for bad in ('{"save_only_first_rank": tru', '[1, 2]'):
        with pytest.raises(ConfigError, match="LMCACHE_EXTRA_CONFIG"):
            Config.from_env({"LMCACHE_EXTRA_CONFIG": bad})


def test_typos_and_unknown_names_are_warned_with_a_suggestion(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    Config.from_env({"LMCACHE_CHUNK_SZIE": "512", "KVCONNECT_EVICTON": "lru", "LMCACHE_ASCEND_SKIP_STATE_GROUPS": "1",
                     "LMCACHE_EC_CHUNK_SIZE": "4", "KVCONNECT_BUILD_CUDA": "0"})
    text = warnings_of(caplog)
    assert "LMCACHE_CHUNK_SZIE" in text and "did you mean 'chunk_size'" in text
    assert "KVCONNECT_EVICTON" in text and "did you mean 'eviction'" in text
    assert "LMCACHE_ASCEND_SKIP_STATE_GROUPS" in text and "state groups included" in text
    assert "LMCACHE_EC_CHUNK_SIZE" in text and "encoder" in text
    assert "KVCONNECT_BUILD_CUDA" not in text  # the build's variable, not a setting
    path = tmp_path / "c.yaml"
    path.write_text("enable_pd: true\npd_role: sender\n")
    Config.from_env({"LMCACHE_CONFIG_FILE": str(path)})
    assert "enable_pd" in warnings_of(caplog) and "kv_producer" in warnings_of(caplog)


@pytest.mark.parametrize("url,hint", [("lm://localhost:65432", "KVCONNECT_SERVER_URL"), ("resp://h:6379", "redis://HOST:PORT"),
                                      ("s3://bucket/kv", "s3:// has no kvconnect tier"),
                                      ("infinistore://127.0.0.1:12345", "mooncakestore://"), ("h:6379", "")])
def test_remote_schemes_lmcache_users_have_are_refused_clearly(url, hint):
    with pytest.raises(ConfigError, match="mooncakestore://HOST:PORT") as info:
        open_tiers(Config(remote_url=url), Fingerprint(b"\0" * 16))
    assert hint in str(info.value) and url in str(info.value)


def test_a_missing_redis_package_is_named_not_the_url(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(StorageError, match="needs the 'redis' package"):
        open_tiers(Config(remote_url="redis://127.0.0.1:6379"), Fingerprint(b"\0" * 16))
    with pytest.raises(ConfigError, match="lm://"):  # and a URL kvconnect cannot use is still named first
        open_tiers(Config(remote_url="lm://h:1"), Fingerprint(b"\0" * 16))


# -- local_cpu: False (4 of LMCache's example configs, both LMCache-Ascend P/D ones) --------
def small_engine(**config) -> tuple[KVCacheEngine, dict]:
    torch.manual_seed(0)
    kv = {f"layers.{i}": torch.randn(2, 64, 16, 2, 16) for i in range(2)}
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=16)])
    return KVCacheEngine(layout, Config(chunk_size=64, max_local_cpu_size=0.01, pool_prefault=False, **config)), kv


def test_local_cpu_false_still_uses_the_disk_tier(tmp_path):
    """LMCache: no CPU cache, disk and remote still work. A second engine (a restarted
    server: empty pool) on the same directory restores byte-exact from the disk."""
    cfg = dict(local_cpu=False, local_disk=f"file://{tmp_path}", max_local_disk_size=0.05)
    first, kv = small_engine(**cfg)
    tokens = list(range(200))
    assert first.store(tokens, block_ids=[list(range(13))]) == 192  # three full 64-token chunks
    first.close()  # flushes the write-behind queue to the disk
    assert any(tmp_path.rglob("*")), "nothing reached the disk tier"
    second, kv2 = small_engine(**cfg)
    for t in kv2.values():
        t.zero_()
    assert second.lookup(tokens) == 192
    assert second.retrieve(tokens, block_ids=[list(range(20, 32))]) == 192
    for name in kv:
        assert torch.equal(kv2[name][:, 20:32], kv[name][:, 0:12])
    second.close()


def test_local_cpu_false_without_a_lower_tier_keeps_nothing_as_in_lmcache():
    assert Config(local_cpu=False).private_pool_bytes == 0
    assert Config(local_cpu=False, local_disk="/x").private_pool_bytes == 0  # no disk size: no disk tier
    assert Config(local_cpu=False, remote_url="redis://h:1", max_local_cpu_size=1).private_pool_bytes == 1 << 30
    engine, _ = small_engine(local_cpu=False)
    assert engine.store(list(range(128)), block_ids=[list(range(8))]) == 0 and engine.lookup(list(range(128))) == 0
    engine.close()


def test_a_disk_directory_without_a_size_says_which_variable_is_missing(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    assert open_tiers(Config.from_env({"LMCACHE_LOCAL_DISK": str(tmp_path)}), Fingerprint(b"\0" * 16)) == []
    assert "LMCACHE_MAX_LOCAL_DISK_SIZE" in warnings_of(caplog)


def test_an_lmcache_ascend_pd_config_reads_with_its_meaning(tmp_path, caplog):
    """The keys of LMCache-Ascend's 1p1d prefiller example (examples/disagg_prefill/1p1d),
    written out here: local_cpu False, LMCache-Ascend's own pd_* keys, save_unfull_chunk."""
    caplog.set_level(logging.WARNING, logger="kvconnect")
    path = tmp_path / "prefiller.yaml"
    path.write_text("local_cpu: False\nenable_pd: True\ntransfer_channel: hccl\npd_role: sender\npd_pull_mode: False\n"
                    "pd_delay_pull: False\npd_pull_done_port: [7600, 7601]\npd_use_cpu_offload: False\n"
                    "pd_cpu_buffer_size: 21474836480\npd_buffer_size: 2415919104\npd_buffer_device: npu\n"
                    "save_unfull_chunk: True\n")
    c = Config.from_env({"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_REMOTE_URL": "redis://127.0.0.1:6379"})
    assert (c.local_cpu, c.save_unfull_chunk, c.remote_url) == (False, True, "redis://127.0.0.1:6379")
    assert c.private_pool_bytes == c.max_local_cpu_bytes  # the remote tier is written through the pool
    text = warnings_of(caplog)
    for key in ("enable_pd", "pd_role", "pd_pull_mode", "pd_delay_pull", "pd_pull_done_port", "pd_use_cpu_offload",
                "pd_cpu_buffer_size", "transfer_channel"):
        assert f"{key} ({path})" in text, key
    assert "ignoring" not in text  # every key is known: none is mistaken for a typo


@pytest.mark.parametrize("values,why", [({"local_cpu": False}, "local_cpu (LMCACHE_LOCAL_CPU) is false"),
                                         ({"max_local_cpu_size": 1e-9}, "smaller than one chunk")])
def test_an_engine_that_can_store_nothing_says_so_once(caplog, values, why):
    """Python API, no tier that can hold a chunk: store returns 0, and one warning says why."""
    import numpy as np
    import torch

    from kvconnect import GroupSpec, KVCacheEngine, KVLayout

    caplog.set_level(logging.WARNING, logger="kvconnect")
    kv = {f"layer.{i}": torch.zeros(8, 16, 64, dtype=torch.float16) for i in range(2)}
    layout = KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=16)])
    engine = KVCacheEngine(layout, Config.from_dict({"chunk_size": 16, "num_threads": 1, **values}))
    try:
        assert engine.store(np.arange(64), [list(range(4))]) == 0
        assert engine.store(np.arange(64), [list(range(4))]) == 0
    finally:
        engine.close()
    hits = [r.getMessage() for r in caplog.records if "stores nothing" in r.getMessage()]
    assert len(hits) == 1 and why in hits[0], hits


def test_lmcache_server_url_is_never_kvconnects_server(caplog, monkeypatch):
    """LMCache's LMCACHE_SERVER_URL (lm://, its multiprocess server's ipc:// socket) is warned about,
    never read as KVCONNECT_SERVER_URL (every lookup would miss against the wrong protocol)."""
    caplog.set_level(logging.WARNING, logger="kvconnect")
    for url in ("ipc:///tmp/lmcache_mp.sock", "lm://localhost:65432"):
        monkeypatch.setattr(config_module, "warn_once", OnceWarnings(config_module.logger.warning).warn)
        assert Config.from_env({"LMCACHE_SERVER_URL": url}).server_url is None
        assert "LMCACHE_SERVER_URL" in warnings_of(caplog) and "KVCONNECT_SERVER_URL" in warnings_of(caplog)
    assert Config.from_env({"KVCONNECT_SERVER_URL": "ipc:///tmp/k.sock"}).server_url == "ipc:///tmp/k.sock"


@pytest.mark.parametrize("url,match", [("redis://a:6379,redis://b:6379", "redis-cluster://"),
                                        ("redis://127.0.0.1:63x9", "Port could not be cast")])
def test_a_redis_url_that_would_miss_on_every_lookup_is_refused_at_start(url, match):
    import torch

    from kvconnect import GroupSpec, KVCacheEngine, KVLayout

    layout = KVLayout.from_tensors({"layer.0": torch.zeros(4, 16, 64, dtype=torch.float16)}, groups=[GroupSpec(block_size=16)])
    with pytest.raises(ConfigError, match=match) as err:
        KVCacheEngine(layout, Config(chunk_size=16, num_threads=1, max_local_cpu_size=0.01, remote_url=url,
                                     model_name="test/redis-url"))
    assert "LMCACHE_REMOTE_URL" in str(err.value)
