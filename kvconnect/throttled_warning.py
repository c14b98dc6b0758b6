"""The one way kvconnect keeps a warning from flooding the log, in two shapes:

``RepeatingWarning``, for a condition that lasts: a cache server, Redis store or Mooncake
master that does not answer. Misconfiguration (a wrong URL or token, an absent master) must
not look like a cache that never hits: the first failure warns at once, then at most one line
per ``interval_s`` while it lasts (with the count of failures since), and again at once after
the condition cleared and came back.

    down = RepeatingWarning(logger.warning)
    down.failed("kvconnect: cannot reach %s (%s)", url, exc)   # on each failure
    down.cleared()                                             # when it works again

``OnceWarnings``, for a fact that does not change while the process runs (a setting ignored,
a fallback taken): each topic is warned about the first time it comes up, never again.

    once = OnceWarnings(logger.warning)
    once.warn("name:LMCACHE_X", "kvconnect: ignoring %s", "LMCACHE_X")

Imports nothing of kvconnect: any layer may use it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

DEFAULT_INTERVAL_S = 60.0
HELD_NOTE = " ({held} more failure(s) since the last warning)"


class RepeatingWarning:
    def __init__(self, log: Callable[..., Any], interval_s: float = DEFAULT_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic, held_note: str = HELD_NOTE) -> None:
        self._log = log
        self.interval_s = interval_s
        self._clock = clock  # injectable: a test drives the interval without sleeping
        self._held_note = held_note  # "{held}": the failures not logged since the last line
        self._lock = threading.Lock()
        self._last_s: Optional[float] = None  # when the last line was logged; None: condition not active
        self._suppressed = 0
        self.lines = 0  # lines logged (for tests and counters)

    def failed(self, message: str, *args: Any) -> bool:
        """Count a failure; log it if it is the first or ``interval_s`` passed. True if logged."""
        now = self._clock()
        with self._lock:
            if self._last_s is not None and now - self._last_s < self.interval_s:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last_s = self._suppressed, 0, now
            self.lines += 1
        if suppressed:
            message += self._held_note.format(held=suppressed)
        self._log(message, *args)
        return True

    def cleared(self) -> None:
        """The condition ended: the next failure warns at once."""
        with self._lock:
            self._last_s, self._suppressed = None, 0


class OnceWarnings:
    def __init__(self, log: Callable[..., Any]) -> None:
        self._log = log
        self._topics: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, topic: str, message: str, *args: Any) -> bool:
        """Log ``message`` the first time ``topic`` comes up. True if logged."""
        with self._lock:
            if topic in self._topics:
                return False
            self._topics.add(topic)
        self._log(message, *args)
        return True
