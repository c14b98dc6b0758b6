"""vLLM's cache specs, read from the installed package (0.32; 0.33 in its own stage): each has a rule in
kvconnect, or CI fails.

1. Every ``KVCacheSpec`` class the installed vLLM defines (found in its whole source,
   tests/support/spec_classes.py) is served, refused by name with a reason, or an abstract base
   (``specs.known_specs``), and docs/vllm.md's "Cache specs" table lists it: a new spec fails here
   instead of passing silently.
2. The refused specs, built by vLLM's own classes, are refused naming the class and the reason.
3. Engine-rebuilt groups (``rebuilt.py``): ``CircularBufferSpec`` and ``SlidingWindowMLASpec``
   with ``bounded_replay`` (DeepSeek V4.1) are what vLLM's own specs say: not prefix-cacheable,
   the window replayed; kvconnect gives them no GroupSpec (no bytes) and a period. The DeepSeek V4
   C128 state's spec on every platform branch of the installed compressor is one the C128 rule
   (``engine_tables.DSV4_C128_STATE_FREE``) names, in either spelling (paged or ring).
4. The C128 window-free rule on CUDA / ROCm (``engine_tables.DSV4_C128_STATE_FREE``): every reader
   of DeepSeek V4's compressor state in the installed vLLM gathers rows p - R + 1 .. p only for a
   token p closing a compression group ((p + 1) % R == 0). After a resume at a multiple of 128 such
   a group starts at or after the resume point, so no row before it is read and none needs
   restoring. The files touching the state are known per release (0.33 adds ROCm's MXFP4 indexer
   reader, ``amd/rocm.py``: C4 only). A vLLM whose readers change fails here before the rule is trusted. The Triton
   gather also runs, under Triton's interpreter on CPU (dsv4_c128_triton.py).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _docs_spec_table() -> str:
    text = DOCS.read_text()
    start = text.index("## Cache specs")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_every_installed_spec_class_has_a_rule_and_a_docs_row():
    from support import spec_classes
    from kvconnect.integrations.vllm import engine_tables, specs

    found = spec_classes.spec_classes("vllm")
    # vLLM 0.32.0's classes (the issue's list: all present in this build)
    for name in ("CircularBufferSpec", "RSWASpec", "SinkFullAttentionSpec", "HiddenStateCacheSpec",
                 "HiSparseHotSpec", "HiSparseResidentSpec", "SlidingWindowMLASpec", "MambaSpec"):
        assert name in found, name
    unknown = set(found) - specs.known_specs(engine_tables.VLLM)
    assert not unknown, f"vLLM spec classes with no kvconnect rule: {sorted(unknown)} (add them to specs.py)"
    table = _docs_spec_table()
    missing = [name for name in found if f"`{name}`" not in table]
    assert not missing, f"docs/vllm.md's Cache specs table lacks {missing}"


def _refused_cases():
    import torch
    from vllm.v1 import kv_cache_interface as kv

    attn = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return {
        "ChunkedLocalAttentionSpec": kv.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=64),
        "CrossAttentionSpec": kv.CrossAttentionSpec(**attn),
        "EncoderOnlyAttentionSpec": kv.EncoderOnlyAttentionSpec(**attn),
        "SinkFullAttentionSpec": kv.SinkFullAttentionSpec(**attn, sink_len=16),
        "HiddenStateCacheSpec": kv.HiddenStateCacheSpec(**attn),
        "HiSparseHotSpec": kv.HiSparseHotSpec(block_size=64, page_size=4096, blocks_per_request=8),
        "HiSparseResidentSpec": kv.HiSparseResidentSpec(block_size=64, page_size=4096),
    }


def test_refused_specs_are_refused_by_name_with_the_reason():
    from kvconnect.errors import UnsupportedLayoutError
    from kvconnect.integrations.vllm import specs

    cases = _refused_cases()
    for name, spec in cases.items():
        assert type(spec).__name__ == name
        with pytest.raises(UnsupportedLayoutError) as err:
            specs.group_spec_of(spec, device_type="cpu")
        assert name in str(err.value) and specs.REFUSED_SPECS[name] in str(err.value), name
    # what the reasons rest on, in vLLM's own classes
    assert not cases["HiSparseHotSpec"].prefix_cacheable and not cases["HiSparseResidentSpec"].prefix_cacheable


def test_rebuilt_specs_are_what_vllm_says_and_carry_no_group_spec():
    import torch
    from vllm.v1 import kv_cache_interface as kv
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    from kvconnect.errors import UnsupportedLayoutError
    from kvconnect.integrations.vllm import rebuilt, specs

    swa = dict(block_size=64, num_kv_heads=1, head_size=584, dtype=torch.uint8, sliding_window=128,
               cache_dtype_str="fp8_ds_mla", model_version="deepseek_v4")
    replayed = SlidingWindowMLASpec(**swa, bounded_replay=True)
    ring = kv.CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=1024, dtype=torch.float32)
    # vLLM's own view: out of prefix caching; the window recomputed after every hit; the ring per request
    assert not replayed.prefix_cacheable and replayed.prefix_replay_tokens == 128
    assert not ring.prefix_cacheable and not ring.uses_slot_mapping
    for spec in (replayed, ring):
        assert rebuilt.is_rebuilt(spec)
        with pytest.raises(UnsupportedLayoutError, match="engine-rebuilt"):
            specs.group_spec_of(spec, device_type="cpu")
    plain = SlidingWindowMLASpec(**swa)
    assert plain.prefix_cacheable and plain.prefix_replay_tokens == 0 and not rebuilt.is_rebuilt(plain)
    group = specs.group_spec_of(plain, device_type="cpu")
    assert (group.block_size, group.sliding_window, group.restore_window, group.window_free_every) == (64, 128, 127, None)


# --- the C128 compressor state's readers on CUDA / ROCm ------------------------------------------
def _source(relative: str) -> str:
    from support import spec_classes

    return (spec_classes.package_dir("vllm") / relative).read_text()


def _flat(text: str) -> str:
    return re.sub(r"\s+", "", text)


_V4 = "models/deepseek_v4/"
_BOTH = frozenset({"0.32", "0.33"})
# Every file of the installed vLLM that touches the compressor's state cache: the releases whose
# source has it touch the state, and what it does with it.
_STATE_FILES = {
    "compressor.py": (_BOTH, "allocates the cache (CompressorStateCache: the state's one spec) and calls the "
                             "writer, then one reader"),
    "common/ops/save_partial_states.py": (_BOTH, "writer: each token's kv/score at its own slot"),
    "common/ops/fused_compress_quant_cache.py": (_BOTH, "Triton readers (ROCm, XPU, indexer; two-stage on CUDA by "
                                                        "choice)"),
    "nvidia/ops/sparse_attn_compress_cutedsl.py": (_BOTH, "CuTe DSL readers (CUDA, head 512)"),
    "cpu/cpu_compressor.py": (_BOTH, "CPU reader (the bench of tests/integration/dsv4_reads.py)"),
    # 0.33: aiter's MXFP4 indexer on ROCm. Its compressor (DeepseekV4RocmMxfp4Compressor) is the
    # indexer's, and only C4 layers have an indexer, so it never reads a C128 state; it subclasses
    # DeepseekCompressor and builds no state spec (the spelling test below); its reader
    # (_compress_pool_kernel) is behind the closing-token gate (the reader test below).
    "amd/rocm.py": (frozenset({"0.33"}), "ROCm MXFP4 indexer compressor: a Triton reader of the C4 indexer's state, "
                                         "builds no spec"),
}


def _release() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return "0.33" if hasattr(KVConnectorBase_V1, "restore_kv_caches") else "0.32"  # as .ci/run tells them apart


def test_c128_state_cache_is_touched_only_by_the_known_files():
    from support import spec_classes

    root = spec_classes.package_dir("vllm") / _V4
    touching = {str(p.relative_to(root)) for p in root.rglob("*.py") if "state_cache" in p.read_text()}
    known = {path for path, (releases, _) in _STATE_FILES.items() if _release() in releases}
    assert touching == known, f"new DeepSeek V4 state-cache code on vLLM {_release()}: {sorted(touching ^ known)}"


def _state_cache_spec_spellings() -> dict[str, set[str]]:
    """Per file of the installed vLLM's DeepSeek V4 model (every platform directory), the spec
    classes that a compressor state cache's ``get_kv_cache_spec`` constructs, on any branch."""
    from support import spec_classes

    root = spec_classes.package_dir("vllm") / _V4
    trees = {path: ast.parse(path.read_text()) for path in root.rglob("*.py")}
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    # a state class: named *State*, or a subclass of one anywhere in the model's files (a platform
    # branch overriding the state's spec under another name)
    states = {c.name for c in classes if "State" in c.name}
    grew = True
    while grew:
        more = {c.name for c in classes if c.name not in states and any(
            (b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)) in states for b in c.bases)}
        states |= more
        grew = bool(more)
    found: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ClassDef) and node.name in states):
                continue
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "get_kv_cache_spec":
                    calls = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr
                             for c in ast.walk(fn) if isinstance(c, ast.Call)
                             and isinstance(c.func, (ast.Name, ast.Attribute))}
                    found.setdefault(str(path.relative_to(root)), set()).update(
                        name for name in calls if name.endswith("Spec"))
    return found


