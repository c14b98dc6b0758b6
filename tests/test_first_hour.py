"""What a newcomer hits in the first hour: misconfiguration is a WARNING, not silent zero hits
(a cache server that does not answer or refuses the token, a Redis store that is down, an
absent Mooncake master), and ``kvconnect info`` says the token may be wrong."""

from __future__ import annotations

import logging
import time

import pytest

from kvconnect.cli import main as cli_main
from kvconnect.throttled_warning import RepeatingWarning
from kvconnect.server.client import SharedPoolClient
from kvconnect.storage.mooncake import config as mooncake_config
from kvconnect.storage.mooncake.config import connect_store

from support.server_rig import server_thread, socket_dir


def test_repeating_warning_first_at_once_then_once_per_interval():
    lines: list[str] = []
    w = RepeatingWarning(lambda msg, *a: lines.append(msg % a), interval_s=0.2)
    assert w.failed("down %s", "x") and lines == ["down x"]
    assert not w.failed("down %s", "x") and not w.failed("down %s", "x")  # within the interval: counted only
    time.sleep(0.25)
    assert w.failed("down %s", "x") and lines[-1] == "down x (2 more failure(s) since the last warning)"
    w.cleared()
    assert w.failed("down again") and lines[-1] == "down again" and w.lines == 3


def test_a_wrong_server_token_is_a_warning_that_names_the_token(caplog):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", token="right") as server:
        client = SharedPoolClient(server.url, 4096, token="wrong", timeout_s=0.3)
        try:
            assert not client.connected
        finally:
            client.close()
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "kvconnect server:" not in r.getMessage()]
        assert len(warned) == 1 and "KVCONNECT_SERVER_TOKEN" in warned[0] and server.url in warned[0], warned
        assert any("bad or missing token" in r.getMessage() for r in caplog.records)  # and the server's side says so
        caplog.clear()
        client = SharedPoolClient(server.url, 4096, token="right", timeout_s=0.3)
        try:
            assert client.connected and not [r for r in caplog.records if r.levelno >= logging.WARNING]
        finally:
            client.close()


def test_no_server_at_the_url_is_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="kvconnect")
    with socket_dir() as d:
        client = SharedPoolClient(f"ipc://{d}/nobody.sock", 4096, timeout_s=0.2)
        client.close()
    assert any("no answer from the cache server" in r.getMessage() for r in caplog.records)


def test_info_without_the_token_says_the_token_may_be_wrong(capsys):
    with socket_dir() as d, server_thread(f"ipc://{d}/kvc.sock", token="secret") as server:
        assert cli_main(["info", "--url", server.url, "--timeout-s", "0.3"]) == 1
        err = capsys.readouterr().err
        assert "no token was given" in err and "KVCONNECT_SERVER_TOKEN" in err
        assert cli_main(["info", "--url", server.url, "--timeout-s", "0.3", "--token", "nope"]) == 1
        assert "is the token the server's" in capsys.readouterr().err
        assert cli_main(["info", "--url", server.url, "--token", "secret"]) == 0
        out = capsys.readouterr().out
        assert "(LRU)" not in out and "KVCONNECT_EVICTION" in out  # the server's policy, not a hard-coded name


def test_info_on_a_socket_that_does_not_exist_says_no_server_runs_there(capsys):
    """A missing socket is not a token problem: info says there is no socket (not 'is the token ...')."""
    with socket_dir() as d:
        assert cli_main(["info", "--url", f"ipc://{d}/nothing.sock", "--timeout-s", "0.3", "--token", "x"]) == 1
        err = capsys.readouterr().err
        assert "there is no socket at" in err and "kvconnect server --url" in err and "token" not in err


def test_an_absent_mooncake_master_is_a_warning():
    """connect_store probes the master; while nobody listens it warns once (then once a minute)."""
    lines: list[str] = []
    polls = iter(range(5))
    spec = mooncake_config.make_spec("mooncakestore://127.0.0.1:1", None, has_node_server=False)
    store = connect_store(spec, object, lambda s: next(polls) >= 3, lines.append)
    assert store is None
    assert len(lines) == 1 and "no Mooncake master listens at 127.0.0.1:1" in lines[0]


def test_a_redis_store_that_is_down_warns_once_then_per_interval(caplog):
    pytest.importorskip("redis")
    from kvconnect.layout.spec import ChunkKey, Fingerprint
    from kvconnect.storage.redis_tier import RedisTier

    caplog.set_level(logging.WARNING, logger="kvconnect")
    tier = RedisTier("redis://127.0.0.1:1/0", Fingerprint(b"\0" * 16), timeout_s=0.3, retry_after_s=0.0)
    for _ in range(3):
        assert tier.masks([ChunkKey(b"\1" * 16)]) == [None]
    tier.close()
    warned = [r.getMessage() for r in caplog.records if "remote tier" in r.getMessage()]
    assert len(warned) == 1 and "misses until it answers" in warned[0], warned


# -- small defects of the first hour ------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_inspect_refuses_a_tp_that_does_not_split_the_heads(capsys):
    assert cli_main(["inspect", "--preset", "llama-3.1-8b", "--tp", "3"]) == 2  # 8 KV heads
    assert "tensor parallel size 3" in capsys.readouterr().err
    assert cli_main(["inspect", "--preset", "llama-3.1-8b", "--tp", "16", "--json"]) == 0  # replicated heads: allowed
    capsys.readouterr()


def test_inspect_default_restore_point_is_what_128k_means(capsys):
    assert cli_main(["inspect", "--preset", "llama-3.1-8b", "--tokens", "1M", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert cli_main(["inspect", "--preset", "llama-3.1-8b", "--tokens", "1M", "--restore-at", "128k", "--json"]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert default["restore_asked"] == explicit["restore_asked"] == 128_000


def test_inspect_into_a_closed_pipe_has_no_traceback():
    """`| true` exits before the CLI writes (`| head` does the same once its lines are read)."""
    out = subprocess.run(["bash", "-c", f"{sys.executable} -m kvconnect.cli inspect --preset deepseek-v4-flash --json "
                          "| true; echo ${PIPESTATUS[0]}"], capture_output=True, text=True, env=_env(), timeout=120)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.stdout.strip() in ("0", "141")  # 0 when the write won the race with the reader's exit


def test_tiers_benchmark_refuses_an_unknown_tier_before_benchmarking():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tiers.py"), "--tiers", "pool,server"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 2 and "unknown tier(s) 'server'" in out.stderr and "server_bench.py" in out.stderr
    assert "tiers benchmark:" not in out.stdout  # nothing was run first


def test_trace_replay_refuses_a_pool_past_free_memory_before_allocating(tmp_path):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]}) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_replay.py"), "--trace", str(trace),
                          "--pool-gb", "1,1e8", "--configs", "today,0"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr
    assert "--pool-gb 1e+08" in out.stderr and "of host memory" in out.stderr and "smaller --pool-gb" in out.stderr
    assert "pool 1 GB" not in out.stdout  # nothing was replayed first
