"""Graft and adjacency: templates, the online table, grafting invariants, checkpoints, exactness."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_prompt, reference_greedy, speculative
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treegraft_cli.config import DecodeConfig, TreeConfig, parse_options
from treegraft_cli.drafters.adjacency import AdjacencyTable
from treegraft_cli.drafters.rank_template import BASE_TEMPLATE, build_template, rank_log_prior, scale_counts
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.errors import ConfigError
from treegraft_cli.lm import CausalLM
from treegraft_cli.methods import Models, create_method
from treegraft_cli.tree import ORIGIN_ADJACENCY, ORIGIN_MODEL, DraftTree
from treegraft_cli.verify import tree_buffers

FAST = settings(max_examples=60, deadline=None)
SLOW = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- rank templates -------------------------------------------------------------------------------


def test_paper_template_is_its_own_scaling():
    assert scale_counts(BASE_TEMPLATE, 52, 8) == BASE_TEMPLATE
    assert sum(scale_counts(BASE_TEMPLATE, 36, 8)) == 36
    assert scale_counts(BASE_TEMPLATE, 3, 8) == (1, 1, 1)  # small budgets become a rank-0 chain


@FAST
@given(slots=st.integers(1, 200), k=st.integers(1, 10))
def test_scaled_counts_are_a_valid_shape(slots, k):
    counts = scale_counts(BASE_TEMPLATE, slots, k)
    assert sum(counts) == slots
    above = 1
    for count in counts:
        assert 1 <= count <= above * k
        above = count


@FAST
@given(slots=st.integers(1, 80), extra=st.integers(0, 40), k=st.integers(1, 8))
def test_template_is_prefix_closed_with_rank0_chain_deepest(slots, extra, k):
    template = build_template(scale_counts(BASE_TEMPLATE, slots, k), slots + extra, k)
    assert template.size == slots + extra and template.template_size == slots
    assert template.counts == scale_counts(BASE_TEMPLATE, slots, k)
    index = torch.arange(template.size)
    assert bool((template.parents < index).all())  # every prefix of the order is a tree
    assert bool((template.ranks < k).all())
    # the rank-0 chain reaches the template's deepest depth
    node, deepest = -1, len(template.counts)
    for depth in range(1, deepest + 1):
        chain = (template.parents == node) & (template.ranks == 0) & (template.depths == depth)
        assert bool(chain[: template.template_size].any())
        node = int(torch.nonzero(chain).flatten()[0])


# --- the table ------------------------------------------------------------------------------------


def _one_hot_logits(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """Logits whose ranking of each row is the given token order (first = highest)."""
    logits = torch.zeros(len(rows), vocab)
    for i, ranked in enumerate(rows):
        for r, token in enumerate(ranked):
            logits[i, token] = 10.0 - r
    return logits


def test_table_update_matches_its_definition():
    vocab, k = 8, 2
    table = AdjacencyTable(k)
    table.write_prompt(torch.tensor([5, 6, 5]), _one_hot_logits([[6, 7], [3, 4], [1, 2]], vocab))
    assert table.table[5].tolist() == [1, 2] and table.table[6].tolist() == [3, 4]  # token 5 twice: the later wins
    # root 6 (node 0) with children 1 (node 1, accepted) and 7 (node 2); node 3 = token 5 under node 1,
    # node 4 = token 1 again under node 2, off the accepted path and written later in node order.
    tree = DraftTree.from_root(6)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 7]), torch.tensor([-0.1, -0.2]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([1, 2]), torch.tensor([5, 1]), torch.tensor([-0.3, -0.4]), ORIGIN_MODEL)
    logits = _one_hot_logits([[0, 7], [2, 3], [4, 5], [6, 0], [3, 2]], vocab)
    table.write_verified(tree, [0, 1], logits)  # the root, then the accepted node 1
    assert table.table[6].tolist() == [0, 7]  # root: its verified successors replace the prompt's row
    assert table.table[1].tolist() == [2, 3]  # token 1 twice: the accepted node's row wins
    assert table.table[7].tolist() == [4, 5]
    assert table.table[5].tolist() == [6, 0]  # a rejected node still writes its row
    assert table.written.nonzero().flatten().tolist() == [1, 5, 6, 7]
    table.reset()
    assert table.rows_written == 0


def test_unwritten_rows_yield_no_nodes():
    table = AdjacencyTable(2)
    template = build_template((2, 2), 4, 2)
    tree = table.graft(DraftTree.from_root(3), template, 4)
    assert tree.size == 0
    table.write(torch.tensor([3]), _one_hot_logits([[4, 5]], 8))  # only the root's row: depth 1 only
    tree = table.graft(DraftTree.from_root(3), template, 4)
    assert sorted(tree.tokens[1:].tolist()) == [4, 5] and bool((tree.depths[1:] == 1).all())


def test_materialised_candidates_are_a_bare_root_graft():
    """``materialise`` (what ``profile`` times for retrieval) grows the template from a root through the table: its
    valid candidates are the nodes a graft on the bare root adds (which writes them depth by depth)."""
    vocab, k = 8, 2
    table = AdjacencyTable(k)
    table.write_prompt(torch.tensor([3, 5, 6]), _one_hot_logits([[5, 6], [6, 1], [2, 7]], vocab))
    template = build_template((2, 2), 10, k)
    tokens, valid = table.materialise(3, template)
    tree = table.graft(DraftTree.from_root(3), template, template.size)
    assert sorted(tokens[valid].tolist()) == sorted(tree.tokens[1:].tolist()) and tree.size == 8
    assert valid.tolist() == [True] * 8 + [False] * 2  # the last two hang below token 7, whose row was never written


def test_duplicate_of_a_draft_child_merges_and_frees_its_slot():
    table = AdjacencyTable(3)
    table.write(torch.arange(4), _one_hot_logits([[1, 2, 3], [2, 3, 0], [3, 0, 1], [0, 1, 2]], 4))
    tree = DraftTree.from_root(0)
    tree.add_children(torch.tensor([0]), torch.tensor([1]), torch.tensor([-0.5]), ORIGIN_MODEL)
    grafted = table.graft(tree, build_template((3,), 4, 3), slots=3)
    grafted.validate(budget=4)
    assert grafted.size == 4  # token 1 merged into the draft node, the next candidate took its slot
    assert int(grafted.origins[1]) == ORIGIN_MODEL
    assert int((grafted.origins == ORIGIN_ADJACENCY).sum()) == 3


def test_a_graft_on_a_bare_root_scores_each_node_by_its_parent_and_its_rank():
    """Every retrieved node's score is its parent's plus log q(rank of its token in the parent's row), in float32."""
    generator = torch.Generator().manual_seed(3)
    table = AdjacencyTable(4)
    table.write(torch.arange(12), torch.randn(12, 12, generator=generator))
    tree = table.graft(DraftTree.from_root(5), build_template(scale_counts(BASE_TEMPLATE, 20, 4), 20, 4), 20)
    tree.validate(budget=20)
    assert tree.size == 20 and tree.max_depth >= 3
    for node in range(1, tree.num_nodes):
        parent = int(tree.parents[node])
        rank = int(torch.nonzero(table.table[tree.tokens[parent]] == tree.tokens[node]))
        expected = tree.scores[parent] + torch.tensor(rank_log_prior(rank), dtype=torch.float32)
        assert torch.equal(tree.scores[node], expected), node


@st.composite
def trees_and_tables(draw):
    vocab = draw(st.integers(4, 24))
    k = draw(st.integers(1, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tree = DraftTree.from_root(draw(st.integers(0, vocab - 1)))
    for _ in range(draw(st.integers(0, 5))):  # random draft layers
        m = draw(st.integers(1, 8))
        parents = torch.randint(0, tree.num_nodes, (m,), generator=generator)
        tokens = torch.randint(0, vocab, (m,), generator=generator)
        tree.add_children(parents, tokens, tree.scores[parents] - torch.rand(m, generator=generator), ORIGIN_MODEL)
    table = AdjacencyTable(min(k, vocab))
    written = torch.randint(0, vocab, (draw(st.integers(0, 2 * vocab)),), generator=generator)
    table.write(written, torch.randn(written.numel(), vocab, generator=generator))
    full = draw(st.booleans())
    if full:
        table.write(torch.arange(vocab), torch.randn(vocab, vocab, generator=generator))
    return tree, table, full, draw(st.integers(1, 70)), draw(st.integers(0, 20))


@settings(max_examples=150, deadline=None)
@given(case=trees_and_tables(), counts_from_base=st.booleans(), depth_known=st.booleans())
def test_graft_keeps_budget_siblings_and_prefix_closure(case, counts_from_base, depth_known):
    """``depth_known``: the caller bounds the tree's depth, so the depths past it are worked out as chains."""
    tree, table, full, budget, draft_nodes = case
    kept = tree.top_by_score(min(draft_nodes, budget))
    draft, kept_tokens = kept.size, kept.tokens.clone()  # graft grows its input in place
    slots = budget - draft
    counts = scale_counts(BASE_TEMPLATE, slots, table.k) if counts_from_base else (table.k,) * 3
    depth = kept.max_depth if depth_known else None
    grafted = table.graft(kept, build_template(counts, budget, table.k), slots, depth)
    grafted.validate(budget=budget)  # parents first, depths, distinct siblings, size <= N
    assert torch.equal(grafted.ancestor_mask(), tree_buffers(grafted.parents[None])[0][0])
    assert int((grafted.origins == ORIGIN_MODEL).sum()) == draft  # draft nodes are never dropped
    assert torch.equal(grafted.tokens[: draft + 1], kept_tokens)
    retrieved = torch.nonzero(grafted.origins == ORIGIN_ADJACENCY).flatten()
    if table.written is None:
        assert retrieved.numel() == 0
        return
    parent_tokens = grafted.tokens[grafted.parents[retrieved]]
    assert bool(table.written[parent_tokens].all())  # every retrieved node comes from a written row
    assert bool((table.table[parent_tokens] == grafted.tokens[retrieved, None]).any(-1).all())
    for node in retrieved.tolist():  # scored by its parent (raised by merges) and its token's rank in the parent's row
        parent = int(grafted.parents[node])
        rank = int(torch.nonzero(table.table[grafted.tokens[parent]] == grafted.tokens[node]))
        expected = grafted.scores[parent] + torch.tensor(rank_log_prior(rank), dtype=torch.float32)
        assert torch.equal(grafted.scores[node], expected), node
    if full and counts_from_base:
        assert grafted.size == budget  # merges free slots for the next candidates


# --- checkpoints ----------------------------------------------------------------------------------


def _graft_method(pair, **options):
    drafter, target = pair
    config = DecodeConfig(method="graft", method_options=options)
    return create_method(config, Models(CausalLM(target.model), CausalLM(drafter.model), 256))


def test_checkpoint_fires_at_low_confidence_only(tiny_self_pair):
    method = _graft_method(tiny_self_pair, checkpoints=[0, 1, 5], thresholds=[0.5, 0.3, 0.1])

    def tree_with_best(probability: float) -> DraftTree:
        tree = DraftTree.from_root(1)
        scores = torch.tensor([math.log(probability), math.log(probability / 4)])
        tree.add_children(torch.tensor([0, 0]), torch.tensor([2, 3]), scores, ORIGIN_MODEL)
        return tree

    assert method.stage_fired(tree_with_best(0.2), layer=0) == 0
    assert method.stage_fired(tree_with_best(0.9), layer=0) is None
    assert method.stage_fired(tree_with_best(0.2), layer=2) is None  # no checkpoint on layer 2
    assert method.stages[2].layer == 4  # checkpoint 5 is checked on the last of D=5 layers
    assert [stage.draft_nodes for stage in method.stages] == [8, 24, 40]
    assert [stage.template.counts for stage in method.stages][0] == BASE_TEMPLATE


def test_options_are_validated():
    assert parse_options(["thresholds=[0.3, 0.2, 0.1]", "table_k=4"]) == {"thresholds": [0.3, 0.2, 0.1], "table_k": 4}
    with pytest.raises(ConfigError):
        parse_options(["table_k"])
    from treegraft_cli.config import from_mapping
    from treegraft_cli.methods.graft import GraftConfig

    assert from_mapping(GraftConfig, {"templates": [[3, 2], [2], [1]]}).templates == ((3, 2), (2,), (1,))
    for bad in ({"thresholds": [0.3]}, {"checkpoints": [1, 0, 5]}, {"thresholds": [2, 0, 0]}, {"nope": 1}):
        with pytest.raises(ConfigError):
            from_mapping(GraftConfig, bad)


# --- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["adjacency", "graft"])
@pytest.mark.parametrize("pair_name", ["tiny_pair", "tiny_self_pair"])
def test_default_options_match_greedy(method, pair_name, request):
    pair = request.getfixturevalue(pair_name)
    prompt = random_prompt(seed=11)
    expected = reference_greedy(pair[1], prompt, 40)
    result = speculative(pair, DecodeConfig(method=method, max_new_tokens=40), prompt)
    assert result.output_ids == expected
    assert all(step.nodes_verified <= 60 for step in result.steps)


@SLOW
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 40),
    depth=st.integers(1, 6),
    thresholds=st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0]), min_size=3, max_size=3),
    table_k=st.integers(1, 6),
)
def test_random_graft_settings_match_greedy(tiny_self_pair, seed, budget, depth, thresholds, table_k):
    prompt = random_prompt(seed, length=8 + seed % 16)
    expected = reference_greedy(tiny_self_pair[1], prompt, 20)
    options = {"thresholds": thresholds, "table_k": table_k}
    config = DecodeConfig(method="graft", tree=TreeConfig(budget=budget, depth=depth, top_k=4),
                          max_new_tokens=20, method_options=options)
    result = speculative(tiny_self_pair, config, prompt)
    assert result.output_ids == expected
    assert all(step.nodes_verified <= budget for step in result.steps)


