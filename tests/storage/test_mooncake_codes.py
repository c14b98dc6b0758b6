"""The one table of what a Mooncake return code means (kvconnect/storage/mooncake/codes.py).

Pure: the codes are Mooncake 0.3.13's ``ErrorCode`` values; the tests against a real master
(test_mooncake.py, test_mooncake_faults.py) meet them for real: -704 (evicted or never
written), -901 (a stalled master, MC_RPC_TIMEOUT_MS), -900, -800 (a dead segment owner),
-200 (full segments), -600 (a value larger than the buffer); here, -601 from two clients
upserting the same keys at once (a real master).
"""

from __future__ import annotations

import pytest

from kvconnect.storage.mooncake.codes import Meaning, Tally, meaning


@pytest.mark.parametrize("code,expected", [
    (0, Meaning.OK), (4096, Meaning.OK),
    (-704, Meaning.ABSENT), (-710, Meaning.ABSENT), (-712, Meaning.ABSENT),
    (-601, Meaning.IN_USE), (-703, Meaning.IN_USE), (-706, Meaning.IN_USE), (-707, Meaning.IN_USE), (-714, Meaning.IN_USE),
    (-200, Meaning.NO_SPACE), (-600, Meaning.NOT_FITTING),
    (-800, Meaning.TRANSFER), (-801, Meaning.TRANSFER),
    (-900, Meaning.RPC), (-1000, Meaning.RPC), (-1010, Meaning.RPC),
    (-901, Meaning.TIMEOUT), (-902, Meaning.TIMEOUT),
    (-1, Meaning.OTHER), (-700, Meaning.OTHER), (-705, Meaning.OTHER), (-1100, Meaning.OTHER),
])
def test_each_code_has_one_meaning(code, expected):
    assert meaning(code) is expected


def test_only_transport_and_timeout_codes_are_breaker_events():
    assert {m for m in Meaning if m.breaks} == {Meaning.TRANSFER, Meaning.RPC, Meaning.TIMEOUT}
    tally = Tally.of([0, 4096, -704, -901, -901, -200])
    assert tally.broke and tally.failures == 3
    assert tally.counter_deltas() == {"rpc_timeouts": 2, "no_space": 1}
    quiet = Tally.of([0, -704, -706])
    assert not quiet.broke and quiet.counter_deltas() == {"lease_conflicts": 1}


def test_concurrent_upserts_are_in_use_not_unknown(tmp_path):
    """Two clients upserting the same keys at once (two engines storing one chunk): Mooncake
    answers one of them -601 (ILLEGAL_CLIENT), which is a write in flight elsewhere (IN_USE,
    counted in lease_conflicts), not an unknown code; the other write lands whole."""
    import os
    import threading

    import numpy as np

    from support.mooncake_master import MooncakeMaster, client_env, mooncake_available

    if mooncake_available() is not None:
        pytest.skip(mooncake_available())
    os.environ.update({k: v for k, v in client_env().items() if k.startswith(("MC_", "GLOG_"))})
    from kvconnect.storage.mooncake.config import MooncakeSpec, import_store

    with MooncakeMaster(tmp_path) as master:
        clients = []
        for _ in range(2):
            store = import_store(MooncakeSpec(master_address=master.address))()
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 128 << 20, 0, "tcp", "", master.address) == 0
            clients.append(store)
        data = [np.full(4 << 20, i + 1, dtype=np.uint8) for i in range(2)]
        for store, d in zip(clients, data):
            assert store.register_buffer(d.ctypes.data, d.nbytes) == 0
        out = np.zeros(1 << 20, dtype=np.uint8)
        assert clients[0].register_buffer(out.ctypes.data, out.nbytes) == 0
        codes: list[int] = []
        for trial in range(12):
            keys = [f"race/{trial}/{j}" for j in range(4)]
            start = threading.Barrier(2)

            def put(store, d):
                start.wait()
                codes.extend(store.batch_upsert_from(keys, [d.ctypes.data + j * (1 << 20) for j in range(4)],
                                                     [1 << 20] * 4))

            threads = [threading.Thread(target=put, args=pair) for pair in zip(clients, data)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            (got,) = clients[0].batch_get_into([keys[0]], [out.ctypes.data], [out.nbytes])
            assert got == out.nbytes and len(set(out[:: 4096].tolist())) == 1  # one writer's bytes, whole
        for store in clients:
            store.close()
    assert -601 in codes  # the race happened (about every other trial on a 2-core VM, 12 trials)
    assert {meaning(c) for c in codes} <= {Meaning.OK, Meaning.IN_USE}
    assert "unknown_codes" not in Tally.of(codes).counter_deltas()
    assert Tally.of(codes).counter_deltas().get("lease_conflicts", 0) == codes.count(-601)
