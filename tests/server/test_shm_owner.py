"""Issue 31: a non-root server whose segment name another user took in a sticky directory
(/dev/shm) fails with a ConfigError naming the file and its owner, and leaves the file alone.

Real users: the squatter's file is created by a process running as uid 65534 (nobody), the
server side runs ``Segment.create`` in a process running as uid 65533; both drop privileges
after their imports (the new uid may not read the interpreter's caches).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from support import server_rig
from kvconnect.server.shm import SHM_DIR, segment_name

NOBODY = 65534
SERVER_UID = 65533
URL = "ipc:///tmp/kvc-shm-owner.sock"

pytestmark = [pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm"),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two other users: setuid")]

AS_USER = r"""
import json, os, sys
from kvconnect.errors import ConfigError
from kvconnect.server.shm import Segment
uid, what, shm_dir, url = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
if what == "squat":
    with open(os.path.join(shm_dir, sys.argv[5]), "x") as f:
        f.write("squat")
    print(json.dumps({"made": True}))
else:
    try:
        segment = Segment.create(url, b"i" * 16, 4096, 2, shm_dir=shm_dir)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "config_error": isinstance(exc, ConfigError), "message": str(exc)}))
    else:
        segment.unlink()
        print(json.dumps({"created": segment.path}))
"""


def as_user(uid: int, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", AS_USER, str(uid), *args], capture_output=True, text=True, timeout=120,
                         env=server_rig.clean_env(), cwd=server_rig.REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def sticky_dir():
    """A sticky, world-writable directory in /dev/shm: the rules of /dev/shm itself."""
    path = tempfile.mkdtemp(prefix="kvc-sticky-", dir=SHM_DIR)
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_segment_name_another_user_took_is_a_config_error_naming_file_and_owner(sticky_dir):
    name = segment_name(URL)
    path = os.path.join(sticky_dir, name)
    assert as_user(NOBODY, "squat", sticky_dir, URL, name) == {"made": True}
    got = as_user(SERVER_UID, "create", sticky_dir, URL)
    assert got["error"] == "ConfigError" and got["config_error"], got
    assert path in got["message"] and f"uid {NOBODY}" in got["message"] and f"uid {SERVER_UID}" in got["message"]
    st = os.stat(path)
    assert st.st_uid == NOBODY
    with open(path) as f:
        assert f.read() == "squat"  # left as found


def test_the_same_user_still_replaces_its_predecessors_segment(sticky_dir):
    name = segment_name(URL)
    assert as_user(SERVER_UID, "squat", sticky_dir, URL, name) == {"made": True}  # a crashed start of ours
    assert as_user(SERVER_UID, "create", sticky_dir, URL) == {"created": os.path.join(sticky_dir, name)}
