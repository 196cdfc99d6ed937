"""fp32 greedy speculative output == transformers' greedy output, token for token."""

from __future__ import annotations

import pytest
from conftest import random_prompt, reference_greedy, speculative
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treegraft_cli.config import DecodeConfig, TreeConfig

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("method", ["ar", "chain", "dense"])
@pytest.mark.parametrize("pair_name", ["tiny_pair", "tiny_self_pair"])
def test_default_shapes_match_greedy(method, pair_name, request):
    pair = request.getfixturevalue(pair_name)
    prompt = random_prompt(seed=7)
    expected = reference_greedy(pair[1], prompt, 48)
    result = speculative(pair, DecodeConfig(method=method, max_new_tokens=48), prompt)
    assert result.output_ids == expected


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 40),
    depth=st.integers(1, 7),
    top_k=st.integers(1, 6),
    method=st.sampled_from(["chain", "dense"]),
)
def test_random_tree_shapes_match_greedy(tiny_self_pair, seed, budget, depth, top_k, method):
    prompt = random_prompt(seed, length=8 + seed % 20)
    expected = reference_greedy(tiny_self_pair[1], prompt, 30)
    config = DecodeConfig(method=method, tree=TreeConfig(budget=budget, depth=depth, top_k=top_k), max_new_tokens=30)
    result = speculative(tiny_self_pair, config, prompt)
    assert result.output_ids == expected
    assert all(step.nodes_verified <= budget for step in result.steps)


def test_self_drafter_is_accepted_often(tiny_self_pair):
    """A guard that the exactness tests above exercise acceptance, not only rejection."""
    result = speculative(tiny_self_pair, DecodeConfig(method="dense", max_new_tokens=48), random_prompt(3))
    assert result.mean_accepted_length > 1.5