def test_graft_that_never_fires_is_dense(tiny_self_pair):
    prompt, tree = random_prompt(seed=5), TreeConfig(budget=16, depth=3, top_k=4)
    dense = speculative(tiny_self_pair, DecodeConfig(method="dense", tree=tree, max_new_tokens=24), prompt)
    options = {"thresholds": [0, 0, 0]}
    never = DecodeConfig(method="graft", tree=tree, max_new_tokens=24, method_options=options)
    graft = speculative(tiny_self_pair, never, prompt)
    assert [s.accepted_length for s in graft.steps] == [s.accepted_length for s in dense.steps]
    assert [s.nodes_verified for s in graft.steps] == [s.nodes_verified for s in dense.steps]
    assert all(s.syncs == 1 for s in graft.steps)  # a checkpoint that cannot fire is never read


def test_a_checkpoint_that_changes_no_tree_is_judged_after_verification(tiny_self_pair):
    """The last layer's checkpoint keeps the whole budget (K_draft 40 >= N 16): firing or not, the tree is
    the pool's top 16, so no read decides it during drafting; its firing is still counted, from the verdict's read."""
    prompt, tree = random_prompt(seed=5), TreeConfig(budget=16, depth=4, top_k=4)
    dense = speculative(tiny_self_pair, DecodeConfig(method="dense", tree=tree, max_new_tokens=24), prompt)
    always_last = {"thresholds": [0, 0, 1.0]}  # only the last checkpoint fires, and it always does
    graft = speculative(tiny_self_pair, DecodeConfig(method="graft", tree=tree, max_new_tokens=24,
                                                     method_options=always_last), prompt)
    assert graft.output_ids == dense.output_ids
    assert [s.nodes_verified for s in graft.steps] == [s.nodes_verified for s in dense.steps]
    assert all(s.syncs == 1 and s.drafter_calls.get("graft_stage_2") == 1 for s in graft.steps)


