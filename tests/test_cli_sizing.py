"""``kvconnect inspect`` / ``bench`` and kvconnect.sizing: figures equal what a real engine
stores and loads for the same layout; bad input is a typed error and exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvconnect import KVCacheEngine, sizing
from kvconnect.integrations import presets
from kvconnect.cli import main
from kvconnect.config import GB, Config
from kvconnect.errors import ConfigError, LayoutError

# (preset, layers, engine, chunk, tokens, restore at, extra preset arguments)
CASES = [
    ("llama-3.1-8b", 2, "vllm", 64, 320, 192, {}),
    ("llama-3.1-8b", 2, "vllm", 64, 320, 192, {"tp": 4}),
    ("deepseek-v3", 2, "vllm-ascend", 64, 256, 192, {}),
    ("deepseek-v3", 2, "vllm", 128, 512, 384, {"dcp": (2, 8)}),
    ("deepseek-v3.2", 2, "vllm", 64, 256, 128, {}),
    ("deepseek-v4-flash", 4, "vllm", 256, 1024, 768, {}),
    ("gemma-3-27b", 6, "vllm", 64, 512, 448, {"block_size": 16}),
]


def _model(name, layers, engine, extra):
    kw = dict(extra)
    if "dcp" in kw:
        from kvconnect.layout.spec import DCPSpec

        size, interleave = kw.pop("dcp")
        kw["dcp"] = DCPSpec(rank=0, size=size, interleave_tokens=interleave)
    return presets.preset(name, layers=layers, engine=engine, **kw)


@pytest.mark.parametrize("name, layers, engine, chunk, tokens, restore_at, extra", CASES)
def test_sizing_equals_a_real_store_and_restore(name, layers, engine, chunk, tokens, restore_at, extra):
    model = _model(name, layers, engine, extra)
    layout = model.layout(tokens, fill=True)
    s = sizing.of(layout, chunk)
    pool_gb = (s.pool_bytes(tokens) + s.slot_bytes) / GB
    tables = [list(range(n - 1)) for n in model.blocks_for(tokens)]
    # whole chunks (interval 0): what ``sizing.of`` describes; restore points' figures are
    # checked against real stores in tests/test_restore_points.py
    src = KVCacheEngine(layout, Config(chunk_size=chunk, max_local_cpu_size=pool_gb, num_threads=2, restore_interval_tokens=0))
    dst = KVCacheEngine(model.layout(tokens), Config(chunk_size=chunk, max_local_cpu_size=pool_gb, num_threads=2,
                                                     restore_interval_tokens=0))
    try:
        ids = np.arange(tokens, dtype=np.int64) + 11
        assert src.store(ids, tables) == tokens
        assert src.stats.stored_bytes == s.stored_bytes(tokens)
        assert src.stats.stored_chunks == s.num_chunks(tokens)
        assert src.pool.stats().used_slots * src.pool.slot_bytes == s.pool_bytes(tokens)
        assert src.pool.slot_bytes == s.slot_bytes
        exported = [src.storage.export_chunk(c.key) for c in src.chunks(ids, include_partial=False)]
        assert sum(len(b) for b in exported) == s.encoded_bytes(tokens)  # what disk / remote hold
        for c, blob in zip(src.chunks(ids, include_partial=False), exported):
            assert dst.storage.import_chunk(blob, c.key)
        assert dst.retrieve(ids[:restore_at], tables) == restore_at
        assert dst.stats.retrieved_bytes == s.restore_bytes(restore_at)
        if s.groups and all(g.window_tokens is None for g in s.groups):
            assert s.bytes_per_chunk == s.stored_bytes(chunk)
    finally:
        src.close()
        dst.close()


def test_inspect_json_matches_sizing(capsys):
    assert main(["inspect", "--preset", "deepseek-v4-flash", "--tokens", "1M", "--restore-at", "100000", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    s = sizing.of(presets.preset("deepseek-v4-flash").layout(0), 256)
    assert r["bytes_per_chunk"] == s.bytes_per_chunk == sum(g["bytes_per_chunk"] for g in r["groups"])
    assert r["whole_chunk_stored_bytes"] == s.stored_bytes(1_000_000) and r["whole_chunk_pool_bytes"] == s.pool_bytes(1_000_000)
    # one pool size: the restore points' (the engine's default), the same as the per-token figure
    assert r["restore_points_sized"] and r["pool_bytes"] == int(r["restore_points"]["pool_bytes_per_token"] * 1_000_000)
    assert r["pool_bytes"] < r["whole_chunk_pool_bytes"] and r["stored_bytes"] < r["whole_chunk_stored_bytes"]
    assert r["restore_at"] == 99_840 and r["restore_bytes"] == s.restore_bytes(99_840) == sum(g["restore_bytes"] for g in r["groups"])
    assert [g["name"] for g in r["groups"]] == list(presets.DSV4_GROUPS)
    assert 16.4e6 < r["bytes_per_chunk"] < 16.6e6  # 16.5 MB per 256-token chunk, as measured in the layout notes


def test_inspect_human_and_state_models(capsys):
    assert main(["inspect", "--preset", "llama", "--tokens", "32k"]) == 0
    out = capsys.readouterr().out
    assert "32,000 tokens" in out and "CPU pool" in out and "restore at P=" in out
    assert main(["inspect", "--preset", "qwen3-next", "--json", "--engine", "sglang"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["supported"] is False and r["stored_bytes"] == 0 and r["restore_bytes"] == 0 and r["state_layers"] == 36
    assert any("state after exactly P" in n for n in r["notes"])
    assert r["snapshot"]["bytes"] == 36 * r["state_bytes_per_layer"] and r["snapshot"]["stored"] is False
    assert main(["inspect", "--preset", "qwen3-next", "--json"]) == 0  # vLLM stores snapshots (issue 28)
    r = json.loads(capsys.readouterr().out)
    assert r["supported"] is True and r["snapshot"]["stored"] is True and r["stored_bytes"] > 0


def test_inspect_from_hf_config(tmp_path, capsys):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", "--config", str(tmp_path), "--json"]) == 0
    from_config = json.loads(capsys.readouterr().out)
    assert main(["inspect", "--preset", "llama-3.1-8b", "--json"]) == 0
    from_preset = json.loads(capsys.readouterr().out)
    assert from_config["bytes_per_chunk"] == from_preset["bytes_per_chunk"] == 32 * 2 * 8 * 128 * 2 * 256
    gemma = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 12,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2560,
             "sliding_window": 1024, "sliding_window_pattern": 6}, "torch_dtype": "bfloat16"}
    m = presets.from_hf_config(gemma)
    assert [g.window_tokens for g in m.groups] == [None, 1024] and sum(c.group == 0 for c in m.caches) == 2
    dsv32 = {"model_type": "deepseek_v32", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
             "num_attention_heads": 128, "index_topk": 2048, "torch_dtype": "bfloat16"}
    assert sizing.of(presets.from_hf_config(dsv32).layout(0), 256).bytes_per_chunk == 61 * (1152 + 132) * 256


@pytest.mark.parametrize("argv, message", [
    (["inspect", "--preset", "no-such-model"], "unknown preset"),
    (["inspect", "--preset", "llama", "--tokens", "lots"], "not a token count"),
    (["inspect", "--preset", "llama", "--tokens", "0"], "positive"),
    (["inspect", "--preset", "llama", "--chunk-size", "-1"], "--chunk-size"),
    (["inspect", "--preset", "deepseek-v4-flash", "--chunk-size", "100"], "chunk"),
    (["inspect", "--preset", "llama", "--dcp", "2"], "decode context parallel"),
    (["inspect", "--preset", "deepseek-v4-flash", "--engine", "sglang"], "vLLM"),
    (["inspect", "--config", "/nonexistent/config.json"], "cannot read"),
    (["bench", "--preset", "qwen3-next", "--layers", "4", "--engine", "sglang"], "recurrent state"),
    (["bench", "--preset", "llama", "--layers", "1", "--tokens", "16"], "at least one chunk"),
    (["bench", "--preset", "llama", "--device", "tpu"], "--device"),
])
def test_bad_input_exits_2_with_a_typed_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"kvconnect {argv[0]}:")


def test_bad_config_json_is_a_typed_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["inspect", "--config", str(tmp_path)]) == 2
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        presets.from_hf_config({"model_type": "llama", "num_attention_heads": 8, "hidden_size": 64})
    with pytest.raises(ConfigError):
        presets.from_hf_config(["not", "a", "mapping"])
    with pytest.raises(LayoutError):
        sizing.of(presets.preset("deepseek-v4-flash", layers=4).layout(0), 100)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["inspect"])  # neither --preset nor --config
    assert exc.value.code == 2


def test_bench_runs_and_reports(capsys):
    assert main(["bench", "--preset", "llama", "--layers", "1", "--tokens", "512", "--repeats", "1", "--threads", "1",
                 "--device", "cpu", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    ops = {o["op"]: o for o in r["ops"]}
    assert ops["store (gather)"]["bytes"] == 512 * 2 * 8 * 128 * 2 and ops["store (gather)"]["chunks"] == 2
    assert all(o["best_s"] > 0 for o in r["ops"])


@pytest.mark.parametrize("preset,layers,tokens", [("deepseek-v4-flash", 4, 8192), ("qwen3.5-27b", 4, 1024),
                                                  ("llama", 1, 512)])
def test_bench_bytes_are_what_the_pool_received(capsys, preset, layers, tokens):
    """With restore points a store writes prefix parts and window parts: bench reports those
    bytes (what the pool holds after one store), and the plain copy moves the same bytes."""
    assert main(["bench", "--preset", preset, "--layers", str(layers), "--tokens", str(tokens), "--repeats", "1",
                 "--threads", "1", "--device", "cpu", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    ops = {o["op"]: o for o in r["ops"]}
    model = presets.preset(preset, layers=layers)
    layout = model.layout(tokens, fill=True)
    s = sizing.of(layout, r["chunk_tokens"])
    engine = KVCacheEngine(layout, Config(chunk_size=r["chunk_tokens"], max_local_cpu_size=(s.pool_bytes(tokens) + s.slot_bytes) / GB,
                                          num_threads=1))
    try:
        tables = [list(range(n - 1)) for n in model.blocks_for(tokens)]
        assert engine.store(np.arange(tokens, dtype=np.int64), tables) == tokens
        received = sum(e.header.payload_bytes for e in engine.pool._entries.values())
        restored_before = engine.stats_snapshot()["retrieved_bytes"]
        assert engine.retrieve(np.arange(tokens, dtype=np.int64), tables) == tokens
        loaded = engine.stats_snapshot()["retrieved_bytes"] - restored_before
    finally:
        engine.close()
    assert ops["store (gather)"]["bytes"] == received == ops["plain copy, same bytes"]["bytes"]
    assert ops["retrieve (scatter)"]["bytes"] == loaded
    assert r["whole_chunk_bytes"] == s.stored_bytes(tokens)
    if preset != "llama":  # restore points: parts, less than whole chunks
        assert received < r["whole_chunk_bytes"]


def test_bench_refuses_a_run_larger_than_available_memory_before_allocating():
    """qwen3.5-27b at 4096 tokens needs ~45 GiB (its 64 layers' recurrent-state blocks): more than
    a CI host has free. The refusal names the bytes and the --layers that fit."""
    import resource

    from kvconnect.cli import bench
    from kvconnect.storage import host_memory

    model = presets.preset("qwen3.5-27b")
    need = bench.needed_bytes(model, 4096, 256)
    room = host_memory.host_room()
    if room[0] is None or sum(need.values()) <= room[0] * bench.FIT_FRACTION:
        pytest.skip(f"this host has {room[0]} bytes free: the full preset would fit")
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with pytest.raises(ConfigError) as err:
        bench.check_fits(model, 4096, 256, "cpu", with_layers=lambda n: presets.preset("qwen3.5-27b", layers=n), host_room=room)
    text = str(err.value)
    assert "qwen3.5-27b" in text and "--layers" in text and "host memory" in text and "GiB" in text
    assert main(["bench", "--preset", "qwen3.5-27b", "--no-progress", "--device", "cpu"]) == 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before < need["caches"] // 4  # nothing allocated
    fit = int(text.split("--layers ")[1].split()[0])
    smaller = presets.preset("qwen3.5-27b", layers=fit)
    assert bench.check_fits(smaller, 4096, 256, "cpu", host_room=room)  # the advice fits
