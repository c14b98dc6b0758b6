"""The disk tier: crash-safe files, checksum on every read, LRU by bytes, index rebuilt at start.

Every failure of the medium (flipped byte, truncation, deleted file, ENOSPC, permission)
must be a miss with a counted error and the bad file gone, never wrong bytes or an exception.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvconnect.chunks import chunk_format
from kvconnect.errors import StorageError
from kvconnect.layout.spec import ChunkKey
from kvconnect.storage import chunk_files as files_mod
from kvconnect.storage.disk import DiskTier

import kv_rig
from chunk_items import FP, OTHER_FP, encoded, key_of, make_item

def chunk_files(tier: DiskTier) -> dict[ChunkKey, Path]:
    return {ChunkKey(bytes.fromhex(p.name[:32])): p for p in Path(tier.dir).glob("*/*.kvc")}


def test_round_trip_files_named_by_fingerprint_and_key(tmp_path):
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    items = [make_item(i, mask=1 + i % 3) for i in range(5)]
    assert tier.put(items) == [True] * 5
    keys = [it.key for it in items] + [key_of(99)]
    assert tier.masks(keys) == [1, 2, 3, 1, 2, None]
    got = tier.get(keys)
    assert got[-1] is None
    assert [bytes(g) for g in got[:-1]] == [encoded(it) for it in items]
    files = chunk_files(tier)
    assert set(files) == {it.key for it in items}
    assert all(p.parent.parent == tmp_path / bytes(FP).hex() for p in files.values())
    assert not list(tmp_path.rglob("*.tmp"))
    s = tier.stats()
    assert (s.entries, s.used_bytes, s.errors) == (5, sum(len(encoded(it)) for it in items), 0)
    assert tier.delete([items[0].key, key_of(99)]) == [True, False]
    assert tier.masks([items[0].key]) == [None] and items[0].key not in chunk_files(tier)


def test_index_rebuilt_at_start_ignoring_other_layouts_and_leftovers(tmp_path):
    first = DiskTier(str(tmp_path), FP, 1 << 20)
    items = [make_item(i, mask=5) for i in range(4)]
    first.put(items)
    other = DiskTier(str(tmp_path), OTHER_FP, 1 << 20)
    other.put([make_item(50, fp=OTHER_FP)])
    sub = Path(first.dir) / "ab"
    sub.mkdir(exist_ok=True)
    (sub / "not-a-chunk.txt").write_bytes(b"x")
    (sub / ("ab" * 16 + "-1.kvc")).write_bytes(b"short")  # too short to be a chunk: removed
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = sub / f".{'ab' * 16}.{int(dead.stdout)}.1.1.tmp"  # torn write of a dead process
    stale.write_bytes(b"torn")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = sub / f".{'cd' * 16}.{live.pid}.1.1.tmp"  # a live writer's file is left alone
        busy.write_bytes(b"in progress")
        again = DiskTier(str(tmp_path), FP, 1 << 20)
        assert busy.exists()
    finally:
        live.kill()
        live.wait()
    assert again.masks([it.key for it in items] + [key_of(50)]) == [5, 5, 5, 5, None]
    assert [bytes(g) for g in again.get([it.key for it in items])] == [encoded(it) for it in items]
    assert not stale.exists() and not (sub / ("ab" * 16 + "-1.kvc")).exists()
    assert (sub / "not-a-chunk.txt").exists()
    assert len(DiskTier(str(tmp_path), OTHER_FP, 1 << 20)) == 1


def test_lru_by_bytes_and_rebuild_order(tmp_path):
    size = len(encoded(make_item(0)))
    tier = DiskTier(str(tmp_path), FP, 3 * size + 10)
    for i in range(3):
        assert tier.put([make_item(i)]) == [True]
        t = time.time() - 100 + i  # distinct modification times: the order a restart rebuilds
        os.utime(chunk_files(tier)[key_of(i)], (t, t))
    assert tier.get([key_of(0)])[0] is not None  # 0 is now the most recent
    assert tier.put([make_item(3)]) == [True]
    assert tier.masks([key_of(i) for i in range(4)]) == [1, None, 1, 1]
    assert set(chunk_files(tier)) == {key_of(0), key_of(2), key_of(3)}
    assert tier.stats().used_bytes == 3 * size and tier.stats().evictions == 1
    big = make_item(7, payload_bytes=4 * size)
    assert tier.put([big]) == [False] and tier.stats().errors == 1
    # A restart orders by modification time: 0 and 2 are older than 3, so 0 goes first.
    again = DiskTier(str(tmp_path), FP, 3 * size + 10)
    again.put([make_item(4)])
    assert again.masks([key_of(i) for i in (0, 2, 3, 4)]) == [None, 1, 1, 1]
    # A smaller limit at start evicts down to it.
    assert len(DiskTier(str(tmp_path), FP, size + 10)) == 1


def test_rewrite_with_wider_mask_replaces_the_file(tmp_path):
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    tier.put([make_item(1, mask=1)])
    wider = make_item(1, mask=3, version=1)
    tier.put([wider])
    assert tier.masks([key_of(1)]) == [3]
    assert [p.name.endswith("-3.kvc") for p in Path(tier.dir).glob("*/*.kvc")] == [True]
    assert bytes(tier.get([key_of(1)])[0]) == encoded(wider)
    assert tier.stats().used_bytes == len(encoded(wider))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "truncate_to_header", "extend", "other_fingerprint"])
def test_damaged_file_is_a_counted_miss_and_removed(tmp_path, damage):
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    items = [make_item(i) for i in range(3)]
    tier.put(items)
    path = chunk_files(tier)[key_of(1)]
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-100] ^= 0x01
    elif damage == "flip_header":
        data[60] ^= 0x80  # group mask byte
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "truncate_to_header":
        data = data[: chunk_format.FIXED_HEADER_BYTES]
    elif damage == "extend":
        data += b"\0"
    else:
        data = bytearray(encoded(make_item(1, fp=OTHER_FP)))
    path.write_bytes(bytes(data))
    for reopen in (False, True):  # damaged while indexed, and found at the next start
        t = DiskTier(str(tmp_path), FP, 1 << 20) if reopen else tier
        got = t.get([key_of(0), key_of(1), key_of(2)])
        assert got[1] is None
        assert [bytes(g) for g in (got[0], got[2])] == [encoded(items[0]), encoded(items[2])]
        assert t.stats().errors == 1 and t.masks([key_of(1)]) == [None]
        assert not path.exists()
        path.write_bytes(bytes(data))  # damage again for the reopened tier


@pytest.mark.parametrize("damage", ["none", "flip_payload", "flip_plane_count", "truncate", "too_big_for_slot"])
def test_read_into_a_slot_verifies_before_use(tmp_path, damage):
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    item = make_item(3, payload_bytes=5000 if damage == "too_big_for_slot" else 4096)
    tier.put([item])
    path = chunk_files(tier)[key_of(3)]
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-7] ^= 0x10
    elif damage == "flip_plane_count":
        data[64] ^= 0x7F
    elif damage == "truncate":
        data = data[:-10]
    path.write_bytes(bytes(data))
    slot = bytearray(4096 + 64)
    header = tier.read_into(key_of(3), memoryview(slot))
    if damage == "none":
        assert header == chunk_format.decode_header(encoded(item))
        assert bytes(slot[:4096]) == bytes(item.payload) and not any(slot[4096:])
        assert tier.stats().get_hits == 1
    else:
        assert header is None and not path.exists() and tier.stats().errors == 1


def test_file_deleted_after_indexing_is_a_miss(tmp_path):
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    tier.put([make_item(1), make_item(2)])
    chunk_files(tier)[key_of(1)].unlink()
    assert tier.masks([key_of(1)]) == [1]  # the index does not know yet
    got = tier.get([key_of(1), key_of(2)])
    assert got[0] is None and bytes(got[1]) == encoded(make_item(2))
    assert tier.masks([key_of(1)]) == [None] and tier.stats().errors == 1
    assert tier.stats().used_bytes == len(encoded(make_item(2)))


def test_enospc_on_write_is_a_failed_put(tmp_path, monkeypatch):
    """A disk that stays full: a failed rewrite keeps the old version (the tier never frees the
    key it rewrites), other writes free the tier's own oldest files to make room and fail when
    even that does not help; no temporary file survives, the byte count stays true."""
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    tier.put([make_item(1, mask=1)])
    real = files_mod.write_all

    def full_after_header(fd, parts):
        os.write(fd, bytes(parts[0]))  # a partly written temp file must not survive
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_mod, "write_all", full_after_header)
    assert tier.put([make_item(1, mask=3, version=1)]) == [False]  # a failed rewrite keeps the old version
    assert tier.masks([key_of(1)]) == [1]
    assert bytes(tier.get([key_of(1)])[0]) == encoded(make_item(1, mask=1))
    assert tier.put([make_item(2), make_item(3)]) == [False, False]
    assert tier.stats().errors == 3
    assert tier.masks([key_of(i) for i in (1, 2, 3)]) == [None, None, None]  # freed for room: still full
    assert not list(tmp_path.rglob("*.tmp")) and not chunk_files(tier)
    assert tier.stats().used_bytes == 0
    monkeypatch.setattr(files_mod, "write_all", real)
    assert tier.put([make_item(2)]) == [True] and bytes(tier.get([key_of(2)])[0]) == encoded(make_item(2))


def test_a_full_filesystem_frees_the_tiers_own_oldest_files(tmp_path, monkeypatch, caplog):
    """ENOSPC below the tier's size limit (other files fill the filesystem): each write frees
    the tier's least recently used files, as many bytes as it needs, and lands; the warning
    comes once, not once per failed write."""
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    assert tier.put([make_item(i) for i in range(4)]) == [True] * 4
    room = {"files": 4}  # the filesystem holds 4 of these files and no more
    real = files_mod.write_all

    def filesystem_of_four(fd, parts):
        if len(chunk_files(tier)) >= room["files"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, parts)

    monkeypatch.setattr(files_mod, "write_all", filesystem_of_four)
    with caplog.at_level("WARNING", logger="kvconnect.storage.disk"):
        assert tier.put([make_item(i) for i in range(4, 10)]) == [True] * 6
        assert tier.masks([key_of(i) for i in range(10)]) == [None] * 6 + [1] * 4  # the oldest went first
        for i in range(6, 10):
            assert bytes(tier.get([key_of(i)])[0]) == encoded(make_item(i))
        room["files"] = 0  # now nothing fits at all
        assert tier.put([make_item(i) for i in range(10, 20)]) == [False] * 10
    assert tier.stats().errors == 10 and tier.stats().evictions >= 6
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1, [r.getMessage() for r in caplog.records]


def test_read_permission_error_is_a_miss(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), FP, 1 << 20)
    tier.put([make_item(1), make_item(2)])

    def denied(path, size_bytes):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(files_mod, "open_for_read", denied)
    assert tier.get([key_of(1)]) == [None]
    assert tier.read_into(key_of(2), memoryview(bytearray(8192))) is None
    assert tier.stats().errors == 2 and len(tier) == 0


def test_unusable_directory_is_a_typed_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError):
        DiskTier(str(blocker / "sub"), FP, 1 << 20)
    with pytest.raises(StorageError):
        DiskTier(str(tmp_path), FP, 0)


def test_concurrent_rewrites_read_whole_versions_only(tmp_path):
    import threading

    tier = DiskTier(str(tmp_path), FP, 1 << 24)
    versions = [make_item(1, payload_bytes=1 << 18, version=v) for v in range(2)]
    wanted = {encoded(v) for v in versions}
    tier.put([versions[0]])
    stop = threading.Event()

    def rewrite():
        n = 0
        while not stop.is_set():
            tier.put([versions[n % 2]])
            n += 1

    thread = threading.Thread(target=rewrite)
    thread.start()
    try:
        seen = [tier.get([key_of(1)])[0] for _ in range(300)]
    finally:
        stop.set()
        thread.join()
    assert all(bytes(s) in wanted for s in seen if s is not None)
    assert any(s is not None for s in seen) and tier.stats().corrupt == 0


_WRITER = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from kvconnect.storage.disk import DiskTier
from chunk_items import FP, make_item
tier = DiskTier({root!r}, FP, 1 << 34)
i = 0
while True:
    tier.put([make_item(i, payload_bytes=1 << 21)])
    i += 1
"""


