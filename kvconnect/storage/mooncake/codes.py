"""What a Mooncake Store return code means to kvconnect: the one place that decides it.

Mooncake's Python binding returns one integer per key: a length (reads) or 0 (writes,
removes) on success, else a negative ``ErrorCode`` (Mooncake ``types.h``). kvconnect sorts
each into a ``Meaning``; every tier call (lookups, reads, writes, removes) and the counters
read it from here.

| code                          | meaning   | what the tier does |
|-------------------------------|-----------|--------------------|
| >= 0                          | OK        | use the bytes (reads still verify them) |
| -704 object not found, -710 replica not found, -712 replica gone | ABSENT | a miss; a chunk with one part absent is removed whole (its other part is useless) |
| -703 replica not ready, -706 lease, -707 lease expired, -708, -714 (a write or replication in flight), -601 ILLEGAL_CLIENT (another client's upsert of the same key is in flight: two engines storing one chunk at once) | IN_USE | a miss or a failed write, counted; never removed (the other write lands) |
| -200 no available handle (the segments are full) | NO_SPACE | a failed write, counted; not a breaker event (the master answered) |
| -600 buffer too small / invalid params | NOT_FITTING | a miss, counted; never removed (no bytes were read) |
| -800..-899 transfer (a segment owner gone) | TRANSFER | a miss, counted, a breaker event |
| -900 RPC failed               | RPC       | a miss, counted, a breaker event |
| -901 RPC timed out (``MC_RPC_TIMEOUT_MS``), -902.. | TIMEOUT | a miss, counted, a breaker event |
| -1000..-1099 master HA states | RPC       | as RPC |
| anything else                 | OTHER     | a miss, counted as an error; never removed |

The rule behind it: only bytes that were read and failed verification may cause a delete
(``tier``, ``reads``); no code ever does, because a code says nothing about the value
another engine may be reading. A value that is absent is the one exception, and only for
the other half of the same chunk.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

NO_AVAILABLE_HANDLE = -200
NOT_FOUND = -704
ABSENT_CODES = (NOT_FOUND, -710, -712)
ILLEGAL_CLIENT = -601  # Mooncake's answer to an upsert while another client's put of the key is in flight
IN_USE_CODES = (ILLEGAL_CLIENT, -703, -706, -707, -708, -714)
BUFFER_TOO_SMALL = -600
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901


class Meaning(enum.Enum):
    OK = "ok"
    ABSENT = "absent"
    IN_USE = "in_use"
    NO_SPACE = "no_space"
    NOT_FITTING = "not_fitting"
    TRANSFER = "transfer"
    RPC = "rpc"
    TIMEOUT = "timeout"
    OTHER = "other"

    @property
    def breaks(self) -> bool:
        """Whether this is a transport or timeout failure (a breaker event)."""
        return self in (Meaning.TRANSFER, Meaning.RPC, Meaning.TIMEOUT)


def meaning(code: int) -> Meaning:
    """The Meaning of one return code."""
    if code >= 0:
        return Meaning.OK
    if code in ABSENT_CODES:
        return Meaning.ABSENT
    if code in IN_USE_CODES:
        return Meaning.IN_USE
    if code == NO_AVAILABLE_HANDLE:
        return Meaning.NO_SPACE
    if code == BUFFER_TOO_SMALL:
        return Meaning.NOT_FITTING
    if -899 <= code <= -800:
        return Meaning.TRANSFER
    if code == RPC_FAIL or -1099 <= code <= -1000:
        return Meaning.RPC
    if -999 <= code <= -901:
        return Meaning.TIMEOUT
    return Meaning.OTHER


# the counters (MooncakeTier.counters) each meaning adds to; OK and ABSENT count nothing here
COUNTER_OF = {Meaning.IN_USE: "lease_conflicts", Meaning.NO_SPACE: "no_space", Meaning.NOT_FITTING: "values_not_fitting",
              Meaning.TRANSFER: "transfer_failures", Meaning.RPC: "rpc_failures", Meaning.TIMEOUT: "rpc_timeouts",
              Meaning.OTHER: "unknown_codes"}


@dataclass(frozen=True)
class Tally:
    """The meanings of one call's codes: what to count and whether the breaker hears of it."""

    counts: dict

    @classmethod
    def of(cls, codes: Iterable[int]) -> "Tally":
        counts: dict = {}
        for code in codes:
            m = meaning(code)
            counts[m] = counts.get(m, 0) + 1
        return cls(counts)

    @property
    def broke(self) -> bool:
        """Some code was a transport or timeout failure."""
        return any(m.breaks for m in self.counts)

    @property
    def failures(self) -> int:
        """Codes that were neither OK nor ABSENT (each an error in TierStats)."""
        return sum(n for m, n in self.counts.items() if m not in (Meaning.OK, Meaning.ABSENT))

    def counter_deltas(self) -> dict:
        return {COUNTER_OF[m]: n for m, n in self.counts.items() if m in COUNTER_OF}
