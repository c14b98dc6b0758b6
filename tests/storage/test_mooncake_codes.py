"""The one table of what a Mooncake return code means (kvconnect/storage/mooncake/codes.py).

Pure: the codes are Mooncake 0.3.13's ``ErrorCode`` values; the tests against a real master
(test_mooncake.py, test_mooncake_faults.py) meet them for real: -704 (evicted or never
written), -901 (a stalled master, MC_RPC_TIMEOUT_MS), -900, -800 (a dead segment owner),
-200 (full segments), -600 (a value larger than the buffer).
"""

from __future__ import annotations

import pytest

from kvconnect.storage.mooncake.codes import Meaning, Tally, meaning


@pytest.mark.parametrize("code,expected", [
    (0, Meaning.OK), (4096, Meaning.OK),
    (-704, Meaning.ABSENT), (-710, Meaning.ABSENT), (-712, Meaning.ABSENT),
    (-703, Meaning.IN_USE), (-706, Meaning.IN_USE), (-707, Meaning.IN_USE), (-714, Meaning.IN_USE),
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
