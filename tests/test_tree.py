"""DraftTree invariants, tree buffers against the ancestor relation, tree logits against chain logits."""

from __future__ import annotations

import torch
from conftest import random_prompt
from hypothesis import given, settings
from hypothesis import strategies as st

from treegraft_cli.lm import CausalLM
from treegraft_cli.tree import ORIGIN_MODEL, DraftTree
from treegraft_cli.verify import tree_buffers


@st.composite
def random_parents(draw, max_nodes: int = 40) -> list[int]:
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def naive_ancestors(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            depths[i] += j != i
            j = parents[j]
    return mask, depths


def tree_from_parents(parents: list[int], seed: int = 0) -> DraftTree:
    tree = DraftTree.from_root(1)
    generator = torch.Generator().manual_seed(seed)
    for i, parent in enumerate(parents[1:], start=1):
        # token = node index keeps siblings distinct
        tree.add_children(torch.tensor([parent]), torch.tensor([i + 10]), torch.rand(1, generator=generator).log(), ORIGIN_MODEL)
    return tree


@settings(max_examples=60, deadline=None)
@given(parents=random_parents())
def test_tree_buffers_equal_ancestor_relation(parents):
    expected_mask, expected_depths = naive_ancestors(parents)
    mask, depths = tree_buffers(torch.tensor([parents]))
    assert torch.equal(mask[0], expected_mask)
    assert torch.equal(depths[0], expected_depths)
    tree = tree_from_parents(parents)
    assert torch.equal(tree.ancestor_mask(), expected_mask)
    assert torch.equal(tree.depths, expected_depths)
    tree.validate()


def test_add_children_merges_duplicates():
    tree = DraftTree.from_root(5)
    first = tree.add_children(torch.tensor([0, 0, 0]), torch.tensor([7, 8, 7]), torch.tensor([-1.0, -2.0, -0.5]), ORIGIN_MODEL)
    assert tree.size == 2
    assert first.tolist() == [1, 2, 1]
    assert tree.scores[1] == -0.5  # merged node keeps the better score
    again = tree.add_children(torch.tensor([0]), torch.tensor([8]), torch.tensor([-3.0]), ORIGIN_MODEL, rescore=True)
    assert again.tolist() == [2] and tree.scores[2] == -3.0 and tree.size == 2
    tree.validate()


@settings(max_examples=40, deadline=None)
@given(parents=random_parents(), budget=st.integers(1, 40), seed=st.integers(0, 100))
def test_top_by_score_is_prefix_closed_and_within_budget(parents, budget, seed):
    tree = tree_from_parents(parents, seed)
    # cumulative scores: child <= parent
    tree.scores = tree.scores.clone()
    for i in range(1, tree.num_nodes):
        tree.scores[i] = tree.scores[tree.parents[i]] + tree.scores[i]
    cut = tree.top_by_score(budget)
    cut.validate(budget)
    assert cut.size == min(budget, tree.size)


def test_tree_logits_equal_chain_logits(tiny_pair):
    """Every node's logits under the tree mask and prefix+depth positions equal a causal forward over prefix+path."""
    _, target = tiny_pair
    lm = CausalLM(target.model)
    prompt = random_prompt(11, length=12)
    lm.forward(prompt[:-1])
    parents = [-1, 0, 0, 1, 1, 3, 2]
    tree = DraftTree.from_root(int(prompt[-1]))
    for i, parent in enumerate(parents[1:], start=1):
        tree.add_children(torch.tensor([parent]), torch.tensor([30 + i]), torch.zeros(1), ORIGIN_MODEL)
    logits = lm.forward_tree(tree.tokens, tree.depths, tree.ancestor_mask())
    for node in range(tree.num_nodes):
        path = [tree.tokens[0]] + [tree.tokens[i] for i in tree.path_to(node)]
        chain = torch.cat([prompt[:-1], torch.stack(path)])
        expected = target.model(chain[None]).logits[0, -1]
        torch.testing.assert_close(logits[node], expected, atol=1e-5, rtol=1e-5)


def test_kv_commit_equals_recompute(tiny_pair):
    _, target = tiny_pair
    lm = CausalLM(target.model)
    prompt = random_prompt(5, length=10)
    lm.forward(prompt[:-1])
    prefix = lm.cache_length
    tree = DraftTree.from_root(int(prompt[-1]))
    tree.add_children(torch.tensor([0, 0, 0]), torch.tensor([40, 41, 42]), torch.zeros(3), ORIGIN_MODEL)
    tree.add_children(torch.tensor([2, 2, 3]), torch.tensor([50, 51, 52]), torch.zeros(3), ORIGIN_MODEL)
    tree.add_children(torch.tensor([5]), torch.tensor([60]), torch.zeros(1), ORIGIN_MODEL)
    lm.forward_tree(tree.tokens, tree.depths, tree.ancestor_mask())
    path = torch.tensor([0, 2, 5, 7])  # root → 41 → 51 → 60
    lm.commit(prefix + path, prefix)
    fresh = CausalLM(target.model)
    fresh.forward(torch.cat([prompt, tree.tokens[path[1:]]]))
    assert lm.cache_length == fresh.cache_length
    for committed, recomputed in zip(lm.cache.layers, fresh.cache.layers, strict=False):
        torch.testing.assert_close(committed.keys, recomputed.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(committed.values, recomputed.values, atol=1e-5, rtol=1e-5)
