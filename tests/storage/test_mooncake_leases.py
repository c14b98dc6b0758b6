"""A lookup renews both parts of a chunk or neither, against a real ``mooncake_master``.

Mooncake grants a lease on an object an existence check or a read touches (an unforced remove,
which is what Mooncake's own eviction respects, then fails with -706 until the lease ends).
Lookups used to check only the header objects: headers were renewed and payloads were the
ones evicted, leaving headers every lookup offered. Now both parts are checked, and a chunk
with one part gone is not offered.
"""

from __future__ import annotations

import os

import pytest

from support.mooncake_master import client_env, mooncake_available
from mooncake_rig import master, reader, stored, tier_of  # noqa: F401 (fixtures)

from kvconnect.storage.mooncake.codes import Meaning, meaning
from kvconnect.storage.mooncake.config import MooncakeSpec, import_store

_REASON = mooncake_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
os.environ.update({k: v for k, v in client_env().items() if k.startswith(("MC_", "GLOG_"))})


def test_a_lookup_renews_both_parts_of_each_chunk(stored, master, tmp_path):
    _, _, engine, tokens, *_ = reader(master, tmp_path)
    tier = tier_of(engine)
    other = import_store(MooncakeSpec(master_address=master.address))()
    assert other.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address) == 0
    try:
        keys = [c.key for c in engine.chunks(tokens, include_partial=False)]
        assert all(m is not None for m in tier.masks(keys))
        headers = [tier.object_keys(k)[0] for k in keys]
        payloads = [tier.object_keys(k)[1] for k in keys]
        codes = other.batch_remove(headers + payloads, False)  # unforced: what a lease protects from
        assert {meaning(c) for c in codes} == {Meaning.IN_USE}, codes  # every part leased, none removed
        assert all(m is not None for m in tier.masks(keys))
        # a chunk whose payload is gone (evicted) is not offered by the lookup
        assert other.batch_remove([payloads[0]], True) == [0]
        masks = tier.masks(keys)
        assert masks[0] is None and all(m is not None for m in masks[1:])
    finally:
        other.close()
        engine.close()
