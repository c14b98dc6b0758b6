"""TEST HARNESS stand-in for ``sgl_kernel.mamba`` (sgl_kernel's CPU build is not on PyPI).

SGLang 0.5.23 binds the CPU GDN / KDA kernels at import of
``layers/attention/linear/{gdn_backend,kda_backend}.py`` and ``kernels/gdn_triton.py``, which
its hybrid attention-backend wrapper imports for every Mamba-like model. LFM2 (short
convolution) never calls them: it runs SGLang's Triton ``causal_conv1d`` in Triton's
interpreter. Qwen3.5's Gated DeltaNet calls the three below on CPU; each is the math of
transformers' own Qwen3.5 (``transformers.models.qwen3_5.modeling_qwen3_5``:
``causal_conv1d_update``, ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``)
behind sgl_kernel's calling convention (``sgl-kernel/python/sgl_kernel/mamba.py``; states read
and written IN PLACE in SGLang's Mamba pool at the request's slot):

- ``causal_conv1d_fn_cpu(x [dim, tokens], weight [dim, K], bias, activation, conv_states
  [slots, dim, K - 1], has_initial_state [seqs], cache_indices [seqs], query_start_loc
  [seqs + 1], seq_lens_cpu)`` -> ``[dim, tokens]``: per sequence the conv over its tokens with
  the slot's state as left context (zeros without an initial state); the slot keeps the
  sequence's last K - 1 inputs.
- ``causal_conv1d_update_cpu(x [batch, dim], conv_states, weight, bias, activation,
  conv_state_indices)`` -> ``[batch, dim]``: one decode token per request.
- ``chunk_gated_delta_rule_cpu(q [1, T, HK, EK], k, v [1, T, HV, EV], g [1, T, HV] fp32, beta,
  initial_state [slots, HV, EK, EV] fp32, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
  initial_state_indices)`` -> ``(out [1, T, HV, EV], final states, None)``: per sequence from
  the slot's state (sgl_kernel's CPU kernel always reads it: a new request's slot is zeroed by
  SGLang), chunked by 64 like sgl_kernel's; q / k heads repeated to the value heads
  (``h = h_qk * HV / HK + i``). The state layout is sgl_kernel CPU's ``[HV, EK, EV]``
  (``sgl-kernel/csrc/cpu/mamba/fla.cpp`` and sglang ``test/srt/cpu/test_mamba.py``, as read),
  transformers' too; SGLang's pool declares ``[HV, V, K]``, the same shape for the test model
  (EK = EV = 64).

Any other name raises if it is ever called, so a test can never silently run a missing kernel.
"""

import torch


def _reference():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _seq_bounds(query_start_loc):
    starts = query_start_loc.tolist()
    return list(zip(starts[:-1], starts[1:]))


def causal_conv1d_fn_cpu(mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu=None, **kwargs):
    if kwargs.get("block_table") is not None:
        raise RuntimeError("causal_conv1d_fn_cpu stand-in: block_table is not supported")
    ref = _reference()
    x = mixed_qkv_transposed
    out = torch.empty_like(x)
    for i, (start, end) in enumerate(_seq_bounds(query_start_loc)):
        slot = int(cache_indices[i])
        state = conv_states[slot].clone() if bool(has_initial_state[i]) else torch.zeros_like(conv_states[slot])
        state = state.unsqueeze(0)  # [1, dim, K - 1], updated by transformers' function in place
        out[:, start:end] = ref.causal_conv1d_update(x[:, start:end].unsqueeze(0), state, conv_weights, bias, activation)[0]
        conv_states[slot] = state[0]
    return out


def causal_conv1d_update_cpu(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices, *args, **kwargs):
    if any(a is not None for a in args) or any(v is not None for v in kwargs.values()):
        raise RuntimeError("causal_conv1d_update_cpu stand-in: speculative windows are not supported")
    ref = _reference()
    out = torch.empty_like(mixed_qkv)
    for i in range(mixed_qkv.shape[0]):
        slot = int(conv_state_indices[i])
        state = conv_states[slot].clone().unsqueeze(0)
        out[i] = ref.causal_conv1d_update(mixed_qkv[i].view(1, -1, 1), state, conv_weights, bias, activation)[0, :, 0]
        conv_states[slot] = state[0]
    return out


def _repeat_heads(q, k, num_v_heads):
    group = num_v_heads // q.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return q, k


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                               initial_state_indices):
    if head_first:
        raise RuntimeError("chunk_gated_delta_rule_cpu stand-in: head_first is not supported")
    ref = _reference()
    q, k = _repeat_heads(q, k, v.shape[2])
    out = torch.empty_like(v)
    finals = []
    for i, (start, end) in enumerate(_seq_bounds(cu_seqlens)):
        slot = int(initial_state_indices[i])
        o, state = ref.torch_chunk_gated_delta_rule(
            q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end], beta=beta[:, start:end],
            chunk_size=64, initial_state=initial_state[slot:slot + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        out[:, start:end] = o
        initial_state[slot] = state[0].to(initial_state.dtype)
        finals.append(initial_state[slot])
    return out, torch.stack(finals), None


def fused_gdn_gating(A_log, a, b, dt_bias, softplus_beta=1.0, softplus_threshold=20.0):
    """(g, beta) as transformers' Qwen3.5 computes them: g = -exp(A_log) * softplus(a + dt_bias)
    (fp32), beta = sigmoid(b); each ``[1, tokens, HV]`` (sgl_kernel's ``fused_gdn_gating_cpu``)."""
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias, beta=softplus_beta,
                                                            threshold=softplus_threshold)
    return g.unsqueeze(0), b.sigmoid().unsqueeze(0)


def fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices,
                                           cu_seqlens, use_qk_l2norm_in_kernel, softplus_beta=1.0,
                                           softplus_threshold=20.0):
    """sgl_kernel's ``fused_sigmoid_gating_delta_rule_update_cpu``: the decode step. q / k ``[1, B, HK,
    EK]``, v ``[1, B, HV, EV]``, a / b ``[B, HV]``; per request the gating above and transformers'
    ``torch_recurrent_gated_delta_rule`` from the slot's state, written back in place; -> ``[B, 1, HV, EV]``."""
    ref = _reference()
    q, k = _repeat_heads(q, k, v.shape[2])
    g, beta = fused_gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    bounds = _seq_bounds(cu_seqlens)
    out = v.new_empty(len(bounds), v.shape[1] // len(bounds), v.shape[2], v.shape[3])
    for i, (start, end) in enumerate(bounds):
        slot = int(initial_state_indices[i])
        o, state = ref.torch_recurrent_gated_delta_rule(
            q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end], beta=beta[:, start:end],
            initial_state=initial_state_source[slot:slot + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        out[i] = o[0]
        initial_state_source[slot] = state[0].to(initial_state_source.dtype)
    return out


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _raise(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.mamba.{name} is not available in the kvconnect test harness")

    _raise.__name__ = name
    return _raise
