"""Shared tiers never mix models they cannot tell apart, against a real redis-server.

- An engine without a model identity does not start on a shared tier (Redis, Mooncake, the
  node server): two unnamed models of equal shapes used to serve each other every chunk.
- Rows of equal bytes split into other heads (4 x 128 vs 8 x 64) are other models' KV: the
  fingerprint carries the row shape, so they never share a chunk even under one name.
"""

from __future__ import annotations

import pytest
import torch

import kv_rig
from support.redis_server import RedisNode, redis_available

from kvconnect import GroupSpec, KVCacheEngine, KVLayout
from kvconnect.errors import ConfigError

pytestmark = pytest.mark.redis
TOKENS = 4 * kv_rig.CHUNK_TOKENS


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if redis_available() is not None:
        pytest.skip(redis_available())
    with RedisNode(tmp_path_factory.mktemp("redis")) as node:
        yield node.url


def _layout(heads: int, head_size: int, model: str) -> KVLayout:
    kv = {f"layers.{i}": torch.zeros(2, 64, kv_rig.BLOCK_TOKENS, heads, head_size, dtype=torch.bfloat16)
          for i in range(2)}
    return KVLayout.from_tensors(kv, groups=[GroupSpec(block_size=kv_rig.BLOCK_TOKENS)], model_name=model)


@pytest.mark.parametrize("setting", ["remote_url", "server_url"])
def test_an_unnamed_engine_does_not_start_on_a_shared_tier(redis_url, tmp_path, setting):
    url = redis_url if setting == "remote_url" else f"ipc://{tmp_path}/node.sock"
    with pytest.raises(ConfigError) as err:
        KVCacheEngine(_layout(8, 128, ""), kv_rig.make_config(**{setting: url}))
    text = str(err.value)
    assert "KVCONNECT_MODEL_NAME" in text and setting in text
    # a name from the configuration is enough (the Python API's way), and the private pool needs none
    for engine in (KVCacheEngine(_layout(8, 128, ""), kv_rig.make_config(remote_url=redis_url, model_name="org/m@r1")),
                   KVCacheEngine(_layout(8, 128, ""), kv_rig.make_config())):
        try:
            assert engine.store(kv_rig.tokens(1, TOKENS), kv_rig.block_table(engine.layout, TOKENS)) == TOKENS
        finally:
            engine.close()


def test_other_head_splits_of_equal_row_bytes_never_share_a_chunk(redis_url):
    """4 heads x 128 and 8 heads x 64 (both 1 KiB bf16 rows) under one model name: a miss on
    Redis; the same split in another process' engine reads every byte back."""
    names = ("same-name@r1",) * 3
    writer = KVCacheEngine(_layout(4, 128, names[0]), kv_rig.make_config(remote_url=redis_url))
    try:
        assert kv_rig.store_prompt(writer, 7, TOKENS) == TOKENS
        assert writer.storage.flush(30)
    finally:
        writer.close()
    other = KVCacheEngine(_layout(8, 64, names[1]), kv_rig.make_config(remote_url=redis_url))
    same = KVCacheEngine(_layout(4, 128, names[2]), kv_rig.make_config(remote_url=redis_url))
    try:
        assert other.layout.planes[0].row_bytes == same.layout.planes[0].row_bytes
        assert other.lookup(kv_rig.tokens(7, TOKENS)) == 0
        assert kv_rig.retrieve_prompt(other, 7, TOKENS) == 0
        assert same.lookup(kv_rig.tokens(7, TOKENS)) == TOKENS
        assert kv_rig.retrieve_prompt(same, 7, TOKENS) == TOKENS  # bytes checked against what was stored
        assert same.storage.tiers[0].stats().get_hits > 0
    finally:
        other.close()
        same.close()
