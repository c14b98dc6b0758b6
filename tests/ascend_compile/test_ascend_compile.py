"""Every kernel variant the NPU route launches, through triton-ascend 3.2.0's real stages and
ascendnpu-ir 1.2.0's bishengir-compile to hivmc's input, for A2 (Ascend910B3), A3 (Ascend910_9382)
and A5 (Ascend950PR_9599, ``compile_on_910_95``); then the lowered modules are inspected.

The SoC query and hivmc are TEST-HARNESS stand-ins (harness.py says exactly what they do). A kernel
that stops lowering fails here with the stage's error; one that lowers to per-element scalar
accesses fails the inspection. Two controls show the check can see both failures: a per-lane
gather is scalarised (tags counted), and the construct today's kernels dropped (an int64 tensor
cast to pointers) crashes triton-adapter-opt.
"""

from __future__ import annotations

import os
import re

import pytest

import controls
import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS_PY = os.path.join(ROOT, "kvconnect", "transfer", "triton_kernels.py")
GENERATIONS = list(harness.SOCS)


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    return harness.Toolchain(str(tmp_path_factory.mktemp("ascend")))


@pytest.fixture(scope="module")
def kernels():
    return harness.load_kernels(KERNELS_PY)


def _variants():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvconnect_kernels_for_ids", KERNELS_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = []
    for name in mod.SIGNATURES:
        for direction in ("gather", "scatter"):
            for align in mod.NPU_ALIGNS:
                out.append((name, direction, align))
    return out


VARIANTS = _variants()


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}-align{v[2]}")
def test_every_npu_variant_lowers_to_dma(toolchain, kernels, variant, generation):
    name, direction, align = variant
    constants = {"TO_BUFFER": direction == "gather", "ALIGN": align, "CHUNK": kernels.CHUNK_BYTES}
    lowered = toolchain.compile_kernel(getattr(kernels, name), kernels.SIGNATURES[name], constants, generation)
    seen = harness.inspect(lowered)
    assert seen.scalarised == 0, f"{seen.scalarised} per-element scalarised accesses in {name} ({generation})"
    # one DMA pair per block width: the CHUNK_BYTES block and the 12 tail blocks (2048 .. 1 bytes)
    blocks = sum(1 for n in [kernels.CHUNK_BYTES] + [1 << b for b in range(12)] if n >= align)
    assert seen.dma == 2 * blocks, seen
    # the only scalar global-memory accesses left are the descriptor-table entries (int64), never bytes
    gm_scalar = [ln for ln in lowered.hivm.splitlines()
                 if re.search(r"memref\.(load|store)\b", ln) and "address_space<gm>" in ln]
    assert gm_scalar and all(re.search(r"memref<[^>]*xi64", ln) for ln in gm_scalar), gm_scalar[:3]


def test_control_vector_add_lowers(toolchain):
    for generation in GENERATIONS:
        seen = harness.inspect(toolchain.compile_kernel(
            controls.vector_add, {"x": "*fp32", "y": "*fp32", "o": "*fp32", "n": "i32", "B": "constexpr"}, {"B": 1024},
            generation))
        assert seen.scalarised == 0 and seen.dma == 3, seen


def test_control_a_per_lane_gather_is_seen_scalarised(toolchain):
    seen = harness.inspect(toolchain.compile_kernel(
        controls.lane_gather, {"src": "*u8", "idx": "*i64", "dst": "*u8", "B": "constexpr"}, {"B": 256}, "A2"))
    assert seen.scalarised > 0, seen


def test_control_an_int64_tensor_cast_to_pointers_fails_to_lower(toolchain):
    with pytest.raises(Exception, match="ConvertTritonIRToLinalgIR|SmallVector"):
        toolchain.compile_kernel(controls.tensor_cast, {"addr_ptr": "*i64", "dst": "*u8", "B": "constexpr"}, {"B": 256}, "A2")
