"""The local disk tier: one file per chunk under a directory, LRU by bytes, crash-safe.

Files live in ``<root>/<fingerprint hex>/<key hex[:2]>/<key hex>-<group mask hex>.kvc``:
the fingerprint directory keeps layouts (models, ranks, format versions) apart, and the
name carries what ``masks`` answers, so the index is rebuilt at start from a directory
scan without reading a byte of any chunk.

The files themselves (names, crash-safe writes, verified reads) are ``chunk_files``'.

Crash safety: a chunk is written to a temporary name in the same directory (optionally
fsynced), then renamed over its final name; a reader therefore sees a whole old file or a
whole new one, and a process killed mid-write leaves only a temporary file, which the
next start removes. Every read verifies the chunk (magic, version, fingerprint, key,
size, checksum); any failure (missing file, short read, flipped byte, permission) is a
miss, a counted error, and the file is removed.

A *follower* (``follow_writer=True``: a replica TP rank whose writer rank, another process,
writes this directory; docs/vllm.md, "Replicated KV") writes nothing and keeps its index in
step with the directory: ``masks`` checks each asked key's file (one ``stat`` per key with the
group masks seen so far, one listing of a key's subdirectory per call to learn a new mask),
so it finds what the writer wrote since the start and forgets what the writer evicted.

The size limit (``capacity_bytes``) counts the files of this fingerprint; when a write
needs room, the least recently used files go first. A filesystem fuller than the limit
(ENOSPC: other files share it) is met the same way: the write frees this tier's least
recently used files, as many bytes as it needs, and is tried once more; the warning is
logged once a minute while writes keep failing. Recency survives a restart only as
file modification order (reads do not touch files).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from ..chunks import chunk_format
from ..chunks.chunk_format import ChunkHeader
from ..errors import CorruptChunkError, StorageError
from ..layout.spec import ChunkKey, Fingerprint
from ..throttled_warning import RepeatingWarning
from .chunk_files import (SUFFIX, TMP_SUFFIX, chunk_path, fsync_dir, parse_name, pid_alive, read_file, read_file_into,
                          tmp_path, tmp_writer_pid, unlink_quietly, write_file)
from .tier import LowerTier, StoreItem, TierStats

logger = logging.getLogger(__name__)

@dataclass(eq=False)
class _Entry:
    mask: int
    size_bytes: int


class DiskTier(LowerTier):
    name = "disk"
    reads_into = True  # straight from the file into a pool slot: no intermediate buffer

    def __init__(self, root: str, fingerprint: Fingerprint, capacity_bytes: int, *, fsync: bool = False,
                 follow_writer: bool = False) -> None:
        """Open (creating if needed) the tier at ``root`` and rebuild its index from the files.

        Raises StorageError when the directory cannot be created or listed.
        """
        super().__init__(fingerprint)
        if capacity_bytes <= 0:
            raise StorageError(f"disk tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.root = os.path.abspath(root)
        self.dir = os.path.join(self.root, bytes(fingerprint).hex())
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.follow_writer = follow_writer
        self._masks_seen: set[int] = set()  # group masks of files seen (a follower stats these names)
        self._lock = threading.Lock()
        self._index: "OrderedDict[ChunkKey, _Entry]" = OrderedDict()
        self._used_bytes = 0  # indexed files plus writes in flight
        self._tmp_counter = 0
        self._full = RepeatingWarning(logger.warning)  # ENOSPC lasts: one line a minute, not one per write
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"disk tier directory {self.dir!r} cannot be created: {exc}") from exc
        self._rebuild()

    # -- paths -----------------------------------------------------------------------
    def _path(self, key: ChunkKey, mask: int) -> str:
        return chunk_path(self.dir, key, mask)

    def _tmp_path(self, key: ChunkKey) -> str:
        with self._lock:
            self._tmp_counter += 1
            n = self._tmp_counter
        return tmp_path(self.dir, key, n)

    # -- index rebuild ---------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index every well-named chunk file of this fingerprint, oldest first; drop leftovers."""
        found: dict[ChunkKey, tuple[float, str, _Entry]] = {}
        try:
            subdirs = [d for d in os.scandir(self.dir) if d.is_dir(follow_symlinks=False) and len(d.name) == 2]
        except OSError as exc:
            raise StorageError(f"disk tier directory {self.dir!r} cannot be listed: {exc}") from exc
        for sub in subdirs:
            try:
                files = list(os.scandir(sub.path))
            except OSError:
                logger.warning("kvconnect: disk tier cannot list %s; skipping it", sub.path)
                continue
            for f in files:
                self._index_file(f, found)
        for key, (_, _, entry) in sorted(found.items(), key=lambda kv: kv[1][0]):
            self._index[key] = entry
            self._masks_seen.add(entry.mask)
            self._used_bytes += entry.size_bytes
        if not self.follow_writer:  # a follower never removes the writer's files
            self._evict_locked(0)
        if found:
            logger.info("kvconnect: disk tier %s indexed %d chunks (%d bytes)", self.dir, len(self._index), self._used_bytes)

    def _index_file(self, f: os.DirEntry, found: dict) -> None:
        name = f.name
        if name.endswith(TMP_SUFFIX):
            # A temporary file of a dead writer is a torn write: remove it. A live writer
            # (another process sharing the directory) still owns its file.
            pid = tmp_writer_pid(name)
            if pid != os.getpid() and not pid_alive(pid):
                unlink_quietly(f.path)
            return
        named = parse_name(name)
        if named is None:
            return
        key, mask = named
        try:
            st = f.stat(follow_symlinks=False)
        except OSError:
            return
        if not f.is_file(follow_symlinks=False):
            return
        if st.st_size < chunk_format.FIXED_HEADER_BYTES:
            unlink_quietly(f.path)  # cannot be a chunk (e.g. zero-length after a power loss)
            return
        previous = found.get(key)
        if previous is not None:
            # A crash between rename and unlinking the older mask's file: keep the newer.
            loser = f.path if previous[0] >= st.st_mtime else previous[1]
            unlink_quietly(loser)
            if loser == previous[1]:
                found[key] = (st.st_mtime, f.path, _Entry(mask, st.st_size))
            return
        found[key] = (st.st_mtime, f.path, _Entry(mask, st.st_size))

    # -- reads -----------------------------------------------------------------------
    def masks(self, keys: Sequence[ChunkKey]) -> list[Optional[int]]:
        if self.follow_writer:
            self._follow(keys)
        with self._lock:
            out = [(e.mask if (e := self._index.get(k)) is not None else None) for k in keys]
        self._count(lookups=len(keys), lookup_hits=sum(m is not None for m in out))
        return out

    def _follow(self, keys: Sequence[ChunkKey]) -> None:
        """A follower's index for ``keys`` as the directory has it now (see the module doc)."""
        listed = False
        for key in keys:
            with self._lock:
                entry = self._index.get(key)
                masks = [entry.mask] if entry is not None else sorted(self._masks_seen)
            found = None
            for mask in masks:
                try:
                    found = (mask, os.stat(self._path(key, mask)).st_size)
                    break
                except OSError:
                    continue
            if found is None and entry is None and not listed:
                listed = True  # at most one listing per call: new masks are rare (a layout has a handful)
                found = self._find_listed(key)
            with self._lock:
                current = self._index.get(key)
                if found is None:
                    if current is not None and current is entry:  # the writer evicted it
                        del self._index[key]
                        self._used_bytes -= current.size_bytes
                elif current is None or (current.mask, current.size_bytes) != found:
                    if current is not None:
                        self._used_bytes -= current.size_bytes
                    self._index[key] = _Entry(*found)
                    self._used_bytes += found[1]
                    self._masks_seen.add(found[0])

    def _find_listed(self, key: ChunkKey) -> Optional[tuple[int, int]]:
        """(mask, size) of ``key``'s file found by listing its subdirectory, or None."""
        hexkey = bytes(key).hex()
        try:
            names = os.listdir(os.path.join(self.dir, hexkey[:2]))
        except OSError:
            return None
        for name in names:
            if name.startswith(hexkey + "-") and name.endswith(SUFFIX):
                try:
                    mask = int(name[len(hexkey) + 1 : -len(SUFFIX)], 16)
                    return mask, os.stat(self._path(key, mask)).st_size
                except (ValueError, OSError):
                    return None
        return None

    def get(self, keys: Sequence[ChunkKey]) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for key in keys:
            out.append(self._get_one(key))
        self._count(gets=len(keys), get_hits=sum(d is not None for d in out), bytes_read=sum(len(d) for d in out if d is not None))
        return out

    def _get_one(self, key: ChunkKey) -> Optional[bytes]:
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return None
        path = self._path(key, entry.mask)
        try:
            data = read_file(path, entry.size_bytes)
        except (OSError, StorageError) as exc:
            logger.warning("kvconnect: disk tier read of %s failed (%s); dropping it", path, exc)
            self._forget(key, entry, path)
            self._count(errors=1)
            return None
        if not self._verify(data, key):
            logger.warning("kvconnect: disk tier chunk %s is corrupt; dropping it", path)
            self._forget(key, entry, path)
            self._count(errors=1, corrupt=1)
            return None
        with self._lock:
            if self._index.get(key) is entry:
                self._index.move_to_end(key)
        return data

    def read_into(self, key: ChunkKey, out: memoryview) -> Optional[ChunkHeader]:
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            self._count(gets=1)
            return None
        path = self._path(key, entry.mask)
        try:
            header = read_file_into(path, entry.size_bytes, self.fingerprint, key, out)
        except (OSError, StorageError, CorruptChunkError) as exc:
            logger.warning("kvconnect: disk tier read of %s failed (%s); dropping it", path, exc)
            self._forget(key, entry, path)
            self._count(gets=1, errors=1, corrupt=int(isinstance(exc, CorruptChunkError)))
            return None
        with self._lock:
            if self._index.get(key) is entry:
                self._index.move_to_end(key)
        self._count(gets=1, get_hits=1, bytes_read=entry.size_bytes)
        return header

    def _forget(self, key: ChunkKey, entry: _Entry, path: str) -> None:
        """Drop ``entry`` if it is still the indexed one (a concurrent rewrite wins)."""
        with self._lock:
            if self._index.get(key) is not entry:
                return
            del self._index[key]
            self._used_bytes -= entry.size_bytes
            unlink_quietly(path)

    # -- writes ----------------------------------------------------------------------
    def put(self, items: Sequence[StoreItem]) -> list[bool]:
        return [self._put_one(item) for item in items]

    def _put_one(self, item: StoreItem, *, retry_when_full: bool = True) -> bool:
        size_bytes = item.header.header_bytes + item.header.payload_bytes
        if size_bytes > self.capacity_bytes:
            self._count(errors=1)
            return False
        with self._lock:
            num_evicted = self._evict_locked(size_bytes)
            self._used_bytes += size_bytes  # reserved for this write; an older version stays readable
        final = self._path(item.key, item.header.group_mask)
        tmp = self._tmp_path(item.key)
        try:
            write_file(tmp, [memoryview(item.sealed_header()), item.payload], fsync=self.fsync)
            with self._lock:
                # Rename and index change together: a reader holding the old entry either
                # reads a whole file or fails the identity check in _forget (never unlinks ours).
                os.rename(tmp, final)
                old = self._index.pop(item.key, None)
                if old is not None:
                    self._used_bytes -= old.size_bytes
                    if old.mask != item.header.group_mask:
                        unlink_quietly(self._path(item.key, old.mask))
                self._index[item.key] = _Entry(item.header.group_mask, size_bytes)
            if self.fsync:
                fsync_dir(os.path.dirname(final))
        except OSError as exc:
            unlink_quietly(tmp)
            with self._lock:
                self._used_bytes -= size_bytes
            self._count(evictions=num_evicted)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                logger.error("kvconnect: disk tier write of %s failed: %s", final, exc)
                self._count(errors=1)
                return False
            # the filesystem is fuller than the tier's size allows (other files share it): make
            # room from this tier's own least recently used files, as its size limit would
            freed = self._free_when_full(size_bytes, keep=item.key) if retry_when_full else 0
            if freed and self._put_one(item, retry_when_full=False):
                return True
            if retry_when_full:
                self._full.failed("kvconnect: disk tier %s is full (%s): writes fail and it frees its own least "
                                  "recently used files to make room; lower LMCACHE_MAX_LOCAL_DISK_SIZE below the "
                                  "free space", self.dir, exc)
                self._count(errors=1)
            return False
        self._full.cleared()
        self._count(puts=1, bytes_written=size_bytes, evictions=num_evicted)
        return True

    def _free_when_full(self, need_bytes: int, *, keep: ChunkKey) -> int:
        """Remove least recently used files (never ``keep``'s: a rewrite keeps its old version)
        until ``need_bytes`` are freed; how many went."""
        num = freed = 0
        with self._lock:
            for key in [k for k in self._index if k != keep]:
                if freed >= need_bytes:
                    break
                entry = self._index.pop(key)
                self._used_bytes -= entry.size_bytes
                unlink_quietly(self._path(key, entry.mask))
                freed += entry.size_bytes
                num += 1
        self._count(evictions=num)
        return num

    def _evict_locked(self, need_bytes: int) -> int:
        """Remove LRU entries (index and file) until ``need_bytes`` more fit; how many went."""
        num = 0
        while self._index and self._used_bytes + need_bytes > self.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            self._used_bytes -= entry.size_bytes
            unlink_quietly(self._path(key, entry.mask))
            num += 1
        return num

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        out = []
        for key in keys:
            with self._lock:
                entry = self._index.pop(key, None)
                if entry is not None:
                    self._used_bytes -= entry.size_bytes
                    unlink_quietly(self._path(key, entry.mask))
            out.append(entry is not None)
        self._count(deletes=sum(out))
        return out

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> TierStats:
        s = super().stats()
        with self._lock:
            s.entries = len(self._index)
            s.used_bytes = self._used_bytes
        s.capacity_bytes = self.capacity_bytes
        return s

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)
