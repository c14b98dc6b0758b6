"""The global ranges kvconnect keys a Gated DeltaNet state page by are vLLM's own split (issue 40
item 1), checked against vLLM 0.32's real code, no engine started:

- the spec's shapes come from ``MambaStateShapeCalculator.gated_delta_net_state_shape`` at each
  TP size, in SD and DS (``_orient_conv_shape``);
- the conv state's channels of each rank are what ``mamba_v2_sharded_weight_loader`` (the loader
  ``QwenGatedDeltaNetAttention`` sets on ``conv1d.weight``, q / k / v = key, key, value dims) puts
  in that rank's weight, run on a labelled weight; its value heads what ``sharded_weight_loader(0)``
  (``A_log``) puts in it;
- ``recurrent.state_shard`` gives, per rank, exactly those channels and heads in that order, and
  the pages' fields are the spec's bytes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

NK, NV, DK, DV, KERNEL = 4, 8, 16, 32, 4  # 4 key and 8 value heads: split by TP 1, 2 and 4


def _units(field) -> list[int]:
    return [u for a, b in field.ranges for u in range(a, b)]


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_state_shard_is_vllms_weight_loader_split(monkeypatch, layout, tp_size):
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.model_loader import weight_utils
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvconnect.integrations.vllm import recurrent
    from kvconnect.layout.spec import ShardKind

    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: layout == "DS")
    shapes = mamba_utils.MambaStateShapeCalculator.gated_delta_net_state_shape(tp_size, NK, NV, DK, DV, KERNEL)
    dims = recurrent.GDNDims(NK, NV, DK, DV)
    key_dim, value_dim = NK * DK, NV * DV
    conv_dim = 2 * key_dim + value_dim
    held_channels, held_heads = [], []
    for rank in range(tp_size):
        spec = MambaSpec(block_size=384, shapes=shapes, dtypes=(torch.bfloat16, torch.float32),
                         mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
        shard = recurrent.state_shard(spec, dims, layout, tp_rank=rank, tp_size=tp_size)
        assert shard.kind is ShardKind.RANGES and shard.row_bytes == spec.page_size_bytes
        # vLLM's loaders on labelled weights: which global channel / head each local one is
        weight = torch.full((conv_dim // tp_size, 1, KERNEL), -1.0)
        labels = torch.arange(conv_dim, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, KERNEL).contiguous()
        mamba_v2_sharded_weight_loader([(key_dim, 0, False), (key_dim, 0, False), (value_dim, 0, False)],
                                       tp_size, rank)(weight, labels)
        monkeypatch.setattr(weight_utils, "get_tensor_model_parallel_rank", lambda: rank)
        heads = torch.full((NV // tp_size,), -1.0)
        weight_utils.sharded_weight_loader(0)(heads, torch.arange(NV, dtype=torch.float32))
        conv, ssm = shard.fields
        assert _units(conv) == [int(c) for c in weight[:, 0, 0]]
        assert _units(ssm) == [int(h) for h in heads]
        state_len = KERNEL - 1
        assert (conv.outer, conv.unit_bytes) == ((state_len, 2) if layout == "SD" else (1, 2 * state_len))
        assert conv.row_bytes == torch.Size(shapes[0]).numel() * 2 and ssm.row_bytes == torch.Size(shapes[1]).numel() * 4
        held_channels += _units(conv)
        held_heads += _units(ssm)
    assert sorted(held_channels) == list(range(conv_dim)) and sorted(held_heads) == list(range(NV))
    # the identity names the global shapes, the same at every size
    spec = MambaSpec(block_size=384, shapes=shapes, dtypes=(torch.bfloat16, torch.float32),
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
    whole = recurrent.global_state_shapes(spec, dims, layout, tp_size)
    assert whole[1] == (NV, DV, DK) and conv_dim in whole[0]
    assert recurrent.state_identity(spec, layout, whole).endswith(
        f"{whole[0]}/bfloat16;{whole[1]}/float32")


def test_other_states_are_keyed_by_rank():
    """A state whose shapes are not vLLM's GDN state for the config's dims (Mamba2, another
    model's dims) keeps rank and size: read only by the same rank of the same size; one vLLM
    declares replicated (``tp_replicated``) carries nothing of TP."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvconnect.integrations.vllm import recurrent
    from kvconnect.layout.spec import ShardKind

    gdn = ((3, (2 * NK * DK + NV * DV) // 2), (NV // 2, DV, DK))
    for kind, dims in ((MambaAttentionBackendEnum.MAMBA2, recurrent.GDNDims(NK, NV, DK, DV)),
                       (MambaAttentionBackendEnum.GDN_ATTN, recurrent.GDNDims(NK, NV // 2, DK, DV)),
                       (MambaAttentionBackendEnum.GDN_ATTN, None)):
        spec = MambaSpec(block_size=384, shapes=gdn, dtypes=(torch.bfloat16, torch.float32), mamba_type=kind,
                         mamba_cache_mode="align")
        assert recurrent.state_shard(spec, dims, "SD", tp_rank=1, tp_size=2).kind is ShardKind.RANK
    # vLLM's own word that every rank holds the whole state: nothing of TP in its identity
    replicated = MambaSpec(block_size=384, shapes=gdn, dtypes=(torch.bfloat16, torch.float32),
                           mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align", tp_replicated=True)
    assert recurrent.state_shard(replicated, None, "SD", tp_rank=1, tp_size=2).kind is ShardKind.REPLICATED
