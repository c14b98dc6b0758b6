"""The Mooncake tier tests' rig: a master per test, a peer process holding a stored hybrid prompt, a reader engine.

Shared by test_mooncake, test_mooncake_faults and test_mooncake_leases. ``master`` and
``stored`` are pytest fixtures: a test module imports them by name to use them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mooncake_peer import HYBRID_CHUNK, hybrid_case, hybrid_engine, wait_connected
from support.mooncake_master import MooncakeMaster, client_env

HERE = Path(__file__).resolve().parent
SEED = 5
SEGMENT = 256 << 20


class Peer:
    """A mooncake_peer.py child process; ``result`` is its first JSON line."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: Mooncake's logs never block the peer
        self.proc = subprocess.Popen([sys.executable, str(HERE / "mooncake_peer.py"), *args], env=client_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            self.log.seek(0)
            raise AssertionError(f"peer {args} failed:\n{self.log.read()[-3000:]}")
        self.result = json.loads(line)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def master(tmp_path):
    with MooncakeMaster(tmp_path / "master") as m:
        yield m


@pytest.fixture
def stored(master):
    """A hybrid prompt stored by another engine process, which holds the segment."""
    peer = Peer("store-hybrid", master.address, str(SEGMENT), str(SEED))
    assert peer.result["connected"] and peer.result["flushed"], peer.result
    # 3 prefix parts plus the window pieces of the restore point at the prompt's end, each an object
    # of its own in Mooncake (kvconnect/restore/parts.py)
    assert peer.result["window_pieces"] > 0
    assert peer.result["stored"] == 3 * HYBRID_CHUNK and peer.result["written"] == 3 + peer.result["window_pieces"]
    yield peer
    peer.kill()


def reader(master, tmp_path, *, model: str = "", segment: int = 0, timeout_s: float = 5.0):
    """An engine in this process with an empty pool whose tier contributes ``segment`` bytes."""
    case, tokens, bounds, src_tables, rng = hybrid_case(SEED)
    dst = case.clone(fill=0)
    engine = hybrid_engine(dst, master.url, segment, str(tmp_path), model=model, timeout_s=timeout_s)
    assert wait_connected(engine.storage.tiers[0])
    return case, dst, engine, tokens, bounds, src_tables, rng


def tier_of(engine):
    return engine.storage.tiers[0]
