"""``KVConnectStorage``: kvconnect as SGLang's HiCache L3 storage backend (SGLang 0.5.23 API).

SGLang calls, in order: ``KVConnectStorage(storage_config, kwargs)``,
``register_mem_pool_host(kv_host_pool)``, ``register_mem_host_pool_v2(pool, name)`` per pool
(the KV anchor again as ``"kv"``, then sidecars: SWA, indexer, Mamba, DeepSeek V4 pools),
``on_host_pools_registered()``; then from its storage threads ``batch_exists`` /
``batch_exists_v2``, ``batch_set_v1`` / ``batch_set_v2`` (backup) and ``batch_get_v1`` /
``batch_get_v2`` (prefetch), or the generic ``batch_set`` / ``batch_get`` with flat page
tensors when ``"interface_v1"`` is not set in the extra config.

Each registered pool becomes one group of a kvconnect layout (``host_pools``); one stored
object is one page of one pool, under SGLang's page key folded with the layout fingerprint
(``kvconnect.chunks.page_keys``) and moved by kvconnect's compiled CPU kernel (``PageStore``).
Every entry point catches failures: a tier that is down or slow, a corrupt page or a bug
here is a miss (False / 0) and a log line, never an exception into SGLang's controller.

Hybrid GDN / Mamba / short-convolution models (Qwen3.5, Qwen3-Next, Nemotron-H, LFM2):
SGLang registers a Mamba state pool (``PoolName.MAMBA``, one state per node end under the
node's last page key, hit policy TRAILING_PAGES with N = 1). A hit then needs the trailing
Mamba page present at its end (``batch_exists_v2`` intersects every pool's legal ends). The
backend serves such a pool only on the (SGLang release, Mamba radix-cache strategy) pairs in
``MAMBA_VERIFIED``, where the state SGLang hands over under a page key was checked on its real
engine to be the state after exactly that page (SGLang 0.5.23, ``no_buffer``, on CPU:
tests/sglang/test_sglang_mamba.py with LFM2's conv state, tests/sglang/test_sglang_gdn.py with
Qwen3.5's Gated DeltaNet conv + temporal state; docs/recurrent.md). Any other pair (``extra_buffer``,
whose ping-pong track buffers pick the state, has no CPU path to check it on; another
release) is refused: one warning naming both, then every page is a miss (SGLang recomputes)
-- never a hit that could restore a wrong state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvconnect.config import Config
from kvconnect.engine import KVCacheEngine
from kvconnect.errors import LayoutError
from kvconnect.layout.kv_layout import KVLayout
from kvconnect.page_store import PageStore, restorable_prefixes
from kvconnect.layout.spec import GroupSpec

from .flat_pages import FlatPages
from .host_pools import PoolPlanes, pool_planes
from . import runtime
from .identity import sglang_model_identity
from .page_hash import build_sglang_page_hash
from kvconnect.metrics.recorders import OpLog
from kvconnect.metrics.sglang import sglang_storage_metrics

logger = logging.getLogger(__name__)

KV = "kv"
MAMBA = "mamba"
# (SGLang release, Mamba radix-cache strategy) pairs on whose real engine the state stored
# under a page key was checked to be the state after exactly that page, and an L3 restore
# bit-exact (outputs and logprobs) against a run without HiCache: tests/sglang/test_sglang_mamba.py
# (LFM2: a one-tensor conv state) and tests/sglang/test_sglang_gdn.py (Qwen3.5's Gated DeltaNet:
# conv state + fp32 temporal state, two pieces per page; its GDN kernels are test-harness stand-ins).
# "extra_buffer" cannot run on CPU (SGLang allows it only on GPU / NPU platforms).
MAMBA_VERIFIED: frozenset = frozenset({("0.5.23", "no_buffer")})


def sglang_release() -> str:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:  # pragma: no cover - SGLang imported but not installed as a dist
        return "(unknown version)"


def refusal(pool_names, release: Optional[str] = None, strategy: Optional[str] = None) -> Optional[str]:
    """Why kvconnect serves no page for this pool set (None: it serves them). ``release`` and
    ``strategy`` default to the installed SGLang and this process's radix-cache strategy."""
    mamba = sorted(n for n in pool_names if n.startswith(MAMBA))
    if not mamba:
        return None
    release = sglang_release() if release is None else release
    strategy = runtime.mamba_radix_cache_strategy() if strategy is None else strategy
    if (release, strategy) in MAMBA_VERIFIED:
        return None
    verified = ", ".join(f"SGLang {r} with {s}" for r, s in sorted(MAMBA_VERIFIED)) or "none"
    return (f"kvconnect: off for this model on SGLang {release} with mamba_radix_cache_strategy {strategy or '(unknown)'}: "
            f"it registers the Mamba state pool {mamba} (a hybrid Gated DeltaNet / Mamba / short-convolution model); "
            f"that the state SGLang stores under a page key is the state after exactly that page was verified on its "
            f"real engine only for {verified}, so kvconnect stores and serves nothing for this model (every page is a "
            f"miss; SGLang recomputes)")


