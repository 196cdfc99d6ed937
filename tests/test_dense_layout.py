"""Dense trees and chains on their fixed layout are the trees the generic builders grow, node for node and bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, reference_greedy

from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.engine import Generation, SpeculativeDecoder
from treegraft_cli.lm import CausalLM
from treegraft_cli.methods import Models, create_method
from treegraft_cli.tree import DraftTree


def columns(tree: DraftTree) -> dict[str, torch.Tensor]:
    return {name: getattr(tree, name) for name in ("tokens", "parents", "depths", "scores", "origins", "kv_slot")} | {
        "ancestor_mask": tree.ancestor_mask()
    }


def drafting_method(name: str, drafter_model, target_model, tree: TreeConfig, layout: bool):
    drafter = CausalLM(drafter_model)
    models = Models(CausalLM(target_model), drafter, target_model.config.vocab_size)
    method = create_method(DecodeConfig(method=name, tree=tree), models)
    assert method.layout is not None
    if not layout:
        method.layout = None  # the generic builder: DraftTree writes layer by layer
    method.drafter.reset()
    return method


@pytest.mark.parametrize("name", ["dense", "chain"])
@pytest.mark.parametrize("tree", [
    TreeConfig(budget=16, depth=4, top_k=4),
    TreeConfig(budget=6, depth=3, top_k=3),
    TreeConfig(budget=40, depth=3, top_k=4),  # the whole pool (4 + 16 + 16 nodes) fits: nothing is cut
    TreeConfig(budget=5, depth=1, top_k=5),  # the root's children only: no drafter forward after the root's
    TreeConfig(budget=3, depth=4, top_k=1),  # a chain
])
def test_layout_tree_equals_the_grown_tree(tiny_pair, name, tree):
    drafter_model, target_model = (m.model for m in tiny_pair)
    layout_method = drafting_method(name, drafter_model, target_model, tree, layout=True)
    grown_method = drafting_method(name, drafter_model, target_model, tree, layout=False)
    committed = random_prompt(7, length=20)
    for step in range(3):  # later steps start from a cache the previous step's commit left
        laid = layout_method.draft(committed)
        grown = grown_method.draft(committed)
        laid.validate(tree.budget)
        assert laid.num_nodes == grown.num_nodes
        for name, expected in columns(grown).items():
            assert torch.equal(columns(laid)[name], expected), (step, name)
        assert layout_method.drafter.lm.cache_length == grown_method.drafter.lm.cache_length
        # accept the best leaf's path, as if the target agreed with it, and commit both drafters alike
        leaf = int(torch.argmax(torch.where(laid.depths == laid.max_depth, laid.scores, float("-inf"))))
        path = torch.tensor(laid.path_to(leaf))
        layout_method.drafter.commit(laid, path)
        grown_method.drafter.commit(grown, path)
        committed = torch.cat([committed, laid.tokens[path], torch.tensor([step])])


def decode_both(pair, config: DecodeConfig, prompt: torch.Tensor) -> tuple[Generation, Generation]:
    """The generation with the layout, then with the generic builder (same models, fresh caches)."""
    drafter, target = pair
    results = []
    for layout in (True, False):
        decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model))
        if not layout:
            decoder.method.layout = None
        results.append(decoder.generate(prompt))
    return results[0], results[1]


@pytest.mark.parametrize("name", ["dense", "chain", "graft"])
def test_layout_decoding_is_lossless_and_decodes_as_the_grown_trees(tiny_self_pair, name):
    prompt = random_prompt(11)
    config = DecodeConfig(method=name, tree=TreeConfig(budget=12, depth=4, top_k=3), max_new_tokens=24)
    laid, grown = decode_both(tiny_self_pair, config, prompt)
    assert laid.output_ids == reference_greedy(tiny_self_pair[1], prompt, 24) == grown.output_ids
    assert [s.accepted_length for s in laid.steps] == [s.accepted_length for s in grown.steps]
    assert [s.drafter_calls for s in laid.steps] == [s.drafter_calls for s in grown.steps]  # graft: the same stages fire
    # a step accepts two drafted nodes or more: the drafter's masks and positions below the root's children are right
    assert max(s.accepted_length for s in laid.steps) >= 3


def test_graft_fires_on_the_layout_as_on_the_grown_tree(tiny_pair):
    """An unrelated drafter is never confident: graft's first checkpoint fires on (nearly) every step."""
    prompt = torch.cat([random_prompt(5, length=12)] * 2)
    config = DecodeConfig(method="graft", tree=TreeConfig(budget=12, depth=4, top_k=3), max_new_tokens=20)
    laid, grown = decode_both(tiny_pair, config, prompt)
    assert laid.output_ids == grown.output_ids == reference_greedy(tiny_pair[1], prompt, 20)
    assert [s.drafter_calls for s in laid.steps] == [s.drafter_calls for s in grown.steps]
    assert any("adjacency" in s.drafter_calls for s in laid.steps)
