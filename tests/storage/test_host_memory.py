"""The host-memory bound of a pre-faulted pool (kvconnect/storage/host_memory.py): physical
memory, memory available now and a cgroup's room, whichever is smallest."""

from __future__ import annotations

import pytest

from kvconnect.errors import ConfigError
from kvconnect.storage import host_memory

GIB = 1 << 30


def test_available_memory_is_this_hosts_memavailable():
    with open("/proc/meminfo") as f:
        line = next(x for x in f if x.startswith("MemAvailable:"))
    got = host_memory.available_memory_bytes()
    assert got is not None and 0 < got <= host_memory.physical_memory_bytes()
    assert abs(got - int(line.split()[1]) * 1024) < GIB  # read moments apart on a busy host


@pytest.mark.parametrize("v2,v1,room", [
    ({"memory.max": "max\n", "memory.current": "100\n"}, {}, None),  # v2 without a limit
    ({"memory.max": f"{4 * GIB}\n", "memory.current": f"{GIB}\n"}, {}, 3 * GIB),
    ({}, {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "5\n"}, None),  # v1 "no limit"
    ({}, {"memory.limit_in_bytes": f"{2 * GIB}\n", "memory.usage_in_bytes": f"{3 * GIB}\n"}, 0),  # over: no room
])
def test_cgroup_room(tmp_path, v2, v1, room):
    for sub, files in (("v2", v2), ("v1", v1)):
        (tmp_path / sub).mkdir()
        for name, text in files.items():
            (tmp_path / sub / name).write_text(text)
    assert host_memory.cgroup_room_bytes(str(tmp_path / "v2"), str(tmp_path / "v1")) == room


def test_a_pool_above_available_memory_is_refused_before_allocating():
    room, why = host_memory.host_room()
    assert room is not None and room <= host_memory.physical_memory_bytes()
    with pytest.raises(ConfigError) as err:
        host_memory.allocate(room + GIB, pin_memory=False, what="max_local_cpu_size (LMCACHE_MAX_LOCAL_CPU_SIZE) = x GB")
    assert "LMCACHE_MAX_LOCAL_CPU_SIZE" in str(err.value) and why in str(err.value)
    host_memory.check_fits_host(room // 2, "half of what is free")  # fits: no error
