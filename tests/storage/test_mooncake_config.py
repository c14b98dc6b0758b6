"""Mooncake client settings: the URL, MOONCAKE_CONFIG_PATH, who contributes memory, and what
``kvconnect inspect`` says about it. No Mooncake needed."""

from __future__ import annotations

import json
import os

import pytest

from kvconnect.cli import main as cli_main
from kvconnect.config import Config
from kvconnect.errors import ConfigError
from kvconnect.storage.mooncake.config import DEFAULT_SEGMENT_BYTES, make_spec, parse_bytes, parse_master


def test_url_names_the_master():
    assert parse_master("mooncakestore://127.0.0.1:50051") == "127.0.0.1:50051"
    assert parse_master("MooncakeStore://master.local:7/") == "master.local:7"
    for bad in ("mooncakestore://127.0.0.1", "mooncakestore://:5", "mooncakestore://h:0", "mooncake://h:5",
                "mooncakestore://h:5/x"):
        with pytest.raises(ConfigError):
            parse_master(bad)


def test_sizes_accept_mooncake_spellings():
    assert parse_bytes(4096, "x") == 4096
    assert parse_bytes("4 GB", "x") == 4 << 30
    assert parse_bytes("512MB", "x") == 512 << 20
    assert parse_bytes("1.5gib", "x") == 3 << 29
    for bad in ("lots", "-1", True, "3 parsecs"):
        with pytest.raises(ConfigError):
            parse_bytes(bad, "x")


def test_defaults_and_file(tmp_path):
    url = "mooncakestore://127.0.0.1:50051"
    alone = make_spec(url, None, has_node_server=False)
    assert (alone.local_hostname, alone.metadata_server, alone.protocol) == ("127.0.0.1", "P2PHANDSHAKE", "tcp")
    assert alone.global_segment_bytes == DEFAULT_SEGMENT_BYTES and alone.local_buffer_bytes == 0
    assert make_spec(url, None, has_node_server=True).global_segment_bytes == 0  # the node server holds
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"local_hostname": "10.0.0.11", "protocol": "rdma", "device_name": "mlx5_0",
                                "global_segment_size": "2 GB", "local_buffer_size": 0,
                                "master_server_address": "10.9.9.9:1"}))
    spec = make_spec(url, str(path), has_node_server=True)
    assert spec.master_address == "127.0.0.1:50051"  # the URL wins
    assert (spec.local_hostname, spec.protocol, spec.device_name) == ("10.0.0.11", "rdma", "mlx5_0")
    assert spec.global_segment_bytes == 2 << 30  # given: contributed even with a node server
    path.write_text(json.dumps({"protocol": "carrier-pigeon"}))
    with pytest.raises(ConfigError, match="protocol"):
        make_spec(url, str(path), has_node_server=False)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        make_spec(url, str(path), has_node_server=False)
    with pytest.raises(ConfigError, match="cannot be read"):
        make_spec(url, str(tmp_path / "missing.json"), has_node_server=False)


def test_config_reads_mooncake_config_path_from_the_environment(tmp_path):
    config = Config.from_env({"LMCACHE_REMOTE_URL": "mooncakestore://127.0.0.1:1", "MOONCAKE_CONFIG_PATH": "/x.json"})
    assert config.remote_url == "mooncakestore://127.0.0.1:1" and config.mooncake_config_path == "/x.json"
    assert Config.from_dict({"mooncake_config_path": "/y.json"}).mooncake_config_path == "/y.json"


def test_inspect_prints_the_holder(monkeypatch, capsys):
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "mooncakestore://127.0.0.1:50051")
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("KVCONNECT_SERVER_URL", raising=False)
    assert cli_main(["inspect", "--preset", "dsv3", "--tokens", "32k", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mc = report["mooncake"]
    assert mc["master"] == "127.0.0.1:50051" and mc["engine_segment_bytes"] == DEFAULT_SEGMENT_BYTES
    assert mc["segments_needed_bytes"] >= report["tier_bytes"]
    monkeypatch.setenv("KVCONNECT_SERVER_URL", "ipc:///tmp/kvc.sock")
    assert cli_main(["inspect", "--preset", "dsv3", "--tokens", "32k"]) == 0
    out = capsys.readouterr().out
    assert "contributes 0 B" in out or "contributes 0" in out
    assert "the node server" in out


def test_each_mooncake_rpc_is_bounded_by_the_tier_timeout(monkeypatch):
    """Mooncake waits 30 s for a stalled master by default; kvconnect bounds each RPC by the
    tier's remote_timeout_s (at least 0.5 s) through Mooncake's MC_RPC_TIMEOUT_MS, unless the
    operator set it."""
    from kvconnect.storage.mooncake import config as mooncake_config

    for given, expected in ((1.0, "1000"), (3.5, "3500"), (0.1, "500")):
        monkeypatch.delenv("MC_RPC_TIMEOUT_MS", raising=False)
        mooncake_config._bind_transfer_engine(None, given)
        assert os.environ["MC_RPC_TIMEOUT_MS"] == expected
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "7000")
    mooncake_config._bind_transfer_engine(None, 1.0)
    assert os.environ["MC_RPC_TIMEOUT_MS"] == "7000"  # the operator's choice stays
