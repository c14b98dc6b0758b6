"""What a user sets reaches the keys, and sizes no host can give are configuration errors.

- ``Config.model_name`` (KVCONNECT_MODEL_NAME) on the Python API: two engines with the same
  tensor shapes and different model names never share a chunk (here through a real disk
  tier; tests/storage/test_mooncake_faults.py does the same through Mooncake).
- ``LMCACHE_MAX_LOCAL_CPU_SIZE`` beyond the host, and a Mooncake ``global_segment_size``
  that overflows or exceeds the host, raise ConfigError at start saying what was asked,
  what the host has and what to set, instead of an OverflowError or the allocator's
  RuntimeError.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support import zoo
from kvconnect import KVCacheEngine
from kvconnect.config import Config
from kvconnect.errors import ConfigError
from kvconnect.storage import host_memory
from kvconnect.storage.mooncake.config import make_spec, parse_bytes

CASE = "llama-flash"
CHUNK = 64
TOKENS = 4 * CHUNK


def _engine(case, tmp_path, model: str) -> KVCacheEngine:
    config = zoo.small_config(CHUNK, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05, model_name=model)
    return KVCacheEngine(case.layout(model_name=""), config)


def test_config_model_name_separates_chunks_on_a_shared_disk(tmp_path):
    case = zoo.build(CASE, max_tokens=TOKENS, seed=1)
    rng = np.random.default_rng(1)
    tokens = zoo.random_tokens(rng, TOKENS)
    tables = zoo.random_tables(case, TOKENS, rng)
    base = _engine(case, tmp_path, "base-model")
    try:
        assert base.store(tokens, tables) == TOKENS
        assert base.storage.flush(30)
    finally:
        base.close()
    tuned, again, unnamed = (_engine(case, tmp_path, m) for m in ("finetuned-model", "base-model", ""))
    try:
        assert tuned.lookup(tokens) == 0  # a fine-tune never reads the base model's chunks
        assert unnamed.lookup(tokens) == 0
        assert again.lookup(tokens) == TOKENS  # the same name finds them, from the disk
        assert again.storage.tiers[0].stats().lookup_hits > 0
    finally:
        for e in (tuned, again, unnamed):
            e.close()


def test_config_model_name_gives_the_adapters_fingerprint():
    """An unnamed layout under Config.model_name keys chunks exactly as a layout the adapters
    name themselves (vLLM, SGLang pass the name into the layout): engines of both kinds share."""
    case = zoo.build(CASE, max_tokens=TOKENS, seed=1)
    named = case.layout(model_name="m")
    engine = KVCacheEngine(case.layout(model_name=""), zoo.small_config(CHUNK, model_name="m"))
    try:
        assert engine.layout.fingerprint == named.fingerprint
        assert engine.layout.model_name == "m"
    finally:
        engine.close()
    # a layout named otherwise keeps its name and takes the configured one as well
    engine = KVCacheEngine(case.layout(model_name="layout-name"), zoo.small_config(CHUNK, model_name="m"))
    try:
        assert engine.layout.fingerprint not in (named.fingerprint, case.layout(model_name="layout-name").fingerprint)
    finally:
        engine.close()


def test_cpu_pool_larger_than_the_host_is_a_config_error():
    host = host_memory.physical_memory_bytes()
    assert host
    size_gb = 3 * host / (1 << 30)
    case = zoo.build(CASE, max_tokens=TOKENS, seed=1)
    with pytest.raises(ConfigError) as err:
        KVCacheEngine(case.layout(), Config(chunk_size=CHUNK, max_local_cpu_size=size_gb, num_threads=1))
    text = str(err.value)
    assert "LMCACHE_MAX_LOCAL_CPU_SIZE" in text and "this host has" in text and "GiB" in text


def test_a_failed_pool_allocation_is_a_config_error(monkeypatch):
    """The allocator's own refusal (the host check passed: a host that claims more memory)
    becomes a ConfigError too; 64 x the host's memory is refused by Linux's overcommit check."""
    host = host_memory.physical_memory_bytes()
    monkeypatch.setattr(host_memory, "host_room", lambda: (1 << 62, "a host that claims more"))
    with pytest.raises(ConfigError) as err:
        host_memory.allocate(64 * host, pin_memory=False, what="max_local_cpu_size (LMCACHE_MAX_LOCAL_CPU_SIZE) = x GB")
    assert "LMCACHE_MAX_LOCAL_CPU_SIZE" in str(err.value) and "set it lower" in str(err.value)


@pytest.mark.parametrize("size", [1e400, "1e400", "1e400 GB", 10 ** 30, "9999999 TB"])
def test_mooncake_segment_size_beyond_reason_is_a_config_error(tmp_path, size):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"global_segment_size": size}) if size != 1e400 else '{"global_segment_size": 1e400}')
    with pytest.raises(ConfigError) as err:
        make_spec("mooncakestore://127.0.0.1:5000", str(path), has_node_server=False)
    assert "global_segment_size" in str(err.value)


def test_mooncake_segment_larger_than_the_host_is_a_config_error(tmp_path):
    host = host_memory.physical_memory_bytes()
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"global_segment_size": 2 * host}))
    with pytest.raises(ConfigError) as err:
        make_spec("mooncakestore://127.0.0.1:5000", str(path), has_node_server=False)
    assert "this host has" in str(err.value)
    assert parse_bytes("1.5e3 MB", "x") == int(1.5e3 * (1 << 20))


def test_mooncake_local_buffer_larger_than_the_host_is_a_config_error(tmp_path):
    """Mooncake allocates its local buffer at setup and retries std::bad_alloc forever when the
    host cannot give it: such a size is refused before a client starts."""
    host = host_memory.physical_memory_bytes()
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"global_segment_size": 0, "local_buffer_size": 2 * host}))
    with pytest.raises(ConfigError) as err:
        make_spec("mooncakestore://127.0.0.1:5000", str(path), has_node_server=True)
    assert "local_buffer_size" in str(err.value) and "this host has" in str(err.value)
    # each alone fits the host's room now, together they do not (from the room, not physical
    # memory: with engines running beside the test, available memory can be under half of RAM)
    room, _ = host_memory.host_room()
    each = int(room * 0.6)
    path.write_text(json.dumps({"global_segment_size": each, "local_buffer_size": each}))
    with pytest.raises(ConfigError, match="global_segment_size \\+ local_buffer_size"):
        make_spec("mooncakestore://127.0.0.1:5000", str(path), has_node_server=False)
    path.write_text(json.dumps({"global_segment_size": 0, "local_buffer_size": "16 MB"}))
    assert make_spec("mooncakestore://127.0.0.1:5000", str(path), has_node_server=True).local_buffer_bytes == 16 << 20


def test_a_disk_tier_larger_than_its_filesystem_is_a_config_error(tmp_path):
    """A size no filesystem under the directory can hold is a typo, not a cache: refused at
    start naming the setting (a size past every host, inf or NaN, is refused by Config)."""
    import shutil

    total_gb = shutil.disk_usage(tmp_path).total / (1 << 30)
    case = zoo.build(CASE, max_tokens=TOKENS, seed=1)
    config = zoo.small_config(CHUNK, local_disk=str(tmp_path / "disk"), max_local_disk_size=2 * total_gb)
    with pytest.raises(ConfigError) as err:
        KVCacheEngine(case.layout(), config)
    assert "LMCACHE_MAX_LOCAL_DISK_SIZE" in str(err.value) and "filesystem" in str(err.value)
    engine = KVCacheEngine(case.layout(), zoo.small_config(CHUNK, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01))
    try:
        assert [t.name for t in engine.storage.tiers] == ["disk"]
    finally:
        engine.close()
