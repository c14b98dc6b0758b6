"""Where the CPU copy threads run, from what the serving engine uses.

A store runs beside the engine's compute (vLLM: on a background thread while the next step
is scheduled and computed), so on a CPU engine every copy thread on one of the engine's
compute cores slows the engine's step by about the copy's own time. A load, in contrast,
blocks the step that needs it: the engine's cores are idle meanwhile and should do it.

    placement = plan_copy_threads(max_threads)
    placement.store_threads, placement.store_cores, placement.load_threads

Rules (measured in docs/performance.md, "0% reuse"):

- The engine's compute cores are read from the OpenMP binding its launcher set for the
  process (vLLM CPU: ``OMP_PLACES`` / ``GOMP_CPU_AFFINITY`` / ``KMP_AFFINITY`` proclist,
  from ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU``).
- Stores run on the process's allowed cores outside that set (the cores vLLM reserved), with
  at most one thread per such core; when there is none, one thread, unpinned (never more
  threads than the one the engine cannot avoid sharing with). Cores another rank of the same
  serve computes on are not free: vLLM CPU's ``VLLM_CPU_OMP_THREADS_BIND`` lists every rank's
  cores (``0-31|32-63``: TP, PP and data-parallel ranks alike), and a TP or DP rank's store
  thread on its neighbour's cores would slow that rank's step as much as its own.
- Loads use the engine's own cores (as many threads as it binds), or ``max_threads``.
- A CPU engine with no binding known (e.g. vLLM's in-process ``uni`` executor): one store
  thread, unpinned (its compute may use every core), ``max_threads`` for loads.
- A GPU engine: ``max_threads`` for both, unpinned; the copies are device kernels or DMA and
  these threads only walk tables.

Measured (benchmarks/connector_step.py, 2-core VM under load): storing a 2048-token prompt
(8 MiB) took 4.3 ms with one thread and 24.7 ms with two, because two OpenMP threads on
busy cores wait for each other; pinned to the other core, 4.4 ms.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from ..config import engine_openmp_binding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyPlacement:
    store_threads: int
    store_cores: Optional[frozenset]  # pin the storing thread here; None: leave it unpinned
    load_threads: int
    compute_cores: Optional[frozenset]  # the engine's bound compute cores, when known
    reason: str


def _parse_ids(text: str) -> set:
    """``0,2-4`` / ``0 1 2`` -> {0, 2, 3, 4}; ValueError on anything else."""
    out: set = set()
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(int(part))
    return out


def engine_compute_cores(environ: Optional[Mapping[str, str]] = None) -> Optional[frozenset]:
    """The cores the engine's OpenMP threads are bound to in this process, or None if unknown."""
    env = engine_openmp_binding() if environ is None else environ
    try:
        places = env.get("OMP_PLACES", "")
        if places.strip().startswith("{"):
            # explicit places: "{0,1}", "{0},{1}" or "{0:4}" (start:length); names like "cores" are not ids
            cores: set = set()
            for body in re.findall(r"\{([^}]*)\}", places):
                if ":" in body:
                    start, length = (int(x) for x in body.split(":")[:2])
                    cores.update(range(start, start + length))
                else:
                    cores |= _parse_ids(body)
            return frozenset(cores) or None
        gomp = env.get("GOMP_CPU_AFFINITY", "")
        if gomp.strip():
            return frozenset(_parse_ids(gomp))
        match = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
        if match:
            return frozenset(_parse_ids(match.group(1)))
    except ValueError:
        logger.debug("kvconnect: cannot parse the OpenMP binding", exc_info=True)
    return None


def serve_compute_cores(environ: Optional[Mapping[str, str]] = None) -> frozenset:
    """Every core some rank of this serve computes on: the union of the ``|``-separated lists
    of ``VLLM_CPU_OMP_THREADS_BIND`` (empty for ``auto``, ``nobind``, unset or unparsable)."""
    env = engine_openmp_binding() if environ is None else environ
    value = env.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if value in ("", "auto", "nobind"):
        return frozenset()
    try:
        return frozenset().union(*(_parse_ids(part) for part in value.split("|")))
    except ValueError:
        logger.debug("kvconnect: cannot parse VLLM_CPU_OMP_THREADS_BIND=%r", value, exc_info=True)
        return frozenset()


def allowed_cores() -> frozenset:
    """The cores this process may use. Not the calling thread's mask: an OpenMP runtime with
    ``OMP_PROC_BIND`` has already bound the engine's main thread to its first place. The
    cgroup's cpuset, else the parent's mask with ours, else every core."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective", encoding="ascii") as f:
            cores = _parse_ids(f.read())
        if cores:
            return frozenset(cores)
    except (OSError, ValueError):
        pass
    if hasattr(os, "sched_getaffinity"):
        try:
            return frozenset(os.sched_getaffinity(os.getppid()) | os.sched_getaffinity(0))
        except OSError:
            return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def plan_copy_threads(max_threads: int, *, device_type: str = "cpu", environ: Optional[Mapping[str, str]] = None,
                      allowed: Optional[frozenset] = None) -> CopyPlacement:
    """Thread counts and store placement for an engine on ``device_type`` (see the module doc)."""
    max_threads = max(1, max_threads)
    compute = engine_compute_cores(environ) if device_type == "cpu" else None
    if compute is None:
        if device_type == "cpu":  # unbound: its OpenMP threads may run on every core
            return CopyPlacement(1, None, max_threads, None, "no engine core binding known: one store thread")
        return CopyPlacement(max_threads, None, max_threads, None, f"{device_type} engine")
    allowed = allowed_cores() if allowed is None else allowed
    others = serve_compute_cores(environ) - compute  # other ranks' compute cores
    free = frozenset(allowed - compute - others)
    load_threads = max(1, min(max_threads, len(compute & allowed) or len(compute)))
    if free:
        return CopyPlacement(min(max_threads, len(free)), free, load_threads, compute,
                             f"stores on cores {sorted(free)} left free by the engine")
    if allowed & others:
        return CopyPlacement(1, None, load_threads, compute,
                             f"every allowed core computes (cores {sorted(allowed & others)}: other ranks): one store thread")
    return CopyPlacement(1, None, load_threads, compute, "every allowed core computes: one store thread")


def pin_current_thread(cores: Optional[frozenset]) -> bool:
    """Restrict the calling thread (Linux: per thread) to ``cores``; False if not possible."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, cores)
        return True
    except OSError:
        logger.debug("kvconnect: cannot pin the store thread to %s", sorted(cores), exc_info=True)
        return False