def test_a_firing_checkpoint_reads_once_with_its_graft(tiny_self_pair):
    """The first checkpoint always fires: its confidence and the size of the graft it makes come in one read,
    so a step reads twice (that and the verdict), and the output is still the target's greedy one."""
    prompt, tree = random_prompt(seed=5), TreeConfig(budget=16, depth=4, top_k=4)
    expected = reference_greedy(tiny_self_pair[1], prompt, 24)
    first = {"thresholds": [1.0, 0, 0]}
    graft = speculative(tiny_self_pair, DecodeConfig(method="graft", tree=tree, max_new_tokens=24,
                                                     method_options=first), prompt)
    assert graft.output_ids == expected
    assert all(s.syncs == 2 and s.drafter_calls.get("graft_stage_0") == 1 for s in graft.steps)


def test_table_is_kept_across_requests_until_reset(tiny_self_pair):
    drafter, target = tiny_self_pair
    decoder = SpeculativeDecoder(CausalLM(target.model), DecodeConfig(method="adjacency", max_new_tokens=16))
    decoder.generate(random_prompt(1))
    first = decoder.method.table.written.clone()
    decoder.generate(random_prompt(2))
    assert bool(decoder.method.table.written[first].all())  # rows of the first request survive the second
    decoder.method.reset_table()
    assert decoder.method.table.rows_written == 0


