"""Have SGLang build its page-hash extension while the engine starts, not on its prefetch thread.

SGLang 0.5.23 computes HiCache storage page keys with a C++ extension (``hicache_hash_cpp``,
``sglang/srt/mem_cache/cpp_utils/native_hash.py``) that ``torch.utils.cpp_extension.load``
JIT-builds on its first use in each process, under a file lock shared by every process on
the machine. The first use is usually the storage prefetch thread's first hit query
(``_storage_hit_query`` -> ``get_storage_hash_str``). When the build directory is cold (a new
machine or CI runner, a changed torch path, another checkout of the same venv) the build
takes 6-7 s on an idle 2-core machine and over 10 s at load 6-8 (measured,
``benchmarks/sglang_flush_load.py``): a ``flush_cache`` in that window joins the prefetch
thread for 10 s and fails with "Failed to stop HiCache storage threads cleanly".

SGLang constructs its storage backend (this package) before it starts the storage threads,
so computing one page hash here moves the build to engine start, where no deadline applies.
This calls SGLang's own public hash function, patches nothing, and changes no key. Every
later call finds the module loaded (``lru_cache``) and costs microseconds.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def build_sglang_page_hash() -> None:
    """Compute one storage page hash the way SGLang's controller does; never raises."""
    start = time.monotonic()
    try:
        from sglang.srt.mem_cache.utils import get_hash_str
    except ImportError:  # an SGLang without this helper hashes in Python: nothing to build
        return
    try:
        get_hash_str([0], None)
    except Exception:  # SGLang's own prefetch will meet (and report) the same failure
        logger.warning("kvconnect: SGLang's page hash could not be computed at start", exc_info=True)
        return
    took = time.monotonic() - start
    if took > 1.0:
        logger.info("kvconnect: SGLang's page-hash extension was built at start (%.1f s), not on its prefetch thread", took)
