"""Gated DeltaNet / Mamba hybrids on vLLM-Ascend 0.23.0.post1: kvconnect refuses them, naming the release.

The case is the tiny Qwen3.5 (3 GDN layers + 1 full-attention layer) laid out by vLLM-Ascend's
own ``NPUModelRunner._allocate_kv_cache_tensors`` / ``_reshape_kv_cache_tensors``
(``harness.qwen35``). What it registers is pinned first (the facts docs/recurrent.md gives as
the reason): a state layer arrives as a list ``[conv, recurrent]``, each one contiguous
``(num_blocks, *shape)`` tensor (state-major: every block's conv state, then every block's
recurrent state), not vLLM 0.32's per-block pages. vLLM 0.23 has no boundary-state offers, so
which block holds the state at a restore point was not proven: ``translate`` (what the
connector's ``register_kv_caches`` calls) refuses the model, nothing is registered, and the
release's table row names the release in its reason.
"""

from __future__ import annotations

import pytest
import torch

import harness
from kvconnect.errors import UnsupportedLayoutError
from kvconnect.integrations.vllm import engine_tables, translate


@pytest.fixture(scope="module")
def case():
    return harness.qwen35()


def test_vllm_ascend_registers_state_major_tensors(case):
    state_layers = [name for name, spec in case.specs.items() if type(spec).__name__ == "MambaSpec"]
    assert len(state_layers) == 3
    for name in state_layers:
        conv, recurrent = case.kv_caches[name]
        assert isinstance(case.kv_caches[name], list)
        assert (tuple(conv.shape), conv.dtype) == ((case.num_blocks, 3, 512), torch.bfloat16)
        assert (tuple(recurrent.shape), recurrent.dtype) == ((case.num_blocks, 4, 64, 64), torch.float32)
        assert conv.is_contiguous() and recurrent.is_contiguous()
        # state-major: all conv states, then all recurrent states, in one raw allocation
        assert recurrent.data_ptr() == conv.data_ptr() + conv.numel() * conv.element_size()
    spec = case.specs[state_layers[0]]
    assert (spec.block_size, spec.page_size_bytes) == (384, 98304)  # padded to the attention page
    attention = case.kv_caches["model.layers.3.self_attn.attn"]
    assert isinstance(attention, tuple) and tuple(attention[0].shape) == (case.num_blocks * 3, 128, 1, 64)


def test_translate_refuses_the_model_and_the_release_row_names_the_release(case):
    release = engine_tables.release_of(list(case.specs.values()))
    assert release is engine_tables.VLLM_ASCEND_0_23
    assert "vLLM-Ascend 0.23" in release.recurrent_refusal and "MambaSpec" in release.recurrent_refusal
    with pytest.raises(UnsupportedLayoutError, match="MambaSpec.*vLLM-Ascend 0.23"):
        translate.translate_kv_caches(case.kv_cache_config, case.kv_caches, model_name="tiny-qwen35")
    # the newer Ascend row refuses too (not verified either); vLLM's own row stores snapshots (issue 28)
    assert engine_tables.VLLM_ASCEND_MAIN.recurrent_refusal is not None
