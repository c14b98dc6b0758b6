"""A model's identity for shared tiers: ``name@revision#digest`` of the config fields that decide its KV.

A model's path or name alone may be reused for another checkpoint (a local directory
rewritten, a hub name at another revision, a quantised variant); the fields here may not. The
adapters build the string from their engine's own model config and pass it as the layout's
``model_name``, so it enters the layout fingerprint and every chunk key: two deployments share
KV only when they serve the same model at the same revision with the same KV-deciding config.

One function for every engine (the vLLM adapter's ``translate.model_identity`` and SGLang's
``integrations.sglang.identity``), so a model that both serve is named alike.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import blake3

# the model config fields that decide a layer's KV: a path or name alone may be reused for
# another checkpoint (a local directory rewritten, a quantised variant), these may not;
# transformers 5 keeps rope_theta / rope_scaling inside rope_parameters
HF_IDENTITY_FIELDS = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "vocab_size", "kv_lora_rank", "qk_rope_head_dim",
                      "qk_nope_head_dim", "v_head_dim", "rope_theta", "rope_scaling", "rope_parameters",
                      "sliding_window", "layer_types", "quantization_config", "torch_dtype")

DIGEST_HEX_CHARS = 16


def hf_config_fields(hf_config: Any) -> dict:
    """The KV-deciding fields (``HF_IDENTITY_FIELDS``) a Hugging Face config sets."""
    if hf_config is None:
        return {}
    values = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    return {name: values[name] for name in HF_IDENTITY_FIELDS if values.get(name) is not None}


def model_identity(name: str, revision: Optional[str], hf_config: Any, dtype: Any = None,
                   quantization: Any = None) -> str:
    """``name@revision#digest``: the model an engine serves (its path or hub name and revision),
    and a 16-hex-digit digest of its config's KV-deciding fields, the serving dtype and
    quantisation method."""
    fields = hf_config_fields(hf_config)
    fields["dtype"] = dtype
    fields["quantization"] = quantization
    digest = blake3.blake3(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:DIGEST_HEX_CHARS]
    return f"{name}@{revision or ''}#{digest}"
