"""DraftTree invariants, tree buffers against the ancestor relation, tree logits against chain logits."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from hypothesis import given, settings
from hypothesis import strategies as st

from treegraft_cli.lm import CausalLM
from treegraft_cli.tree import ORIGIN_MODEL, DraftTree, RootTrees, best_by_score
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


@settings(max_examples=40, deadline=None)
@given(parents=random_parents(), budget=st.integers(1, 40), seed=st.integers(0, 100))
def test_selecting_host_nodes_keeps_the_structure_lists_true(parents, budget, seed):
    """A host tree's ``select_nodes`` hands the selected tree lists equal to its own columns (parents renumbered)."""
    tree = DraftTree.from_root(1, host=True)
    generator = torch.Generator().manual_seed(seed)
    for i, parent in enumerate(parents[1:], start=1):
        tree.add_children(torch.tensor([parent]), torch.tensor([i + 10]), torch.rand(1, generator=generator).log(), ORIGIN_MODEL)
    kept = best_by_score(tree.scores, budget).tolist()
    kept = sorted({a for node in kept for a in range(tree.num_nodes) if tree.ancestor_mask()[node, a]})
    selected = tree.select_nodes(kept)
    reference = tree.select(torch.tensor(kept))
    for name in ("tokens", "parents", "depths"):
        assert selected.listed(name) == getattr(reference, name).tolist() == getattr(selected, name).tolist(), name
    selected.validate()


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


@st.composite
def trees_and_chains(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    vocab = draw(st.integers(3, 12))
    parents = draw(random_parents(max_nodes=12))
    tokens = [1] + [int(t) for t in torch.randint(0, vocab, (len(parents) - 1,), generator=generator)]
    tree = DraftTree.from_root(tokens[0], host=True)
    for i, parent in enumerate(parents[1:], start=1):  # a repeated token merges: parents index the nodes so far
        parent = min(parent, tree.num_nodes - 1)
        tree.add_children(torch.tensor([parent]), torch.tensor([tokens[i]]), -torch.rand(1, generator=generator), ORIGIN_MODEL)
    c = draw(st.integers(1, 6))
    width = draw(st.integers(1, 5))
    chain_parents = torch.randint(0, tree.num_nodes, (c,), generator=generator)
    chain_tokens = torch.randint(0, vocab, (c, width), generator=generator)
    steps = -torch.rand(c, width, generator=generator) * 3
    lengths = torch.randint(1, width + 1, (c,), generator=generator)
    steps[torch.arange(width)[None, :] >= lengths[:, None]] = float("-inf")
    return tree, chain_parents, chain_tokens, steps


def _level_by_level(tree: DraftTree, parents, tokens, steps) -> list[int]:
    current, heads = parents.clone(), None
    for level in range(tokens.shape[1]):
        active = torch.isfinite(steps[:, level])
        nodes = tree.add_children(current[active], tokens[active, level], tree.scores[current[active]] + steps[active, level], ORIGIN_MODEL)
        current[active] = nodes
        heads = nodes.tolist() if level == 0 else heads
    return heads


@settings(max_examples=80, deadline=None)
@given(case=trees_and_chains())
def test_host_chains_equal_level_by_level_merging(case):
    """Hanging chains on a host tree in Python gives the tree one tensor add_children per level gives."""
    tree, parents, tokens, steps = case
    first = {name: getattr(tree, name).clone() for name in ("tokens", "parents", "scores")}
    reference = DraftTree(**{name: getattr(tree, name).clone() for name in
                             ("tokens", "parents", "depths", "scores", "origins", "kv_slot")})
    # chains under one parent start with distinct tokens (the n-gram index's promise)
    keep = [i for i in range(parents.numel()) if all(
        not (parents[j] == parents[i] and tokens[j, 0] == tokens[i, 0]) for j in range(i))]
    parents, tokens, steps = parents[keep], tokens[keep], steps[keep]
    heads = tree.add_chains(parents, tokens, steps, ORIGIN_MODEL)
    expected = _level_by_level(reference, parents, tokens, steps)
    assert heads == expected
    for name in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(tree, name), getattr(reference, name)), name
    assert torch.equal(tree.ancestor_mask(), reference.ancestor_mask())
    assert torch.equal(tree.tokens[: first["tokens"].numel()], first["tokens"])
    tree.validate()


def grown_alike(fast: DraftTree, reference: DraftTree, parents: list[int], tokens: list[int]) -> None:
    """Grow both host trees by the same merge of children under ``parents``, then assert they hold the same columns,
    structure lists (equal to their columns) and ancestor mask."""
    for tree in (fast, reference):
        tree.add_rescored_children(parents, tokens, [-2.5, -1.0], ORIGIN_MODEL, tree.host_list("scores"))
    for name in ("tokens", "parents", "depths", "scores", "origins", "kv_slot"):
        assert torch.equal(getattr(fast, name), getattr(reference, name)), name
        if name in ("tokens", "parents", "depths"):
            assert fast.listed(name) == reference.listed(name) == getattr(reference, name).tolist(), name
    assert torch.equal(fast.ancestor_mask(), reference.ancestor_mask())


