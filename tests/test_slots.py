"""block_ids_from_slot_mapping: LMCache's / vLLM's per-token slots as kvconnect's block ids,
and the runnable "from LMCache" example of docs/migrating.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvconnect import BlockTableError, block_ids_from_slot_mapping

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_round_trip(num_tokens, block_size, rng):
    blocks = [int(b) for b in rng.permutation(200)[: -(-num_tokens // block_size)]]
    slots = torch.tensor(blocks).repeat_interleave(block_size)[:num_tokens] * block_size + torch.arange(num_tokens) % block_size
    assert block_ids_from_slot_mapping(slots, block_size) == blocks
    assert block_ids_from_slot_mapping(slots.tolist() + [-1, -1], block_size) == blocks  # trailing padding


@pytest.mark.parametrize("slots,match", [
    ([16, 17, 19], r"slot_mapping\[2\] = 19 is not offset 2 of block 4"),
    ([5, 6], r"slot_mapping\[0\] = 5 is not offset 0"),
    ([0, 1, 8, 9], r"slot_mapping\[2\] = 8 is not offset 2 of block 0"),  # a block left before it was full
    ([0, -1, 2], "only trailing padding"),
])
def test_mappings_a_block_table_cannot_express_are_refused(slots, match):
    with pytest.raises(BlockTableError, match=match):
        block_ids_from_slot_mapping(slots, 4)


def test_empty_and_bad_block_size():
    assert block_ids_from_slot_mapping([], 16) == []
    with pytest.raises(BlockTableError, match="block_size"):
        block_ids_from_slot_mapping([0], 0)


def test_the_from_lmcache_example_runs():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVCONNECT_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "from_lmcache.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stored 768 tokens, lookup hit 768, retrieved 768 tokens, byte-exact: True" in out.stdout