def test_c128_state_spec_on_every_platform_branch_has_the_rule():
    """DeepSeek V4's C128 state: every spec class its state cache builds, on any platform branch,
    is a spelling the one C128 rule names (paged: window-free; ring, vLLM PR 58074: rebuilt on the
    rule's period). A new spelling (PR 58074 landing, another platform) without a rule fails here."""
    from kvconnect.integrations.vllm.engine_tables import DSV4_C128_STATE_FREE as rule

    spellings = _state_cache_spec_spellings()
    assert spellings, "no DeepSeek V4 compressor state cache found in the installed vLLM"
    named = set(rule.spec_classes) | set(rule.ring_spec_classes)
    for path, classes in spellings.items():
        assert classes and classes <= named, f"{path}: the C128 state is built as {sorted(classes)}; rule: {sorted(named)}"
    assert "SlidingWindowMLASpec" in spellings["compressor.py"]  # vLLM 0.32's paged spelling
    assert rule.every == 128 and ("head_size", 1024) in rule.ring_match


def test_c128_state_geometry_matches_the_rule():
    from kvconnect.integrations.vllm.engine_tables import DSV4_C128_STATE_FREE

    src = _flat(_source(_V4 + "compressor.py"))
    # C128: coff 1, window = 128, 8-row blocks, fp32 -> the rule's match
    for line in ("coff=1+(compress_ratio==4)", "self.sliding_window=coff*compress_ratio",
                 "elifcompress_ratio==128:self.block_size=8", "assertself.dtype==torch.float32"):
        assert line in src, line
    assert dict(DSV4_C128_STATE_FREE.match) == {"dtype": "float32", "sliding_window": 128, "block_size": 8}
    assert DSV4_C128_STATE_FREE.every == 128 and {"cpu", "cuda"} <= DSV4_C128_STATE_FREE.device_types