def test_steps_record_which_drafter_proposed_each_verified_and_accepted_node(tiny_self_pair):
    """Checkpoint 0 always fires keeping 2 draft nodes: the other slots are grafted, and each step's record
    says so node by node; the accepted nodes are a root path (depths 1, 2, ...) of the verified ones."""
    prompt, tree = random_prompt(seed=5), TreeConfig(budget=16, depth=4, top_k=4)
    options = {"thresholds": [1.0, 0, 0], "draft_nodes": [2, 8, 16]}
    result = speculative(tiny_self_pair, DecodeConfig(method="graft", tree=tree, max_new_tokens=24,
                                                      method_options=options), prompt)
    for step in result.steps:
        assert len(step.node_origins) == len(step.node_depths) == step.nodes_verified
        assert step.node_origins.count(ORIGIN_MODEL) <= 2
        assert set(step.node_origins) <= {ORIGIN_MODEL, ORIGIN_ADJACENCY}
        assert len(step.accepted_nodes) == step.accepted_length - 1
        assert [step.node_depths[i] for i in step.accepted_nodes] == list(range(1, step.accepted_length))
    assert any(ORIGIN_ADJACENCY in step.node_origins for step in result.steps)


@pytest.mark.parametrize("graft_nodes", [0, 3])
def test_a_stage_grafts_at_most_its_graft_nodes(tiny_self_pair, graft_nodes):
    """Checkpoint 0 always fires keeping 2 draft nodes; ``graft_nodes`` caps the retrieved nodes of its graft,
    so the tree holds fewer than N nodes, and the output is still the target's greedy one."""
    prompt, tree = random_prompt(seed=5), TreeConfig(budget=16, depth=4, top_k=4)
    expected = reference_greedy(tiny_self_pair[1], prompt, 24)
    options = {"thresholds": [1.0, 0, 0], "draft_nodes": [2, 8, 16], "graft_nodes": [graft_nodes, 16, 16]}
    result = speculative(tiny_self_pair, DecodeConfig(method="graft", tree=tree, max_new_tokens=24,
                                                      method_options=options), prompt)
    assert result.output_ids == expected
    retrieved = [step.node_origins.count(ORIGIN_ADJACENCY) for step in result.steps]
    assert max(retrieved) == graft_nodes  # the cap is reached (rows for 3 successors exist after the prefill)
    assert all(step.nodes_verified <= 2 + graft_nodes for step in result.steps)


def test_graft_nodes_are_validated():
    from treegraft_cli.config import from_mapping
    from treegraft_cli.methods.graft import GraftConfig

    assert from_mapping(GraftConfig, {"graft_nodes": [0, 4, 16]}).graft_nodes == (0, 4, 16)
    for bad in ({"graft_nodes": [4]}, {"graft_nodes": [-1, 0, 0]},
                {"graft_nodes": [1, 1, 1], "templates": [[1], [1], [1]]}):
        with pytest.raises(ConfigError):
            from_mapping(GraftConfig, bad)


@pytest.mark.parametrize("counts", [(3,), (2, 3, 2), tuple(BASE_TEMPLATE)])
def test_a_templates_ancestry_marks_each_candidate_and_its_ancestors(counts):
    template = build_template(counts, sum(counts) + 4, 4, torch.device("cpu"))
    parents = template.parents.tolist()
    for candidate, row in enumerate(template.ancestry.tolist()):
        expected, node = set(), candidate
        while node >= 0:
            expected.add(node)
            node = parents[node]
        assert {i for i, bit in enumerate(row) if bit} == expected, candidate
