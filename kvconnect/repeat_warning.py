"""A WARNING for a condition that lasts: a cache server, Redis store or Mooncake master that
does not answer. Misconfiguration (a wrong URL or token, an absent master) must not look like
a cache that never hits: the first failure warns at once, then at most one line per
``interval_s`` while it lasts (with the count of failures since), and again at once after
the condition cleared and came back.

    down = RepeatingWarning(logger.warning)
    down.failed("kvconnect: cannot reach %s (%s)", url, exc)   # on each failure
    down.cleared()                                             # when it works again
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

DEFAULT_INTERVAL_S = 60.0


class RepeatingWarning:
    def __init__(self, log: Callable[..., Any], interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self._log = log
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last_s: Optional[float] = None  # when the last line was logged; None: condition not active
        self._suppressed = 0
        self.lines = 0  # lines logged (for tests and counters)

    def failed(self, message: str, *args: Any) -> bool:
        """Count a failure; log it if it is the first or ``interval_s`` passed. True if logged."""
        now = time.monotonic()
        with self._lock:
            if self._last_s is not None and now - self._last_s < self.interval_s:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last_s = self._suppressed, 0, now
            self.lines += 1
        if suppressed:
            message += f" ({suppressed} more failure(s) since the last warning)"
        self._log(message, *args)
        return True

    def cleared(self) -> None:
        """The condition ended: the next failure warns at once."""
        with self._lock:
            self._last_s, self._suppressed = None, 0