def test_every_cuda_rocm_reader_gathers_only_the_closing_group():
    """Each reader: active only for a token p with (p + 1) % ratio == 0; rows start = p - window + 1 .. p,
    window = ratio at C128 (no overlap). Every ``start =`` in the reader files is one of these."""
    cutedsl = _source(_V4 + "nvidia/ops/sparse_attn_compress_cutedsl.py")
    flat = _flat(cutedsl)
    starts = [_flat(s) for s in re.findall(r"^\s*start\s*=\s*(.+)$", cutedsl, re.MULTILINE)]
    assert starts and set(starts) <= {"position-Int64(window-1)", "position-Int64(compress_ratio-1)"}, starts
    assert "window=(1+int(overlap))*compress_ratio" in flat and "overlap=compress_ratio==4" in flat
    assert flat.count("boundary=has_positionand((position+Int64(1))%Int64(compress_ratio)==Int64(0))") >= 3
    assert flat.count("andboundary") >= 3  # the gather runs only at a group's closing token
    c128 = flat[flat.index("classSparseAttnCompressC128Block8Kernel"):]
    c128 = c128[:c128.index("classSparseAttnNormRopeStoreKernel")]
    assert "compress_ratio=128" in c128 and "first_block_index=start//Int64(state_block_size)" in c128

    triton = _source(_V4 + "common/ops/fused_compress_quant_cache.py")
    readers = [f for f in re.split(r"^def ", triton, flags=re.MULTILINE) if "state_cache_ptr+" in _flat(f)]
    assert len(readers) >= 4, len(readers)  # C4/C128 sparse-attn, two-stage gather, indexer fp8 / mxfp4
    for reader in readers:  # every kernel that loads state rows: behind the closing-token gate, one group
        name, flat_reader = reader.split("(", 1)[0], _flat(reader)
        assert "if(position+1)%COMPRESS_RATIO!=0:return" in flat_reader, name
        tstarts = {_flat(s) for s in re.findall(r"^\s*start\s*=\s*(.+)$", reader, re.MULTILINE)}
        assert tstarts and tstarts <= {"position-(1+OVERLAP)*COMPRESS_RATIO+1", "position-COMPRESS_RATIO+1"}, name
        assert "OVERLAP" not in "".join(tstarts) or "overlap=compress_ratio==4" in _flat(triton), name

    compressor = _flat(_source(_V4 + "compressor.py"))
    assert "self.overlap=compress_ratio==4" in compressor and "overlap=self.overlap," in compressor  # C128: none

    if _release() in _STATE_FILES["amd/rocm.py"][0]:  # vLLM 0.33's ROCm MXFP4 indexer pools state rows too
        rocm = _source(_V4 + "amd/rocm.py")
        pools = [f for f in re.split(r"^def ", rocm, flags=re.MULTILINE) if "state_cache_ptr+" in _flat(f)]
        assert [f.split("(", 1)[0] for f in pools] == ["_compress_pool_kernel"], pools
        flat_pool = _flat(pools[0])
        assert "if(position+1)%COMPRESS_RATIO!=0:return" in flat_pool
        assert {_flat(s) for s in re.findall(r"^\s*start\s*=\s*(.+)$", pools[0], re.MULTILINE)} == {
            "position-(1+OVERLAP)*COMPRESS_RATIO+1"}
        # its one caller is the indexer's compressor, and only C4 layers have an indexer: never a C128 state
        flat_rocm = _flat(rocm)
        assert flat_rocm.count("compress_pool(") == 2  # the dispatcher and its one call
        assert "classDeepseekV4RocmMxfp4Compressor(DeepseekCompressor):" in flat_rocm
        assert "def_get_compressor_cls(self)->type[DeepseekCompressor]:returnDeepseekV4RocmMxfp4Compressor" in flat_rocm
        attention = _flat(_source(_V4 + "attention.py"))
        assert "self.indexer=Noneifself.compress_ratio==4:" in attention


def test_triton_c128_gather_run_on_cpu_reads_no_row_before_an_aligned_resume():
    """vLLM's own Triton state gather (ROCm / XPU, and CUDA's two-stage path), run under Triton's
    interpreter (tests/integration/dsv4_c128_triton.py): with the rows before the resume point NaN
    or a constant, an aligned resume gathers bit-identical finite values; an unaligned one reads them."""
    import json
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "dsv4_c128_triton.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(DOCS.parents[1]), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["interpreted"] == "InterpretedFunction"
    for aligned in ("128", "256", "384"):
        run = out[aligned]
        assert run["closing_positions"] and run["identical"] and run["nan_at"] == [] and run["others_zero"], (aligned, run)
    # the control: a group that starts before an unaligned resume reads the rows a restore left there
    assert out["200"]["nan_at"] == [255] and not out["200"]["identical"]
    assert out["300"]["nan_at"] == [383] and not out["300"]["identical"]
