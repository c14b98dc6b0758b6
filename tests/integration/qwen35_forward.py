"""One vLLM run of the tiny Qwen3.5 (Gated DeltaNet hybrid), in its own process.

    python tests/integration/qwen35_forward.py --model DIR --prompts P.json --out R.json \
        [--prefix-caching true] [--connector none|kvconnect|recorder] ...

``tests/integration/qwen35_harness`` must be on PYTHONPATH (the ``torchvision`` import stub
and the recording connector). Prompts: JSON list of phases, each a list of token-id lists.
Requests run one at a time (batching changes logprobs), greedily, with the chosen token's
logprob; with ``--reset-between-phases true`` vLLM's own prefix cache is emptied before
every phase but the first. Writes ``{"outputs": [[ids]], "logprobs": [[float]],
"cached_tokens": [vLLM's own prefix hit per request], "stats": [kvconnect worker stats per
phase], "resets": [bool], "loads": [[{"hit", "loaded", "randomized"}] per request],
"config": {...}, "seconds": {...}}``.

With kvconnect, ``--local-disk DIR`` adds the disk tier (flushed before the process ends, so a
later process reads it), ``--server-url URL`` makes the node cache server's shared pool the pool and ``--randomize-state true`` overwrites, right after each restore, the
state blocks kvconnect just wrote (the rows of the restore point, every state group) with random
bytes: the negative control of the hit tests (a wrong snapshot must change the outputs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from connector_hooks import record_loads


def _bool(s: str) -> bool:
    return s.lower() in ("1", "true", "yes")


class _LoadRecorder:
    """Wraps the kvconnect worker's per-request restore (this test process only): records each
    load's hit and loaded tokens and, when asked, randomises the state blocks it restored."""

    def __init__(self, randomize: bool, seed: int = 1234) -> None:
        self.randomize, self.seed = randomize, seed
        self.loads: list[dict] = []
        self.kv_caches: dict = {}
        self.state_groups: dict[int, tuple[int, list[str]]] = {}  # vLLM group -> (block size, layers)

    def install(self) -> None:
        record_loads(self.loads, self._registered, self._randomize)

    def _registered(self, connector, kv_caches) -> None:
        self.kv_caches = dict(kv_caches)
        for g, group in enumerate(connector._kv_cache_config.kv_cache_groups):
            if type(group.kv_cache_spec).__name__ == "MambaSpec":
                spec = group.kv_cache_spec
                self.state_groups[g] = (int(spec.block_size), list(group.layer_names), spec)

    def _randomize(self, block_ids, landed: int) -> int:
        """Overwrite the state blocks of the restore point ``landed`` (block-table row landed / B - 1
        of every state group) with plausible random states: each state of the spec (conv, recurrent)
        as normal values of its dtype, at its offset in the page, so the forward runs on finite
        numbers; how many blocks were overwritten."""
        import torch

        if not self.randomize or landed <= 0:
            return 0
        gen = torch.Generator().manual_seed(self.seed + landed)
        done = 0
        for g, (block_tokens, layers, spec) in sorted(self.state_groups.items()):
            row = landed // block_tokens - 1
            if landed % block_tokens or row < 0 or row >= len(block_ids[g]) or block_ids[g][row] == 0:
                continue
            for layer in layers:
                page = self.kv_caches[layer][block_ids[g][row]].reshape(-1)  # int8 bytes of one state page
                at = 0
                for shape, dtype in zip(spec.shapes, spec.dtypes):
                    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                    values = torch.randn(math.prod(shape), generator=gen).to(dtype)
                    page[at:at + n].copy_(values.view(torch.int8))
                    at += n
                done += 1
        return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefix-caching", type=_bool, default=False,
                        help="vLLM's own prefix cache (mamba_cache_mode 'align' when on)")
    parser.add_argument("--reset-between-phases", type=_bool, default=False)
    parser.add_argument("--connector", choices=("none", "kvconnect", "recorder"), default="none")
    parser.add_argument("--lookup-url", default=None, help="kvconnect's lookup channel (kvconnect only)")
    parser.add_argument("--record-path", default=None, help="recorder's JSONL output (recorder only)")
    parser.add_argument("--claim-tokens", type=int, default=0, help="recorder: external tokens to claim")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=128, help="kvconnect's chunk size (0: chosen from vLLM's layout)")
    parser.add_argument("--local-disk", default=None, help="kvconnect's disk tier directory")
    parser.add_argument("--defaults", type=_bool, default=False,
                        help="kvconnect: no setting but the tier (--local-disk / --server-url): no chunk size, "
                             "lookup channel or pool size")
    parser.add_argument("--server-url", default=None, help="kvconnect's node cache server (its shared pool)")
    parser.add_argument("--save-decode-cache", type=_bool, default=False, help="kvconnect: store generated tokens' chunks")
    parser.add_argument("--randomize-state", type=_bool, default=False,
                        help="kvconnect: randomise the restored state blocks after each load (negative control)")
    parser.add_argument("--verify-rate", type=float, default=0.0, help="kvconnect's verify_rate (verified restores)")
    parser.add_argument("--state-fault", default="",
                        help="TEST HARNESS: JSON {\"phase\": N, \"donor\": [token ids]}: before phase N, the stored state "
                             "snapshots of that phase's prompts are replaced by those stored for the donor prompt "
                             "(tests/support/stored_faults.py: a snapshot from the wrong position)")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # connectors run in this process
    start = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    recorder = _LoadRecorder(args.randomize_state)
    if args.connector == "kvconnect":
        recorder.install()
        extra = {"lookup_url": args.lookup_url, "chunk_size": args.chunk_size, "max_local_cpu_size": 0.25,
                 "lookup_timeout_s": 10.0, "save_decode_cache": args.save_decode_cache}
        if not args.chunk_size:  # 0: kvconnect chooses it from vLLM's layout
            del extra["chunk_size"]
        if args.defaults:  # what a user sets: a tier, nothing else (the chunk size is kvconnect's choice)
            extra = {}
        if args.local_disk:
            extra.update(local_disk=args.local_disk, max_local_disk_size=0.25)
        if args.server_url:
            extra.update(server_url=args.server_url)
        if args.verify_rate:
            extra.update(verify_rate=args.verify_rate)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVConnectConnector", kv_role="kv_both",
            kv_connector_module_path="kvconnect.integrations.vllm", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    elif args.connector == "recorder":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RecordingConnector", kv_role="kv_both", kv_connector_module_path="qwen35_recorder",
            kv_connector_extra_config={"record_path": args.record_path, "claim_tokens": args.claim_tokens})
    if args.prefix_caching:
        kwargs.update(enable_prefix_caching=True, mamba_cache_mode="align")
    else:
        kwargs.update(enable_prefix_caching=False)
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1, enforce_eager=True, seed=0,
              distributed_executor_backend="uni", **kwargs)
    started = time.monotonic()
    cache = llm.llm_engine.vllm_config.cache_config
    config = {"block_size": cache.block_size, "enable_prefix_caching": cache.enable_prefix_caching,
              "mamba_cache_mode": str(cache.mamba_cache_mode),
              "conv_state_layout": os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")}
    with open(args.prompts) as f:
        phases = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True, logprobs=0)
    client = None
    if args.connector == "kvconnect":
        from kvconnect.integrations.vllm.lookup_channel import LookupClient, rank_address
        from kvconnect.integrations.vllm.ranks import default_channel_address

        # the connector's own channel when none was given (--defaults): derived as it derives it
        url = args.lookup_url or default_channel_address(llm.llm_engine.vllm_config)
        client = LookupClient([rank_address(url, 0)], timeout_s=10.0)
    outputs, logprobs, cached, stats, resets, loads = [], [], [], [], [], []
    state_fault = json.loads(args.state_fault) if args.state_fault else None
    faults_made = []
    for i, prompts in enumerate(phases):
        if i and args.reset_between_phases:
            resets.append(bool(llm.reset_prefix_cache()))
        if state_fault and i == state_fault["phase"]:
            import sys
            from pathlib import Path

            from vllm.distributed.kv_transfer import get_kv_transfer_group

            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support
            from support import stored_faults

            engine = get_kv_transfer_group()._worker.engine
            faults_made += [stored_faults.state_from(engine, p, state_fault["donor"]) for p in prompts]
        for prompt in prompts:  # one request at a time: bit-deterministic
            before = len(recorder.loads)
            (r,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            out = r.outputs[0]
            outputs.append(list(out.token_ids))
            logprobs.append([step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs)])
            cached.append(r.num_cached_tokens)
            loads.append(recorder.loads[before:])
        if client is not None:
            stats.append(client.stats())
    if client is not None:
        client.close()
    extra_out = {}
    if args.connector == "kvconnect":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        import kvconnect

        worker = get_kv_transfer_group()._worker
        worker.drain()
        if worker.engine is not None:  # lower tiers are written behind: a later process reads them
            extra_out["flushed"] = worker.engine.storage.flush(timeout_s=60.0)
            extra_out["fingerprint"] = worker.engine.layout.fingerprint.hex()
        extra_out["kvconnect"] = kvconnect.__file__  # the tree under test
    with open(args.out, "w") as f:
        json.dump({"outputs": outputs, "logprobs": logprobs, "cached_tokens": cached, "stats": stats,
                   "resets": resets, "loads": loads, "config": config, "faults_made": faults_made, **extra_out,
                   "seconds": {"start": started - start, "generate": time.monotonic() - started}}, f)
    del llm


if __name__ == "__main__":
    main()
