"""Who may use the node cache server: the peer of every frame, checked before it is decoded.

    policy = PeerPolicy(allow_gid=1001)            # default: only the server's own uid
    gate = Gate(policy, ipc=True)
    principal = gate.principal(frame)              # "uid:1000", "token", or None (drop it)

An ``ipc://`` server knows each peer from the kernel: libzmq reads ``SO_PEERCRED`` when the
connection is accepted and hands it out as the frame's ``Peer-Address`` property
(``"<addr>:<uid>:<gid>:<pid>"``). A peer is admitted when its uid is the server's own, is in
``allow_uids``, or when ``allow_gid`` is set and is its effective or a supplementary group.
The credentials are checked on every frame, never cached per ZMQ routing id (a later peer
may claim a departed peer's id). Group membership from the group database is remembered per
uid for at most ``GROUP_RECHECK_S`` and read again at each hello of a peer admitted by it
(``readmit``): a member removed from the group gets no new session, and within a minute no
answer at all. The socket file and the shared segment get the mode this
policy implies (``file_mode``: 0600, or 0660 owned by ``allow_gid``), so the file system
refuses foreign peers first and ``SO_PEERCRED`` catches a mode loosened by hand.

A ``tcp://`` server cannot know the peer's uid: every frame must carry the HMAC of the
token (``protocol.open_frame``), and all token holders are one principal, ``"token"``.

Principals are all-or-nothing: an admitted peer may read, write and remove any chunk.
Binding an entry to its writer would be theatre, because every admitted peer can map the
segment and write any byte of it; what stops a forged entry from reaching an engine is the
checksum each reader verifies (``client.SharedPoolClient.acquire``). Sessions are bounded
per principal (``max_sessions_per_peer``) so one admitted peer cannot take every session.
"""

from __future__ import annotations

import grp
import os
import pwd
import time
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

DEFAULT_MAX_SESSIONS_PER_PEER = 1024  # of MAX_CLIENTS (4096): four principals cannot starve a fifth
_GROUP_CACHE_ENTRIES = 1024  # uids whose supplementary groups are remembered
GROUP_RECHECK_S = 60.0  # a uid's remembered membership is read again after this long


@dataclass(frozen=True, kw_only=True)
class PeerPolicy:
    """Admission rules of an ``ipc://`` server (a ``tcp://`` one admits by token only)."""

    allow_uids: frozenset[int] = frozenset()
    allow_gid: Optional[int] = None
    max_sessions_per_peer: int = DEFAULT_MAX_SESSIONS_PER_PEER

    def __post_init__(self) -> None:
        if any(type(u) is not int or u < 0 for u in self.allow_uids):
            raise ConfigError(f"allowed uids must be ints >= 0, got {sorted(self.allow_uids)}")
        if self.allow_gid is not None and (type(self.allow_gid) is not int or self.allow_gid < 0):
            raise ConfigError(f"allowed gid must be an int >= 0, got {self.allow_gid!r}")
        if self.max_sessions_per_peer <= 0:
            raise ConfigError(f"max sessions per peer must be > 0, got {self.max_sessions_per_peer}")

    @property
    def file_mode(self) -> int:
        """Mode of the socket file and the segment: the group may connect and map only when allowed."""
        return 0o660 if self.allow_gid is not None else 0o600

    def apply_to(self, path: str) -> None:
        """Give ``path`` (socket file or segment) the mode and group this policy implies."""
        if self.allow_gid is not None:
            os.chown(path, -1, self.allow_gid)
        os.chmod(path, self.file_mode)


def parse_peer_address(value: Optional[str]) -> Optional[tuple[int, int]]:
    """(uid, gid) from an ipc frame's ``Peer-Address`` (``"<addr>:<uid>:<gid>:<pid>"``), or None
    when libzmq could not read the credentials."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1]), int(parts[2])


class Gate:
    """The principal of each frame's peer, or None for a peer that is not admitted."""

    def __init__(self, policy: PeerPolicy, *, ipc: bool) -> None:
        self.policy = policy
        self.ipc = ipc
        self.own_uid = os.geteuid()
        self._in_group: dict[int, tuple[bool, float]] = {}  # uid -> (member, when it was read)
        self._by_database: set[int] = set()  # uids admitted only as group members in the database

    def principal(self, frame) -> Optional[str]:
        """``frame``: a ``zmq.Frame`` received with ``copy=False`` (its properties are the peer's)."""
        if not self.ipc:
            return "token"  # the frame's HMAC, checked next, is the admission
        try:
            creds = parse_peer_address(frame.get("Peer-Address"))
        except Exception:  # a frame without properties (libzmq built without SO_PEERCRED)
            creds = None
        if creds is None:
            return None
        uid, gid = creds
        policy = self.policy
        if uid == self.own_uid or uid in policy.allow_uids or (policy.allow_gid is not None and gid == policy.allow_gid):
            return f"uid:{uid}"
        if policy.allow_gid is not None and self._member(uid):
            self._by_database.add(uid)
            return f"uid:{uid}"
        return None

    def readmit(self, principal: str) -> bool:
        """At a hello: whether ``principal``, if the group database admitted it, is still a
        member (read again now, not remembered)."""
        if not principal.startswith("uid:"):
            return True
        uid = int(principal[4:])
        if uid not in self._by_database:
            return True  # its own uid, an allowed uid, or the group in the kernel's credentials
        self._in_group.pop(uid, None)
        if self._member(uid):
            return True
        self._by_database.discard(uid)
        return False

    def _member(self, uid: int) -> bool:
        """Whether the user ``uid`` has ``allow_gid`` among its groups in the group database
        (remembered per uid for ``GROUP_RECHECK_S``)."""
        now = time.monotonic()
        known = self._in_group.get(uid)
        if known is None or now - known[1] >= GROUP_RECHECK_S:
            try:
                user = pwd.getpwuid(uid)
                member = self.policy.allow_gid in os.getgrouplist(user.pw_name, user.pw_gid)
            except (KeyError, OSError):
                member = False
            if len(self._in_group) >= _GROUP_CACHE_ENTRIES:
                self._in_group.clear()
                self._by_database.clear()
            known = self._in_group[uid] = (member, now)
        return known[0]


def group_id(name_or_id: str) -> int:
    """A gid from a group name or number (the CLI's ``--allow-group``)."""
    if name_or_id.isdigit():
        return int(name_or_id)
    try:
        return grp.getgrnam(name_or_id).gr_gid
    except KeyError:
        raise ConfigError(f"no group named {name_or_id!r}") from None