def test_kill_9_during_writes_then_restart_serves_no_bad_chunk(tmp_path):
    root = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(tests=str(Path(__file__).parent), root=str(root))])
    try:
        deadline = time.monotonic() + 60
        while True:  # kill mid-write: freeze the writer while a temporary file exists
            while len(list(root.rglob("*.kvc"))) < 6 or not list(root.rglob("*.tmp")):
                assert proc.poll() is None and time.monotonic() < deadline, "writer did not make progress"
            proc.send_signal(signal.SIGSTOP)
            if list(root.rglob("*.tmp")):
                break
            proc.send_signal(signal.SIGCONT)  # it renamed the file between the two looks: again
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list(root.rglob("*.tmp"))
    tier = DiskTier(str(root), FP, 1 << 34)
    assert not list(root.rglob("*.tmp")), "temporary files of the killed writer must be removed"
    assert len(tier) >= 6
    keys = list(chunk_files(tier))
    got = tier.get(keys)
    for key, data in zip(keys, got):
        i = int.from_bytes(key, "little")
        assert data is not None and bytes(data) == encoded(make_item(i, payload_bytes=1 << 21))
    assert tier.stats().errors == 0


def test_engine_store_then_disk_retrieve_is_exact(tmp_path):
    layout = kv_rig.mla_layout()
    eng = kv_rig.make_engine(layout, local_disk=f"file://{tmp_path}", max_local_disk_size=0.01)
    n = 5 * kv_rig.CHUNK_TOKENS + 7
    assert kv_rig.store_prompt(eng, 1, n) == 5 * kv_rig.CHUNK_TOKENS
    assert eng.storage.flush(30)
    eng.pool.clear()
    assert eng.lookup(kv_rig.tokens(1, n)) == 5 * kv_rig.CHUNK_TOKENS
    assert kv_rig.retrieve_prompt(eng, 1, n) == 5 * kv_rig.CHUNK_TOKENS
    assert eng.storage.promotions == 5 and len(eng.pool) == 5
    eng.close()
    # A restarted engine on the same directory gets the same hits from the rebuilt index.
    again = kv_rig.make_engine(layout, local_disk=str(tmp_path), max_local_disk_size=0.01)
    assert kv_rig.retrieve_prompt(again, 1, n) == 5 * kv_rig.CHUNK_TOKENS
    # A layout of another model shares the directory but none of the chunks.
    other = kv_rig.make_engine(kv_rig.mla_layout(model="another"), local_disk=str(tmp_path), max_local_disk_size=0.01)
    assert other.lookup(kv_rig.tokens(1, n)) == 0
    again.close()
    other.close()


