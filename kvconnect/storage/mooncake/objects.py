"""What the Mooncake tier's lookups, writes and reads share: its objects in the store.

``MooncakeObjects`` is one per tier, built by ``MooncakeTier`` and handed to its reader
(``reads.MooncakeReader``). It owns:

- the object names (``names``: ``kvc/<fingerprint>/<key>/h`` and ``/p``);
- the connection (``link``: a ``MooncakeLink``, its breaker and in-flight count);
- what return codes mean (``judge``), which feeds the failure counters (``counters``, by kind,
  exported as ``kvconnect_tier_failures_total``) and the breaker; ``go_on``, whether a batched
  call may start its next batch;
- the group masks this process has seen per key (``remember`` / ``seen_masks``), so lookups
  skip re-reading headers;
- forced removes of both parts of a chunk (``remove``);
- the registered regions: the pools whose buffers are registered with the store on first use
  (``attach_pool`` / ``registered``).

The tier's own ``TierStats`` counters stay the tier's (``LowerTier``): this object is given the
function that counts them (``count``), nothing else of its host.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional, Sequence

from ...layout.spec import ChunkKey, Fingerprint
from .codes import Meaning, Tally, meaning
from .config import MooncakeSpec
from .link import MooncakeLink

KNOWN_MASKS = 1 << 16  # group masks remembered per process (lookups skip re-reading those headers)
FAILURE_KINDS = ("rpc_failures", "rpc_timeouts", "timeouts", "transfer_failures", "lease_conflicts", "no_space",
                 "values_not_fitting", "unknown_codes", "parts_missing", "half_written", "cut_short",
                 "short_reads", "reads_abandoned", "reads_refused")


class MooncakeObjects:
    def __init__(self, spec: MooncakeSpec, fingerprint: Fingerprint, *, count: Callable[..., None],
                 adopt: Callable[[object], bool], timeout_s: float, retry_after_s: float,
                 max_retry_after_s: float) -> None:
        """``count``: the tier's TierStats counter (``LowerTier._count``); ``adopt``: called
        with each new store connection (registers the tier's scratch buffers)."""
        self.fingerprint = fingerprint
        self.count = count
        self._prefix = "kvc/" + bytes(fingerprint).hex() + "/"
        self.link = MooncakeLink(spec, name="tier", timeout_s=timeout_s, retry_after_s=retry_after_s,
                                 max_retry_after_s=max_retry_after_s, adopt=adopt)
        self.counters = {name: 0 for name in FAILURE_KINDS}
        self.counters["registered_bytes"] = 0
        self._counters_lock = threading.Lock()
        self._known: "collections.OrderedDict[ChunkKey, int]" = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []  # (address, bytes) registered with the store
        self._regions_lock = threading.Lock()
        self._pools: list = []  # pools whose buffers are registered on first use

    # -- names and counters ------------------------------------------------------------
    def names(self, key: ChunkKey) -> tuple[str, str]:
        """The header and payload object names of ``key``."""
        base = self._prefix + bytes(key).hex()
        return base + "/h", base + "/p"

    def bump(self, name: str, delta: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += delta

    def counter_values(self) -> dict[str, int]:
        with self._counters_lock:
            return dict(self.counters)

    # -- codes and the breaker -----------------------------------------------------------
    def judge(self, codes: Sequence[int]) -> list[Meaning]:
        """The meaning of each code of one call; feeds the counters and the breaker."""
        tally = Tally.of(codes)
        if tally.broke:
            self.link.failure()
        elif codes:
            self.link.success()
        deltas = tally.counter_deltas()
        if deltas:
            with self._counters_lock:
                for name, n in deltas.items():
                    self.counters[name] += n
        return [meaning(c) for c in codes]

    def go_on(self, deadline: float) -> bool:
        """Whether a batched call may start its next batch (time left, breaker closed)."""
        if time.monotonic() < deadline and self.link.breaker.allow():
            return True
        self.bump("cut_short")
        return False

    # -- masks seen ----------------------------------------------------------------------
    def remember(self, key: ChunkKey, mask: Optional[int]) -> None:
        """Note (or, with None, forget) the group mask stored under ``key``; bounded, oldest out."""
        with self._known_lock:
            if mask is None:
                self._known.pop(key, None)
                return
            self._known[key] = mask
            self._known.move_to_end(key)
            while len(self._known) > KNOWN_MASKS:
                self._known.popitem(last=False)

    def seen_masks(self, keys: Sequence[ChunkKey], exist: Sequence[int]) -> list[Optional[int]]:
        """The masks seen of the keys present (``exist`` 1); keys found absent are forgotten."""
        with self._known_lock:
            out = [self._known.get(k) if e == 1 else None for k, e in zip(keys, exist)]
            for k, e in zip(keys, exist):
                if e == 0:
                    self._known.pop(k, None)
        return out

    # -- removes -------------------------------------------------------------------------
    def remove(self, store, keys: Sequence[ChunkKey]) -> list[bool]:
        """Forced removes (a lease never blocks a delete) of both parts, in one call; True where
        a header was there."""
        if not keys:
            return []
        for key in keys:
            self.remember(key, None)
        names = [self.names(k) for k in keys]
        codes = store.batch_remove([h for h, _ in names] + [p for _, p in names], True)
        self.judge([c for c in codes if meaning(c) is not Meaning.ABSENT])
        return [code == 0 for code in codes[: len(keys)]]

    # -- registered memory -----------------------------------------------------------------
    def attach_pool(self, pool) -> None:
        """Register ``pool.buffer`` (a private pool or the node server's mapping) on first use."""
        self._pools.append(pool)

    def detach_pools(self) -> None:
        self._pools.clear()

    def registered(self, store, address: int, nbytes: int) -> bool:
        """Make sure [address, address + nbytes) is registered; registers a pool's whole buffer once."""
        with self._regions_lock:
            if any(start <= address and address + nbytes <= start + size for start, size in self._regions):
                return True
        for pool in self._pools:
            buffer = getattr(pool, "buffer", None)
            if buffer is None or buffer.numel() == 0:
                continue
            start, size = buffer.data_ptr(), buffer.numel()
            if start <= address and address + nbytes <= start + size:
                return self._register(store, start, size)
        return False

    def _register(self, store, start: int, size: int) -> bool:
        if store.register_buffer(start, size) != 0:
            self.count(errors=1)
            return False
        with self._regions_lock:
            self._regions.append((start, size))
        self.bump("registered_bytes", size)
        return True
