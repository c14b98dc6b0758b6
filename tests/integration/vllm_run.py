"""One vLLM engine run for the end-to-end tests, in its own process (engine teardown stays out).

    python tests/integration/vllm_run.py --model DIR --out result.json [--connector URL] ...

Generates greedily, one phase at a time, from the prompts given as JSON lists of token
ids (or ``{"tokens": [...], "cache_salt": "..."}`` for a salted request); before every phase but the first, vLLM's own prefix cache is reset, so a prefix can
only come back through kvconnect (``--reset-between-phases false`` keeps it). With ``--connector``, after each phase the workers'
counters are read over the connector's lookup channel (``lookup_url`` = URL). Writes
``{"outputs": [[ids...], ...], "stats": [[{...} per rank] per phase], "resets": [bool per reset],
"seconds": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: list of phases, each a list of token-id lists")
    parser.add_argument("--connector", default=None, help="lookup channel URL; omit to run without a connector")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default=None,
                        help="vLLM's attention backend by name (e.g. CPU_MLA: the reference MLA backend, which vLLM "
                             "otherwise replaces by AMX_MLA on CPUs with AMX)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--save-decode-cache", type=lambda s: s.lower() in ("1", "true"), default=False)
    parser.add_argument("--reset-between-phases", type=lambda s: s.lower() in ("1", "true"), default=True)
    parser.add_argument("--reset-before", default="",
                        help="comma-separated phase numbers before which vLLM's prefix cache is reset (instead of "
                             "between every two phases)")
    parser.add_argument("--min-load-tokens", type=int, default=None, help="omitted: kvconnect's default")
    parser.add_argument("--connector-resets", default="",
                        help="comma-separated phase numbers before which the reset also reaches the connector "
                             "(reset_prefix_cache(reset_connector=True), what RL frameworks call after a weight update)")
    parser.add_argument("--local-disk", default=None, help="kvconnect's disk tier directory (off when omitted)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="vLLM's KV-cache size in blocks (a small cache forces preemptions)")
    parser.add_argument("--save-delay-ms", type=float, default=0.0,
                        help="TEST HARNESS: every kvconnect save sleeps this long before it reads vLLM's blocks, "
                             "so saves still run when later steps reuse blocks (in-process worker only)")
    parser.add_argument("--logprobs", type=int, default=0, help="also return the top-N logprobs of every generated token")
    parser.add_argument("--faults", default="",
                        help="TEST HARNESS: JSON {\"phase\": N, \"faults\": [[prompt index, fault], ...]}: before phase N, "
                             "rewrite the stored bytes of those prompts of phase N in the worker engine's pool "
                             "(support/stored_faults.py; in-process worker only)")
    parser.add_argument("--kv-rows", type=lambda s: s.lower() in ("1", "true"), default=False,
                        help="TEST HARNESS: per phase and TP rank, a digest of every KV row kvconnect saved from or "
                             "restored into vLLM's blocks, read from the engine's own cache tensors (result's kv_rows)")
    parser.add_argument("--extra-config", default="{}",
                        help="JSON object merged into kv_connector_extra_config (e.g. remote_url for a lower tier)")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: fast start, clean exit
    tp = args.tensor_parallel_size
    if tp > 1:  # one CPU worker per core: 0|1|...
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    start = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if args.save_delay_ms:
        _delay_saves(args.save_delay_ms / 1e3)
    faults = json.loads(args.faults) if args.faults else None
    engines = _record_engines() if faults else []
    if args.connector:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVConnectConnector", kv_role="kv_both",
            kv_connector_module_path="kvconnect.integrations.vllm", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"lookup_url": args.connector, "chunk_size": args.chunk_size,
                                       "max_local_cpu_size": 0.25, "lookup_timeout_s": 10.0,
                                       "save_decode_cache": args.save_decode_cache,
                                       **({"local_disk": args.local_disk, "max_local_disk_size": 0.25} if args.local_disk else {}),
                                       **({} if args.min_load_tokens is None else {"min_load_tokens": args.min_load_tokens}),
                                       **json.loads(args.extra_config)},
        )
    llm = LLM(
        model=args.model, skip_tokenizer_init=True, dtype=args.dtype, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=True, seed=0, tensor_parallel_size=tp, num_gpu_blocks_override=args.num_gpu_blocks_override,
        distributed_executor_backend="mp" if tp > 1 else "uni",
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}), **kwargs,
    )
    if args.kv_rows:
        llm.collective_rpc(_record_kv_rows, args=(args.block_size,))  # every TP rank's worker process
    started = time.monotonic()
    with open(args.prompts) as f:
        phases = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True,
                            logprobs=args.logprobs or None)
    outputs, stats, resets, logprobs, cached, kv_rows = [], [], [], [], [], []
    client = None
    if args.connector:
        from kvconnect.integrations.vllm.lookup_channel import LookupClient, rank_address

        client = LookupClient([rank_address(args.connector, i) for i in range(tp)], timeout_s=10.0)
    connector_resets = {int(x) for x in args.connector_resets.split(",") if x}
    reset_before = {int(x) for x in args.reset_before.split(",") if x}
    for i, prompts in enumerate(phases):
        if i in connector_resets:
            resets.append(bool(llm.reset_prefix_cache(reset_connector=True)))
        elif i and reset_before:
            if i in reset_before:
                resets.append(bool(llm.reset_prefix_cache()))
        elif i and args.reset_between_phases:
            resets.append(bool(llm.reset_prefix_cache()))
        if faults and i == faults["phase"]:
            from support import stored_faults

            (engine,) = engines
            made = [stored_faults.apply(engine, prompts[k], name) for k, name in faults["faults"]]
            assert all(made), f"faults not made: {made}"
        results = llm.generate([_prompt(TokensPrompt, p) for p in prompts], params, use_tqdm=False)
        outputs.extend(list(r.outputs[0].token_ids) for r in results)
        cached.extend(r.num_cached_tokens for r in results)  # vLLM's own count: its prefix cache plus the connector's
        if args.logprobs:  # per generated token: [[token id, logprob] of the top N]
            logprobs.extend([[[int(t), float(lp.logprob)] for t, lp in sorted(step.items())] for step in r.outputs[0].logprobs]
                            for r in results)
        if client is not None:
            stats.append(client.stats())  # one dict per worker (TP rank)
        if args.kv_rows:
            kv_rows.append(llm.collective_rpc(_take_kv_rows))  # per rank: {"save": {...}, "load": {...}}
    if client is not None:
        client.close()
    result = {"outputs": outputs, "stats": stats, "resets": resets, "logprobs": logprobs, "cached_tokens": cached,
              "kv_rows": kv_rows,
              "seconds": {"start": started - start, "generate": time.monotonic() - started}}
    with open(args.out, "w") as f:
        json.dump(result, f)
    del llm


def _delay_saves(seconds: float) -> None:
    """Harness only: slows kvconnect's store (not vLLM) so the race a slow store would meet in
    production (a save reading blocks a later step reuses) happens in every run."""
    from kvconnect.engine import KVCacheEngine

    store = KVCacheEngine.store

    def delayed(self, *a, **k):
        time.sleep(seconds)
        return store(self, *a, **k)

    KVCacheEngine.store = delayed


def _record_engines() -> list:
    """Harness only: the KVCacheEngines this process makes (the in-process worker's), so that
    the harness can rewrite what they stored (support/stored_faults.py)."""
    import sys
    from pathlib import Path

    from kvconnect.engine import KVCacheEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support
    made = []
    init = KVCacheEngine.__init__

    def recording(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    KVCacheEngine.__init__ = recording
    return made


def _record_kv_rows(worker, block_size: int) -> None:
    """Harness only, run in each TP rank's worker process (``collective_rpc``): records, for every
    row kvconnect saves from vLLM's blocks (when the save is handed over) or restores into them
    (right after the load), a digest of that token's bytes in every layer's cache tensor as vLLM
    allocated it (the model runner's ``kv_caches``, addressed by the scheduler's block ids; the
    token's slot is its index on the first axis after the block's of size ``block_size``), keyed
    by a digest of the tokens up to and including it. Independent of kvconnect's row model: the
    test compares what one engine restored with what another engine's blocks held when it stored."""
    import hashlib

    import torch
    from kvconnect.integrations.vllm.worker import KVConnectWorker

    caches = list(worker.model_runner.kv_caches)
    records = {"save": {}, "load": {}}
    worker.kv_rows_record = records

    slot_axes = [next(d for d in range(1, t.dim()) if t.shape[d] == block_size) for t in caches]

    def rows(kind, tokens, block_ids, start, end):
        (ids,) = block_ids  # one vLLM group (the models this is used with)
        prefix = hashlib.blake2b(digest_size=16)
        for p, token in enumerate(tokens[:end]):
            prefix.update(int(token).to_bytes(4, "little"))
            if p >= start and p // block_size < len(ids):
                row = hashlib.blake2b(digest_size=16)
                for t, axis in zip(caches, slot_axes):
                    token_row = t[ids[p // block_size]].select(axis - 1, p % block_size)
                    row.update(token_row.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                records[kind][prefix.hexdigest()] = row.hexdigest()

    save, load_one = KVConnectWorker.save, KVConnectWorker._load_one

    def recording_save(self, plan):
        for job in plan.saves:
            rows("save", job.tokens, job.block_ids, job.stored_tokens, len(job.tokens))
        return save(self, plan)

    def recording_load_one(self, job):
        landed = load_one(self, job)
        rows("load", job.tokens, job.block_ids, job.present_tokens, landed)
        return landed

    KVConnectWorker.save, KVConnectWorker._load_one = recording_save, recording_load_one


def _take_kv_rows(worker) -> dict:
    """Harness only: this rank's records since the last call (``_record_kv_rows``)."""
    records = worker.kv_rows_record
    out = {kind: dict(rows) for kind, rows in records.items()}
    for rows in records.values():
        rows.clear()
    return out


def _prompt(tokens_prompt, p):
    if isinstance(p, dict):
        return tokens_prompt(prompt_token_ids=p["tokens"], cache_salt=p["cache_salt"])
    return tokens_prompt(prompt_token_ids=p)


if __name__ == "__main__":
    main()