def test_engine_serves_through_disk_corruption(tmp_path):
    layout = kv_rig.mla_layout()
    eng = kv_rig.make_engine(layout, local_disk=str(tmp_path), max_local_disk_size=0.01)
    n = 4 * kv_rig.CHUNK_TOKENS
    kv_rig.store_prompt(eng, 2, n)
    eng.storage.flush(30)
    eng.pool.clear()
    third = eng.chunks(kv_rig.tokens(2, n), include_partial=False)[2].key
    path = chunk_files(eng.storage.tiers[0])[third]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert kv_rig.retrieve_prompt(eng, 2, n) == 2 * kv_rig.CHUNK_TOKENS  # stops before the bad chunk
    assert not path.exists() and eng.storage.tiers[0].stats().corrupt == 1
    eng.close()


def test_engine_with_a_disk_smaller_than_its_prompts_keeps_serving(tmp_path):
    layout = kv_rig.mla_layout()
    chunk_file_bytes = 2 * kv_rig.CHUNK_TOKENS * 1152 + chunk_format.FIXED_HEADER_BYTES + 16
    eng = kv_rig.make_engine(layout, local_disk=str(tmp_path), max_local_disk_size=3.5 * chunk_file_bytes / 2**30)
    a, b = 2 * kv_rig.CHUNK_TOKENS, 3 * kv_rig.CHUNK_TOKENS
    kv_rig.store_prompt(eng, 5, a)
    eng.storage.flush(30)
    kv_rig.store_prompt(eng, 6, b, offset=20)
    eng.storage.flush(30)
    disk = eng.storage.tiers[0]
    assert len(disk) == 3 and disk.stats().evictions == 2 and disk.stats().used_bytes == 3 * chunk_file_bytes
    eng.pool.clear()
    assert eng.lookup(kv_rig.tokens(5, a)) == 0  # evicted from disk: a miss, recomputed
    assert kv_rig.retrieve_prompt(eng, 5, a) == 0
    assert kv_rig.retrieve_prompt(eng, 6, b) == b
    eng.close()
