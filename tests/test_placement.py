"""Copy-thread placement from the engine's OpenMP binding (kvconnect.transfer.placement)."""

from __future__ import annotations

import os
import threading

import pytest

from kvconnect.transfer.placement import engine_compute_cores, pin_current_thread, plan_copy_threads, serve_compute_cores


@pytest.mark.parametrize("env, cores", [
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),  # vLLM CPU with the default libgomp
    ({"OMP_PLACES": "{0},{1},{4}"}, {0, 1, 4}),
    ({"OMP_PLACES": "{2:3}"}, {2, 3, 4}),
    ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),  # vLLM with libgomp in LD_PRELOAD
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,2-3]"}, {0, 2, 3}),  # with libiomp
    ({"OMP_PLACES": "cores"}, None),
    ({}, None),
    ({"GOMP_CPU_AFFINITY": "zero"}, None),
])
def test_engine_compute_cores(env, cores):
    assert engine_compute_cores(env) == (frozenset(cores) if cores is not None else None)


def test_stores_go_to_the_cores_the_engine_reserved():
    # 4 cores, vLLM binds 0-2 and reserves 3: one store thread on core 3, loads on the 3 engine cores
    p = plan_copy_threads(8, environ={"OMP_PLACES": "{0,1,2}"}, allowed=frozenset(range(4)))
    assert (p.store_threads, p.store_cores, p.load_threads) == (1, frozenset({3}), 3)
    # every core computes (the 2-core case with a connector and no VLLM_CPU_NUM_OF_RESERVED_CPU)
    p = plan_copy_threads(8, environ={"OMP_PLACES": "{0,1}"}, allowed=frozenset({0, 1}))
    assert (p.store_threads, p.store_cores, p.load_threads) == (1, None, 2)
    # the configured count stays an upper bound
    p = plan_copy_threads(2, environ={"OMP_PLACES": "{0}"}, allowed=frozenset(range(8)))
    assert (p.store_threads, p.load_threads) == (2, 1) and p.store_cores == frozenset(range(1, 8))


def test_another_ranks_compute_cores_are_not_free():
    """TP or DP ranks of one vllm-cpu serve: ``VLLM_CPU_OMP_THREADS_BIND`` lists every rank's
    cores, the process's own binding only its own. A rank's store thread must not land on its
    neighbour's compute cores (the 2-core DP / TP 2 case: both cores compute)."""
    rank0 = {"OMP_PLACES": "{0}", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    p = plan_copy_threads(8, environ=rank0, allowed=frozenset({0, 1}))
    assert (p.store_threads, p.store_cores, p.load_threads) == (1, None, 1)
    assert "other ranks" in p.reason
    # 8 cores, two ranks on 0-2 and 4-6: each stores on the two cores nobody computes on
    rank1 = {"OMP_PLACES": "{4,5,6}", "VLLM_CPU_OMP_THREADS_BIND": "0-2|4-6"}
    p = plan_copy_threads(8, environ=rank1, allowed=frozenset(range(8)))
    assert (p.store_threads, p.store_cores, p.load_threads) == (2, frozenset({3, 7}), 3)
    # auto / nobind / garbage name no cores: the rule of the process's own binding alone
    for value in ("auto", "nobind", "0-x|1"):
        p = plan_copy_threads(8, environ={"OMP_PLACES": "{0}", "VLLM_CPU_OMP_THREADS_BIND": value}, allowed=frozenset({0, 1}))
        assert p.store_cores == frozenset({1})


@pytest.mark.parametrize("value, cores", [("0|1", {0, 1}), ("0-31|32-63", set(range(64))), ("0,2|4", {0, 2, 4}),
                                          ("auto", set()), ("", set()), ("nobind", set()), ("a|b", set())])
def test_serve_compute_cores(value, cores):
    assert serve_compute_cores({"VLLM_CPU_OMP_THREADS_BIND": value}) == frozenset(cores)


def test_no_binding_or_a_gpu_engine_keeps_the_configured_threads():
    p = plan_copy_threads(4, environ={})  # a CPU engine that binds nothing may compute everywhere
    assert (p.store_threads, p.load_threads, p.store_cores) == (1, 4, None)
    p = plan_copy_threads(4, device_type="cuda", environ={"OMP_PLACES": "{0}"})
    assert (p.store_threads, p.load_threads, p.store_cores) == (4, 4, None)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pinning_affects_only_the_calling_thread():
    before = os.sched_getaffinity(0)
    target = frozenset([min(before)])
    seen = {}

    def run():
        seen["pinned"] = pin_current_thread(target)
        seen["mask"] = os.sched_getaffinity(0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["pinned"] and seen["mask"] == target
    assert os.sched_getaffinity(0) == before
    assert not pin_current_thread(None)
