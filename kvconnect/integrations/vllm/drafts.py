"""Speculative decoding: which drafters kvconnect serves beside, and which turn it off.

vLLM 0.32 registers a drafter's attention layers in the same KV-cache config as the target's
(``SpeculativeConfig.method``; ``vllm/v1/core/kv_cache_utils.py``, ``_annotate_eagle_groups``):

- EAGLE / EAGLE-3 / MTP / DFlash / DSpark drafters (``use_eagle()``) add attention layers
  whose KV is computed from the target's hidden states with the *next* token: the row of a
  prefix's last token holds the token after the prefix (at a chunked-prefill boundary the
  drafter takes the next prompt token as lookahead; at a prompt's end, the sampled one), and
  in decode the drafter writes a position's row a step after the target. vLLM flags the
  groups that hold them (``KVCacheGroupSpec.is_eagle_group``: a spec marker, or the group of
  the last registered layer for MTP), or no group at all where the drafter's layers merge into
  the target's full-attention group (Qwen3.5-style shared-group MTP: then it treats every
  group as one), and drops the last block of every prefix hit there ("eagle block drop");
  its OffloadingConnector also stores no trailing chunk of a decoding request.
- a separate draft model (``draft_model``) adds a small model's causal KV layers, written
  for proposed tokens and rewritten after rejection.
- n-gram, suffix, Medusa and MLP speculators propose without any KV layer.

kvconnect's key chain names a chunk by its own tokens only, so a stored draft row at a chunk's
last token could carry another continuation's next token, and a decode chunk's draft rows
may not be written yet when the target's are; no restore rule of kvconnect covers these rows
yet. Rule: with a KV-free proposer the connector serves as usual (the KV-cache config holds
target layers only); with any other method, or any group vLLM flags as a draft group, it
stays off for the model (one WARNING naming the method and the groups: never stored as
target layers, no hit). ``draft_refusal`` says why, or None.
"""

from __future__ import annotations

from typing import Any, Optional

KV_FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"})


def draft_refusal(vllm_config: Any, kv_cache_config: Any) -> Optional[str]:
    """Why kvconnect stays off for this speculative-decoding setup; None when it serves."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    flagged = [i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)]
    if method is None and not flagged:
        return None
    if method in KV_FREE_METHODS and not flagged:
        return None
    where = f"vLLM flags KV-cache groups {flagged} as draft groups" if flagged else \
        "its draft layers share the target's KV-cache groups"
    return (f"speculative decoding (method {method!r}): {where}; a drafter's KV row at a prefix's last token "
            "holds the token after it, and in decode is written a step after the target's, so chunks keyed by "
            "their own tokens cannot restore them (kvconnect/integrations/vllm/drafts.py); KV-free proposers "
            f"({', '.join(sorted(KV_FREE_METHODS))}) are served")