_CONFIG_KEYS = {f.name for f in dataclasses.fields(Config)}


def kvconnect_config(storage_config: HiCacheStorageConfig) -> Config:
    """LMCACHE_* / KVCONNECT_* from the environment, overridden by the same keys (YAML
    spelling) in SGLang's extra config; SGLang's own keys there are left to SGLang."""
    extra = dict(storage_config.extra_config or {})
    ours = {k: v for k, v in extra.items() if k.lower().removeprefix("lmcache_").removeprefix("kvconnect_") in _CONFIG_KEYS}
    return Config.from_dict(ours, source="hicache_storage_backend_extra_config", base=Config.from_env())


class KVConnectStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.storage_config = storage_config
        self.config = kvconnect_config(storage_config)
        # name@revision#digest of SGLang's own model config (identity.py); a model_name set wins
        self.model_identity = self.config.model_name or sglang_model_identity(storage_config.model_name)
        self.is_writer = storage_config.is_storage_writer
        # without "interface_v1" SGLang moves KV pages through the generic API (flat pages), and
        # its batch_exists must answer for those objects
        self.flat_mode = not bool((storage_config.extra_config or {}).get("interface_v1", 0))
        self.counters = OpLog()  # one record per SGLang call, in pages (get_stats)
        self._pools: dict[str, Any] = {}
        self._anchor = None
        self._store: Optional[PageStore] = None
        self._groups: dict[str, int] = {}
        self._logical: set[str] = set()
        self._host_page: dict[str, int] = {}  # host slots per page, per pool
        self._replicated: set[str] = set()  # pools only storage-writer ranks write
        self._flat: Optional[FlatPages] = None
        self._lock = threading.Lock()
        self._failed = False
        # SGLang builds this before its storage threads start only if we ask: otherwise its
        # prefetch thread JIT-builds it and a flush_cache meanwhile can fail (page_hash.py)
        build_sglang_page_hash()

    # -- registration ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.mem_pool_host = mem_pool_host
        self._anchor = mem_pool_host
        self._pools.setdefault(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        name = str(host_pool_name)
        if self._store is not None:
            if name not in self._groups and name not in self._logical:
                logger.warning("kvconnect: SGLang pool %r registered after the pool set was final; its pages are misses", name)
            return
        if name == KV and self._anchor is not None and host_pool is not self._anchor:
            logger.warning("kvconnect: a second KV pool was registered; using the anchor pool")
            return
        self._pools[name] = host_pool

    def on_host_pools_registered(self) -> None:
        self._build()

    def _build(self) -> None:
        """Describe every registered pool as a kvconnect group and open the engine (raises on bad layouts)."""
        with self._lock:
            if self._store is not None or self._failed:
                return
            why = refusal(self._pools)
            if why is not None:
                self._failed = True  # every later call is a miss; no retry, no second warning
                logger.warning(why)
                return
            sc = self.storage_config
            described: list[PoolPlanes] = [pool_planes(pool, name) for name, pool in self._pools.items()]
            kv_caches, groups, layer_groups = {}, [], {}
            identity = {"engine": "sglang-hicache", "pp": f"{sc.pp_rank}/{sc.pp_size}",
                        "attn_cp": f"{sc.attn_cp_rank}/{sc.attn_cp_size}", "dcp": f"{sc.dcp_rank}/{sc.dcp_size}"}
            replicated = sc.is_mla_model  # MLA KV is the same on every TP rank; only writers store it
            # every pool's page is one SGLang page key: one block per page in each group, and
            # a chunk of one "page" whatever the pool's own slots per page (Mamba: 1)
            page_tokens = next((pp.page_tokens for pp in described if pp.name == KV), described[0].page_tokens)
            for pp in described:
                self._host_page[pp.name] = pp.page_tokens
                if not pp.planes:
                    self._logical.add(pp.name)
                    continue
                self._groups[pp.name] = len(groups)
                groups.append(GroupSpec(block_size=page_tokens))
                kv_caches[pp.name] = pp.planes
                layer_groups[pp.name] = self._groups[pp.name]
                identity[f"pool:{pp.name}"] = f"{pp.layout_name}/{pp.dtype}/{pp.page_tokens}/{pp.page_bytes}"
                # as SGLang's own file backend: in an MLA model every pool is replicated over TP
                # except Mamba state, which stays TP-sharded (each rank writes and reads its own)
                if replicated and pp.name.startswith(MAMBA):
                    identity[f"pool:{pp.name}"] += f"/tp{sc.tp_rank}of{sc.tp_size}"
                elif replicated:
                    self._replicated.add(pp.name)
            if not groups:
                raise LayoutError("kvconnect: no SGLang host pool with data was registered")
            layout = KVLayout.from_tensors(
                kv_caches, groups=groups, layer_groups=layer_groups, layout_hints="page",
                model_name=self.model_identity,
                tp_rank=0 if replicated else sc.tp_rank, tp_size=1 if replicated else sc.tp_size,
                identity=identity,
            )
            config = dataclasses.replace(self.config, chunk_size=page_tokens)
            # SGLang hands over pages under its own keys and asks for them page by page: each page is
            # one whole object (its hybrid pools' restores are SGLang's own), not restore-point parts
            engine = KVCacheEngine(layout, config, window_parts=False)
            self._store = PageStore(engine)
            if KV in self._groups:
                self._flat = FlatPages(engine, self._pools[KV], self._store.page_bytes(self._groups[KV]))
            if any(n.startswith(MAMBA) for n in self._pools):
                logger.info("kvconnect: serving SGLang's Mamba state pool (SGLang %s, mamba_radix_cache_strategy %s: verified)",
                            sglang_release(), runtime.mamba_radix_cache_strategy())
            logger.info("kvconnect: SGLang HiCache backend ready: model %s, pools %s (logical: %s), %d planes, chunk_size %d "
                        "(SGLang's page: the unit it stores and asks for; a chunk_size set is not used), tiers %s",
                        self.model_identity, list(self._groups), sorted(self._logical), len(layout.planes), page_tokens,
                        [t.name for t in engine.storage.tiers] or "pool only")

    def _ready(self) -> Optional[PageStore]:
        if self._store is None and not self._failed:
            try:
                self._build()
            except Exception:
                self._failed = True  # once: every later call is a miss without retrying
                logger.exception("kvconnect: cannot describe SGLang's host pools; every page is a miss")
        return self._store

    # -- v1: the KV anchor pool ------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        store = self._ready()
        if store is None or not keys:
            return 0
        if KV in self._logical:
            return len(keys)
        try:
            if self.flat_mode and self._flat is not None:
                return self._flat.leading_hits(keys)
            return store.leading_hits(self._groups[KV], keys)
        except Exception:
            logger.exception("kvconnect: batch_exists failed; reporting a miss")
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._pool_io("backup", KV, keys, host_indices)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._pool_io("prefetch", KV, keys, host_indices)

    def _pool_io(self, kind: str, name: str, keys: List[str], host_indices) -> List[bool]:
        store = self._ready()
        n = len(keys)
        if store is None or not n:
            return [False] * n
        if name in self._logical:
            return [True] * n
        if kind == "backup" and not self.is_writer and name in self._replicated:
            return [True] * n  # replicated MLA: the writer rank stores this page
        group = self._groups.get(name)
        if group is None:
            return [False] * n
        try:
            page_tokens = self._host_page[name]
            idx = host_indices.detach().cpu().numpy() if isinstance(host_indices, torch.Tensor) else np.asarray(host_indices)
            if idx.ndim != 1 or len(idx) != n * page_tokens:
                logger.error("kvconnect: %s of %d %s pages got %d host indices", kind, n, name, len(idx))
                return [False] * n
            pages = idx[::page_tokens] // page_tokens
            start = time.perf_counter()
            if kind == "backup":
                ok = store.store(group, keys, pages)
            else:
                ok = store.load(group, keys, pages, leading_only=True)
            done = sum(ok)
            (self.counters.stored if kind == "backup" else self.counters.retrieved)(done, done * store.page_bytes(group), time.perf_counter() - start)
            return ok
        except Exception:
            logger.exception("kvconnect: %s of %d %s pages failed; reporting a miss", kind, n, name)
            return [False] * n

    # -- generic API (SGLang without "interface_v1"): flat page tensors --------------------
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        if self._ready() is None or self._flat is None or target_locations is None:
            return [None] * len(keys)
        try:
            start = time.perf_counter()
            out = self._flat.get(keys, list(target_locations))
            done = sum(o is not None for o in out)
            self.counters.retrieved(done, done * self._flat.page_bytes, time.perf_counter() - start)
            return out
        except Exception:
            logger.exception("kvconnect: batch_get failed; reporting a miss")
            return [None] * len(keys)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        if not self.is_writer:
            return True
        if self._ready() is None or self._flat is None or values is None:
            return False
        try:
            start = time.perf_counter()
            ok = self._flat.set(keys, list(values))
            self.counters.stored(sum(ok), sum(ok) * self._flat.page_bytes, time.perf_counter() - start)
            return all(ok)
        except Exception:
            logger.exception("kvconnect: batch_set failed")
            return False

    # -- v2: every pool, gated together ----------------------------------------------------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        store = self._ready()
        if store is None or not keys:
            return PoolTransferResult(0, {}, [])
        try:
            n = len(keys)
            windows: list[Optional[int]] = [None]
            present = [np.ones(n, bool) if KV in self._logical else store.present(self._groups[KV], keys)]
            names = [KV]
            for t in pool_transfers or []:
                name = str(t.name)
                if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    windows.append(max(1, len(t.keys) if t.keys else 1))
                elif t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    windows.append(None)
                else:
                    logger.warning("kvconnect: hit policy %s of pool %s is not supported; no hit", t.hit_policy, name)
                    return PoolTransferResult(0, {}, [])
                if name in self._logical:
                    present.append(np.ones(n, bool))
                elif name in self._groups:
                    present.append(store.present(self._groups[name], keys))
                else:
                    present.append(np.zeros(n, bool))
                names.append(name)
            legal = restorable_prefixes(1, windows, present)
            kv_hit = int(np.argmin(present[0])) if not present[0].all() else n
            hits = {KV: kv_hit} if kv_hit else {}
            for name, w, p in zip(names[1:], windows[1:], present[1:]):
                own = restorable_prefixes(1, [None, w], [present[0], p])
                if own:
                    hits[name] = own[-1]
            return PoolTransferResult(legal[-1] if legal else 0, hits, legal)
        except Exception:
            logger.exception("kvconnect: batch_exists_v2 failed; reporting a miss")
            return PoolTransferResult(0, {}, [])

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return {str(t.name): self._pool_io("prefetch", str(t.name), t.keys or [], t.host_indices) for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return {str(t.name): self._pool_io("backup", str(t.name), t.keys or [], t.host_indices) for t in transfers}

    # -- housekeeping --------------------------------------------------------------------
    def get_stats(self):
        # SGLang's StorageMetrics: pages and GB/s per call since the last read (kvconnect.metrics)
        return sglang_storage_metrics(self.counters, pages_per_chunk=1)

    def clear(self) -> None:
        """SGLang's ``flush_cache`` (and its weight updates) reach here: no page stored before
        now is served again, from any tier (``KVCacheEngine.reset``: a new key generation;
        shared tiers keep their pages for other engines, the private pool is emptied)."""
        try:
            if self._store is not None:
                self._store.engine.reset()
        except Exception:
            logger.exception("kvconnect: clear failed")

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until the pages stored so far reached every lower tier (disk, remote)."""
        return self._store.engine.storage.flush(timeout_s) if self._store is not None else True

    def close(self) -> None:
        if self._store is not None:
            try:
                self._store.engine.close()
            except Exception:
                logger.exception("kvconnect: closing the SGLang backend failed")
