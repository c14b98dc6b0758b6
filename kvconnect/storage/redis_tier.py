"""The remote tier on Redis or Valkey: one key per chunk, pipelined batches, bounded waits.

URL forms (``LMCACHE_REMOTE_URL``):

    redis://[user:password@]host:port[/db]        plain TCP
    rediss://[user:password@]host:port[/db]       TLS
    unix:///path/to/redis.sock[?db=N&password=P]  unix socket
    redis-cluster://[user:password@]host:port[,host:port...]    Redis Cluster (seed nodes)
    rediss-cluster://...                          Redis Cluster over TLS
    valkey://, valkeys://, valkey-cluster://, valkeys-cluster://  the same, spelled for Valkey

Each chunk is one key ``kvconnect:<fingerprint hex>:<chunk key hex>`` whose value is the
encoded chunk (header + checksum + payload), so the store's own eviction can never leave
half an entry, and chunks of a cluster spread over every shard by key hash. Configure the
store as a cache (``maxmemory`` with ``maxmemory-policy allkeys-lru``).

``masks`` reads only the first bytes of each value (GETRANGE, the fixed header) and
checks its identity; ``get`` reads whole values and verifies the checksum, deleting a bad
value. Every socket operation is bounded by ``timeout_s``; any failure of the store
(refused, reset, timeout, cluster down) is a miss or a failed put, counted, and opens a
breaker that skips the store for a short, growing while, so a dead or stalled store costs
the engine at most one timeout per back-off period. The client is rebuilt after a failure,
which is how a restarted server is picked up again.

Eviction. kvconnect never expires keys itself (a ``reset`` moves to a new key generation and
leaves the old one for the store to evict), so a store that never evicts fills up for good.
On its first connection the tier reads ``maxmemory`` and ``maxmemory-policy`` (CONFIG GET)
and warns once per process when keys would never be evicted: no ``maxmemory``, or a policy
of ``noeviction`` / ``volatile-*`` (kvconnect's keys carry no TTL). A store that refuses
CONFIG (managed services often do) is not checked. ``eviction_check`` holds the finding.

Needs the ``redis`` package (``pip install 'kvconnect[redis]'``), imported only here.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from typing import Any, Callable, Optional, Sequence

from ..chunks import chunk_format
from ..errors import ConfigError, StorageError
from ..layout.spec import ChunkKey, Fingerprint
from ..throttled_warning import OnceWarnings, RepeatingWarning
from .tier import Breaker, LowerTier, StoreItem, peek_mask

logger = logging.getLogger(__name__)

KEY_PREFIX = b"kvconnect:"
NOT_SENT = object()  # the result of a command whose store or shard failed or was skipped
SOCKET_READ_BYTES = 1 << 20  # chunks are MBs: fewer, larger reads than the 32 KB default
_ALIASES = {"valkey": "redis", "valkeys": "rediss", "valkey-cluster": "redis-cluster", "valkeys-cluster": "rediss-cluster"}
_SINGLE = ("redis", "rediss", "unix")
_CLUSTER = ("redis-cluster", "rediss-cluster")
_LMCACHE_SCHEMES = {  # LMCache remote schemes kvconnect has no connector for: what to use instead
    "lm": "; lm:// is LMCache's own server: kvconnect's node server is KVCONNECT_SERVER_URL (docs/server.md)",
    "resp": "; resp:// is LMCache's RESP client: write redis://HOST:PORT (the same protocol)",
    "resps": "; resps:// is LMCache's RESP client over TLS: write rediss://HOST:PORT",
    "infinistore": "; infinistore:// has no kvconnect tier: use mooncakestore:// or redis://",
    "s3": "; s3:// has no kvconnect tier: use the disk tier (LMCACHE_LOCAL_DISK) or a shared Redis / Mooncake tier",
    "mooncakestore": "",
}


_once = OnceWarnings(logger.warning)


def _import_redis():
    try:
        import redis  # noqa: F401  (optional dependency)
        import redis.backoff
        import redis.cluster
        import redis.retry
    except ImportError as exc:
        raise StorageError(
            "the remote tier (LMCACHE_REMOTE_URL) needs the 'redis' package: pip install 'kvconnect[redis]'"
        ) from exc
    return redis


def parse_url(url: str) -> tuple[str, str]:
    """(scheme, url) with Valkey spellings mapped to Redis ones; ConfigError when unsupported."""
    scheme, sep, rest = url.partition("://")
    scheme = _ALIASES.get(scheme.lower(), scheme.lower())
    if not sep or scheme not in _SINGLE + _CLUSTER:
        hint = _LMCACHE_SCHEMES.get(scheme, "")
        raise ConfigError(
            f"remote_url (LMCACHE_REMOTE_URL) {url!r}: expected redis://, rediss://, unix://, "
            "redis-cluster://host:port[,host:port...], a valkey spelling of these, or mooncakestore://HOST:PORT "
            f"(a Mooncake master){hint}"
        )
    if scheme in _SINGLE and scheme != "unix":
        _check_one_server(url, rest)
    return scheme, f"{scheme}://{rest}"


def _check_one_server(url: str, rest: str) -> None:
    """A ``redis://`` URL names one server: LMCache's comma list of several URLs, or a port that is not
    a number, would otherwise fail at every lookup (redis-py parses the URL at the first connect)."""
    if "," in rest.split("?", 1)[0].split("/", 1)[0].rpartition("@")[2] or "://" in rest:
        raise ConfigError(f"remote_url (LMCACHE_REMOTE_URL) {url!r}: one redis:// URL names one server; for "
                          "several nodes of a Redis Cluster write redis-cluster://host:port,host:port (kvconnect "
                          "has no list of independent remotes)")
    try:
        urllib.parse.urlsplit(f"redis://{rest}").port
    except ValueError as exc:
        raise ConfigError(f"remote_url (LMCACHE_REMOTE_URL) {url!r}: {exc} (expected redis://HOST:PORT)") from exc


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], Optional[str], Optional[str]]:
    """Seed nodes, username and password of a ``redis-cluster://`` URL."""
    rest = url.partition("://")[2].split("/", 1)[0].split("?", 1)[0]
    creds, at, hosts = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = creds.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if colon else None
    nodes = []
    for item in filter(None, hosts.split(",")):
        host, colon, port = item.rpartition(":")
        if not colon or not port.isdigit():
            raise ConfigError(f"remote_url (LMCACHE_REMOTE_URL) {url!r}: node {item!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ConfigError(f"remote_url (LMCACHE_REMOTE_URL) {url!r}: no cluster nodes given")
    return nodes, username, password


class RedisTier(LowerTier):
    name = "remote"

    def __init__(self, url: str, fingerprint: Fingerprint, *, timeout_s: float = 1.0,
                 retry_after_s: float = 0.5, max_retry_after_s: float = 10.0) -> None:
        """A tier on the store at ``url``; connects lazily, so a store that is down is a miss.

        Raises ConfigError for an unsupported URL and StorageError when ``redis`` is missing.
        """
        super().__init__(fingerprint)
        self.scheme, self.url = parse_url(url)  # an unsupported URL is named before a missing package
        self._redis = _import_redis()
        if self.scheme in _CLUSTER:
            cluster_nodes(self.url)  # validate now, not on first use
        self.timeout_s = timeout_s
        self._prefix = KEY_PREFIX + bytes(fingerprint).hex().encode() + b":"
        self._breaker = Breaker(retry_after_s, max_retry_after_s)
        self._down = RepeatingWarning(logger.warning)  # the store does not answer: warned, not only counted
        self._shard_breakers: dict[str, Breaker] = {}  # cluster primaries by "host:port"
        self._client_lock = threading.Lock()
        self._client: Any = None
        self.eviction_check: Optional[str] = None  # "ok", "never-evicts: ...", "unknown: ..." once connected

    @property
    def is_cluster(self) -> bool:
        return self.scheme in _CLUSTER

    def redis_key(self, key: ChunkKey) -> bytes:
        return self._prefix + bytes(key).hex().encode()

    # -- connection ------------------------------------------------------------------
    def _connect(self) -> Any:
        r = self._redis
        no_retry = r.retry.Retry(r.backoff.NoBackoff(), 0)
        common = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, socket_read_size=SOCKET_READ_BYTES)
        if not self.is_cluster:
            return r.Redis.from_url(self.url, retry=no_retry, **common)
        nodes, username, password = cluster_nodes(self.url)
        return r.cluster.RedisCluster(
            startup_nodes=[r.cluster.ClusterNode(h, p) for h, p in nodes],
            username=username, password=password, ssl=self.scheme == "rediss-cluster",
            require_full_coverage=False,  # a cache serves the slots that are up
            retry=r.retry.Retry(r.backoff.NoBackoff(), 1), **common,
        )

    def _client_or_connect(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._connect()
                if self.eviction_check is None:
                    self.eviction_check = self._check_eviction(self._client)
            return self._client

    def _check_eviction(self, client: Any) -> str:
        """Whether the store will ever evict kvconnect's keys; warns once per process when not."""
        try:
            reply = client.config_get("maxmemory*")
        except Exception as exc:  # CONFIG refused (managed stores) or the store is down: not checked
            return f"unknown: {type(exc).__name__}"
        if self.is_cluster and reply and all(isinstance(v, dict) for v in reply.values()):
            reply = next(iter(reply.values()))  # one answer per node: the primaries are configured alike
        policy = str(reply.get("maxmemory-policy", ""))
        limit = str(reply.get("maxmemory", ""))
        if not policy:
            return "unknown: no maxmemory-policy in CONFIG GET"
        if limit == "0" or policy == "noeviction" or policy.startswith("volatile-"):
            finding = f"never-evicts: maxmemory={limit} maxmemory-policy={policy}"
            message = (f"kvconnect: the Redis store at {self.url_for_logs} never evicts kvconnect's keys "
                       f"(maxmemory {limit}, maxmemory-policy {policy}; kvconnect sets no TTL): once full, "
                       "every write fails and old key generations stay forever. Set maxmemory and "
                       "maxmemory-policy allkeys-lru (or allkeys-lfu).")
            _once.warn(message, message)
            return finding
        return "ok"

    def _reset_client(self, client: Any) -> None:
        with self._client_lock:
            if self._client is client:
                self._client = None
        try:
            client.close()
        except Exception:  # closing a broken client may fail too; it is being dropped anyway
            pass

    def _pipeline(self, op: str, redis_keys: Sequence[bytes], add: Callable[[Any, int], None]) -> list:
        """One result per key: the reply, the command's own exception, or ``NOT_SENT``.

        ``add(pipe, i)`` queues the command for ``redis_keys[i]``. A failure of the store (or,
        in a cluster, of one shard) makes its keys ``NOT_SENT``; it is logged and counted here.
        """
        if not self._breaker.allow():
            self._count(skipped_unhealthy=1)
            return [NOT_SENT] * len(redis_keys)
        client = None
        try:
            client = self._client_or_connect()
            if self.is_cluster:
                return self._per_shard(op, client, redis_keys, add)
            pipe = client.pipeline(transaction=False)
            for i in range(len(redis_keys)):
                add(pipe, i)
            results = pipe.execute(raise_on_error=False)
        except Exception as exc:  # any failure of the store or the client library is a miss
            self._store_failed(op, exc, client)
            return [NOT_SENT] * len(redis_keys)
        self._breaker.success()
        return results

    # -- a cluster, shard by shard -----------------------------------------------------
    def _per_shard(self, op: str, client: Any, redis_keys: Sequence[bytes], add: Callable[[Any, int], None]) -> list:
        """One plain pipeline per primary, one after the other.

        A dead or stalled shard is a miss for its keys only (after at most its timeout), then
        skipped for a while by its own breaker; the others keep serving. (redis-py's cluster
        pipeline would re-send each command of a failed node one by one with retries: a 25 s
        stall for 12 keys on a stalled shard at a 1 s timeout.) A key whose slot moved is a
        miss this time (MOVED/ASK reply) and the slot map is refreshed for the next call.
        """
        out: list = [NOT_SENT] * len(redis_keys)
        shards: dict[str, tuple[Any, list[int]]] = {}
        for i, key in enumerate(redis_keys):
            try:
                node = client.get_node_from_key(key)
            except Exception:  # slot served by no known node: a miss
                self._count(errors=1)
                continue
            shards.setdefault(node.name, (node, []))[1].append(i)
        num_tried = num_failed = 0
        moved = False
        for name, (node, indices) in shards.items():
            breaker = self._shard_breaker(name)
            if not breaker.allow():
                self._count(skipped_unhealthy=1)
                continue
            num_tried += 1
            try:
                pipe = client.get_redis_connection(node).pipeline(transaction=False)
                for i in indices:
                    add(pipe, i)
                results = pipe.execute(raise_on_error=False)
            except Exception as exc:
                num_failed += 1
                self._log_failure(op, f"shard {name}", exc, quiet=breaker.failing)
                breaker.failure()
                self._count(errors=1)
                continue
            breaker.success()
            for i, result in zip(indices, results):
                out[i] = result
                moved = moved or isinstance(result, self._redis.exceptions.AskError)  # MOVED is an AskError
        if num_tried and num_failed == num_tried:
            self._store_failed(op, None, client)  # nothing answered: the cluster itself is down
        elif num_failed < num_tried:  # some shard answered
            self._breaker.success()
            if moved:
                self._refresh_slots(client)
        return out

    def _shard_breaker(self, name: str) -> Breaker:
        with self._client_lock:
            breaker = self._shard_breakers.get(name)
            if breaker is None:
                breaker = self._shard_breakers[name] = Breaker(self._breaker.retry_after_s, self._breaker.max_retry_after_s)
            return breaker

    def _refresh_slots(self, client: Any) -> None:
        """Re-read the slot map after a MOVED/ASK reply; forget breakers of departed shards."""
        try:
            client.nodes_manager.initialize()
            primaries = {node.name for node in client.get_primaries()}
        except Exception as exc:
            logger.debug("kvconnect: refreshing the cluster slot map failed (%s)", exc)
            return
        with self._client_lock:
            for name in [n for n in self._shard_breakers if n not in primaries]:
                del self._shard_breakers[name]

    def _log_failure(self, op: str, what: str, exc: BaseException, *, quiet: bool) -> None:
        """A new failure warns at once; while failures go on (``quiet``), one line a minute."""
        if not quiet:
            self._down.cleared()
        self._down.failed("kvconnect: remote tier %s: %s failed during %s (%s: %s); its chunks are misses until it answers",
                          self.url_for_logs, what, op, type(exc).__name__, exc)

    def _store_failed(self, op: str, exc: Optional[BaseException], client: Any) -> None:
        """The whole store failed: skip it for a while and rebuild the client next time."""
        was_failing = self._breaker.failing  # failing since an earlier call: warned already (once a minute)
        self._breaker.failure()
        self._count(errors=1)
        if exc is not None:
            self._log_failure(op, "the store", exc, quiet=was_failing)
        if client is not None:
            self._reset_client(client)

    @property
    def url_for_logs(self) -> str:
        parts = urllib.parse.urlsplit(self.url)
        if parts.password:
            return self.url.replace(parts.password, "***")
        return self.url

    def healthy(self) -> bool:
        return self._breaker.allow()

    # -- reads -----------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        if not keys:
            return []
        header_end = chunk_format.FIXED_HEADER_BYTES - 1
        redis_keys = [self.redis_key(k) for k in keys]
        results = self._pipeline("lookup", redis_keys, lambda p, i: p.getrange(redis_keys[i], 0, header_end))
        out: list[Optional[int]] = [None] * len(keys)
        for i, (key, value) in enumerate(zip(keys, results)):
            if self._replied(value) and value:
                out[i] = peek_mask(value, self.fingerprint, key)
        self._count(lookups=len(keys), lookup_hits=sum(m is not None for m in out))
        return out

    def get(self, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]:
        if not keys:
            return []
        redis_keys = [self.redis_key(k) for k in keys]
        results = self._pipeline("get", redis_keys, lambda p, i: p.get(redis_keys[i]))
        out: list[Optional[bytes]] = [None] * len(keys)
        bad: list[ChunkKey] = []
        for i, (key, value) in enumerate(zip(keys, results)):
            if self._replied(value) and value is not None:
                if self._verify(value, key):
                    out[i] = value
                else:
                    bad.append(key)
        if bad:
            logger.warning("kvconnect: remote tier held %d corrupt chunk(s); deleting them", len(bad))
            self._count(errors=len(bad), corrupt=len(bad))
            self.delete(bad)
        hits = [d for d in out if d is not None]
        self._count(gets=len(keys), get_hits=len(hits), bytes_read=sum(map(len, hits)))
        return out

    def _replied(self, result: Any) -> bool:
        """Whether the store answered this command (its own error is counted here)."""
        if result is NOT_SENT:
            return False  # counted where the store or shard failed
        if isinstance(result, Exception):
            self._count(errors=1)
            return False
        return True

    # -- writes ----------------------------------------------------------------------
    def put(self, items: Sequence[StoreItem]) -> list[bool]:
        if not items:
            return []
        redis_keys = [self.redis_key(it.key) for it in items]
        values = [b"".join((item.sealed_header(), item.payload)) for item in items]
        results = self._pipeline("put", redis_keys, lambda p, i: p.set(redis_keys[i], values[i]))
        ok = [self._replied(r) and r is True for r in results]
        self._count(puts=sum(ok), bytes_written=sum(len(v) for v, good in zip(values, ok) if good))
        return ok

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        redis_keys = [self.redis_key(k) for k in keys]
        results = self._pipeline("delete", redis_keys, lambda p, i: p.delete(redis_keys[i]))
        out = [self._replied(r) and r == 1 for r in results]
        self._count(deletes=sum(out))
        return out

    def close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