@pytest.mark.parametrize("capacity", [0, 3])  # 3: the children outgrow the buffers
def test_root_children_equal_a_merge_of_new_children(capacity):
    """``add_root_children`` writes the tree, lists and key index that ``add_rescored_children`` writes on a root-only
    tree; the tree then grows as any other (a chain under a child, a merge into a child)."""
    tokens, scores = [7, 3, 9, 4], [-0.25, -1.5, -2.0, -2.0]
    fast = DraftTree.from_root(5, host=True, capacity=capacity)
    fast.add_root_children(tokens, scores, ORIGIN_MODEL)
    merged = DraftTree.from_root(5, host=True, capacity=capacity)
    merged.add_rescored_children([0] * 4, tokens, scores, ORIGIN_MODEL, [0.0])
    grown_alike(fast, merged, [2, 0], [6, 3])
    assert fast.num_nodes == 6 and fast.scores[2].item() == -1.0  # (0, 3) merged into node 2, not added
    fast.validate()
    with pytest.raises(ValueError, match="root alone"):
        fast.add_root_children([1], [-1.0], ORIGIN_MODEL)


@pytest.mark.parametrize("k", [4, 70])  # 70: more children than a root-only tree's buffers hold
def test_a_tree_under_the_root_from_its_prototype_equals_root_children_added(k):
    """``RootTrees.under_root`` copies a prototype and writes tokens and scores: the tree, lists and key index
    ``add_root_children`` writes, every time (a copy, not the prototype), and it grows as any other."""
    roots, device = RootTrees(), torch.device("cpu")
    tokens, scores = [3 * i + 1 for i in range(k)], [-0.25 * i for i in range(k)]
    for root in (5, 8):  # the second copy must not see the first's writes
        fast = roots.under_root(root, tokens, scores, ORIGIN_MODEL, device)
        added = DraftTree.from_root(root, host=True)
        added.add_root_children(tokens, scores, ORIGIN_MODEL)
        grown_alike(fast, added, [2, 0], [6, 1])
        assert fast.num_nodes == k + 2  # (0, 1) merged into node 1, (2, 6) added
        fast.validate()


def test_validate_refuses_a_mask_that_misses_an_ancestor():
    tree = DraftTree.from_root(1)
    tree.add_children(torch.tensor([0]), torch.tensor([2]), torch.tensor([-0.1]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([1]), torch.tensor([3]), torch.tensor([-0.2]), ORIGIN_MODEL)  # root <- 1 <- 2
    tree.validate()
    tree.ancestor_mask()[2, 0] = False  # a view of the tree's mask
    with pytest.raises(AssertionError, match="ancestor mask"):
        tree.validate()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.5, -1.0, -2.0, float("-inf")]), min_size=1, max_size=20), st.integers(0, 24))
def test_best_by_score_keeps_the_root_and_the_best_nodes_ties_to_the_lower_index(rest, budget):
    """Scores tie often here, the root's 0 among them: the root still comes first, then the ``budget`` best other
    nodes in ascending order, a tie going to the lower index (a parent before its child)."""
    scores = torch.tensor([0.0, *rest])
    ranked = sorted(range(1, len(scores)), key=lambda i: (-scores[i].item(), i))[:budget]
    assert best_by_score(scores, budget).tolist() == [0, *sorted(ranked)]


@settings(max_examples=40, deadline=None)
@given(parents=random_parents(), seed=st.integers(0, 1000))
def test_a_host_tree_from_read_parts_lists_its_own_columns(parents, seed):
    """``from_read_parts`` (a device run's tree read to the host) keeps structure and score lists equal to the columns,
    and they grow with the tree as any host tree's do."""
    tree = tree_from_parents(parents, seed)
    read = DraftTree.from_read_parts(tuple(part.clone() for part in tree.parts()), tree.num_nodes)
    for name in ("tokens", "parents", "depths"):
        assert read.listed(name) == getattr(tree, name).tolist(), name
    assert read.score_list() == tree.scores.tolist()
    read.add_chains(torch.tensor([0]), torch.tensor([[7, 8]]), torch.tensor([[-0.5, -0.25]]), ORIGIN_MODEL)
    for name in ("tokens", "parents", "depths"):
        assert read.listed(name) == getattr(read, name).tolist(), name
    assert read.score_list() == read.scores.tolist()
    read.validate()
