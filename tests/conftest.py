"""Shared test setup: puts ``tests/`` on sys.path (for the ``support`` package) and bounds hypothesis.

Hypothesis runs a fixed, small number of examples with no deadline (the suite must stay
fast on 2 cores and never depend on timing); ``HYPOTHESIS_PROFILE=thorough`` runs more.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile("kvconnect", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvconnect"))


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id, so every test is reproducible on its own."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def clean_env(monkeypatch):
    """Tests build their Config explicitly; stray LMCACHE_*/KVCONNECT_* vars must not leak in."""
    for var in list(os.environ):
        if var.startswith(("LMCACHE_", "KVCONNECT_")):
            monkeypatch.delenv(var)
