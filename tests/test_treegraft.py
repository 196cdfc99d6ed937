"""TreeGraft: exactness for every policy, the combine step's invariants, the strong drafter's cache,
the n-gram index, the 17 scheduler features and the call policies."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_prompt, reference_greedy, speculative

from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.drafters.ngram import NgramIndex, TargetLogProbCache
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.errors import ConfigError
from treegraft_cli.grafting.builder import Growth
from treegraft_cli.grafting.strong_call import needed_nodes
from treegraft_cli.grafting.tree_ops import cut_to_budget, graft_window
from treegraft_cli.lm import CausalLM
from treegraft_cli.methods import Models, Prefill, create_method
from treegraft_cli.scheduling.calibration import AcceptanceCalibration
from treegraft_cli.scheduling.options import TreeGraftConfig
from treegraft_cli.scheduling.policies import (
    AllMid,
    CostAwareRule,
    CostModel,
    FixedLayers,
    SchedulerState,
    WeakPreview,
    features,
)
from treegraft_cli.scheduling.registry import make_policy
from treegraft_cli.scheduling.step_rule import LearnedLayerRule, StepRule, WeakOutcomes, chain_match, verified_outcome
from treegraft_cli.tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree

SMALL_TREE = TreeConfig(budget=20, depth=4, top_k=4)
POLICIES = ["ngram", "all-small", "all-mid", "fixed:1,3", "treegraft", "treegraft:cost-aware", "treegraft:step:2,3"]
NEW_TOKENS = 24


def repetitive_prompt(seed: int) -> torch.Tensor:
    """A prompt that repeats itself, so the n-gram drafter finds matches."""
    base = random_prompt(seed, length=10)
    return torch.cat([base, base, base[:5]])


@pytest.fixture(scope="module")
def expected(tiny_self_pair) -> dict[int, list[int]]:
    return {seed: reference_greedy(tiny_self_pair[1], repetitive_prompt(seed), NEW_TOKENS) for seed in (1, 2)}


def decoder_for(pair, method: str, tree: TreeConfig = SMALL_TREE, **options) -> SpeculativeDecoder:
    drafter, target = pair
    config = DecodeConfig(method=method, tree=tree, max_new_tokens=NEW_TOKENS, method_options=options)
    return SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model))


# -- exactness and budget ----------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "seed"), [(m, 1) for m in POLICIES] + [("treegraft", 2), ("fixed:2,4", 2)])
def test_every_policy_matches_greedy(tiny_self_pair, expected, method, seed):
    config = DecodeConfig(method=method, tree=SMALL_TREE, max_new_tokens=NEW_TOKENS)
    result = speculative(tiny_self_pair, config, repetitive_prompt(seed))
    assert result.output_ids == expected[seed]
    assert all(step.nodes_verified <= SMALL_TREE.budget for step in result.steps)


def test_paper_shape_with_unrelated_drafter_matches_greedy(tiny_pair):
    prompt = repetitive_prompt(3)
    tree = TreeConfig(budget=63, depth=5, top_k=10)
    config = DecodeConfig(method="treegraft", tree=tree, max_new_tokens=16, method_options={"policy": "all-mid"})
    result = speculative(tiny_pair, config, prompt)
    assert result.output_ids == reference_greedy(tiny_pair[1], prompt, 16)
    assert all(step.nodes_verified <= 63 for step in result.steps)


def test_all_mid_equals_dense_and_counts_calls(tiny_self_pair):
    """With the strong drafter at every layer the loop is EAGLE-2's dense tree: same steps, same τ."""
    prompt = random_prompt(3)
    dense = speculative(tiny_self_pair, DecodeConfig(method="dense", tree=SMALL_TREE, max_new_tokens=NEW_TOKENS), prompt)
    result = speculative(tiny_self_pair, DecodeConfig(method="all-mid", tree=SMALL_TREE, max_new_tokens=NEW_TOKENS), prompt)
    assert [s.accepted_length for s in result.steps] == [s.accepted_length for s in dense.steps]
    assert result.mean_accepted_length > 1.5
    assert all(step.drafter_calls["model"] == SMALL_TREE.depth for step in result.steps)


@pytest.mark.parametrize(("method", "options", "kept"), [
    ("all-mid", {}, False),  # every layer strong: no n-gram chain is ever scored
    ("all-mid", {"call_budget": 2}, True),  # layers 3 and 4 are weak
    ("fixed:1,3", {}, True),
    ("treegraft", {}, True),  # the step rule previews the weak chains
])
def test_target_logprobs_are_kept_only_where_weak_layers_can_draft(tiny_self_pair, method, options, kept):
    drafter, target = tiny_self_pair
    prompt = torch.cat([random_prompt(4, length=12)] * 2)
    config = DecodeConfig(method=method, tree=SMALL_TREE, max_new_tokens=NEW_TOKENS, method_options=options)
    decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model))
    cache = decoder.method.target_logp
    readbacks = []
    top = cache.top
    cache.top = lambda logits: readbacks.append(logits.shape[0]) or top(logits)
    result = decoder.generate(prompt)
    assert result.output_ids == reference_greedy(target, prompt, NEW_TOKENS)
    assert (cache.values.shape[0] > prompt.numel()) == kept
    assert bool(readbacks) == kept  # no target row is reduced for scores nobody reads
    decoder.method.probed = True  # what ``collect`` sets: its probes force weak layers under any policy
    decoder.generate(prompt)
    assert decoder.method.target_logp.values.shape[0] > prompt.numel()


# -- the combine step ----------------------------------------------------------------------------------


def started_method(pair, method: str, prompt: torch.Tensor, tree: TreeConfig = SMALL_TREE):
    drafter, target = pair
    config = DecodeConfig(method=method, tree=tree)
    instance = create_method(config, Models(CausalLM(target.model), CausalLM(drafter.model), 256))
    # prefill all but the last prompt token, which becomes the root: the repeated text then matches
    logits = CausalLM(target.model).forward(prompt[:-1])
    instance.start(Prefill(prompt[:-1], logits))
    return instance, prompt


def test_combine_keeps_every_node_and_can_graft_shallower(tiny_self_pair):
    method, committed = started_method(tiny_self_pair, "all-small", repetitive_prompt(1))
    loop = method.loop
    loop.index.sync(committed)
    method.strong.start_step()
    growth = Growth.start(int(committed[-1]))
    loop.weak_layer(growth, 1)
    tree = growth.tree
    assert tree.size > 0 and bool((tree.origins[1:] == ORIGIN_NGRAM).all())
    before = (tree.parents.clone(), tree.tokens.clone(), tree.num_nodes)
    frontier_depth = int(tree.depths[torch.tensor(growth.frontier)].max()) if growth.frontier else 1
    loop.strong_layer(growth, 2, committed)
    tree = growth.tree
    assert torch.equal(tree.parents[: before[2]], before[0]) and torch.equal(tree.tokens[: before[2]], before[1])
    assert 0 in growth.expanded_nodes, "the root (shallower than the weak frontier) is reselected"
    assert 0 < frontier_depth
    assert bool((tree.origins == ORIGIN_MODEL).any())
    tree.validate()
    # every node was rescored by the strong drafter: scores are cumulative strong log-probs
    logp = method.strong.logp
    local = logp[torch.tensor(growth.rows)[tree.parents[1:]], tree.tokens[1:]]
    assert torch.allclose(tree.scores[1:], tree.scores[tree.parents[1:]] + local, atol=1e-5)


def test_strong_calls_without_chains_hold_the_scores_rescoring_would_give(tiny_self_pair):
    """A strong call on a tree of the strong drafter's own children gathers no local log-probs and rescores nothing:
    every node's score must already be its parent's plus its log-prob in the parent's row, bit for bit."""
    method, committed = started_method(tiny_self_pair, "all-mid", random_prompt(3))
    loop = method.loop
    loop.index.sync(committed)
    method.strong.start_step()
    growth = Growth.start(int(committed[-1]))
    for layer in (1, 2, 3):
        loop.strong_layer(growth, layer, committed)
    tree = growth.tree
    assert not growth.weak_chains and tree.size == 4 + 16 + 16
    local = method.strong.logp[torch.tensor(growth.rows)[tree.parents[1:]], tree.tokens[1:]]
    assert torch.equal(tree.scores[1:], tree.scores[tree.parents[1:]] + local)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_score_list_a_host_tree_keeps_is_its_scores_column(tiny_self_pair, seed):
    """The host loop reads scores from the list its writers leave (``DraftTree.score_list``): after chains, merges and
    strong calls, layer by layer, it must hold the column's values."""
    method, committed = started_method(tiny_self_pair, "all-small", repetitive_prompt(seed))
    loop = method.loop
    loop.index.sync(committed)
    method.strong.start_step()
    growth = Growth.start(int(committed[-1]))
    for layer, strong in enumerate((False, True, False, True), start=1):
        if strong:
            loop.strong_layer(growth, layer, committed)
        else:
            loop.weak_layer(growth, layer)
        tree = growth.tree
        assert tree.score_list() == tree.host_list("scores")
    assert growth.weak_chains and tree.size > 20


def test_forced_actions_drive_the_loop(tiny_self_pair):
    method, committed = started_method(tiny_self_pair, "all-small", repetitive_prompt(2))
    _, records = method.build(committed, forced={2: True, 3: True}, record=True)
    assert [r.called for r in records] == [False, True, True, False]
    assert [r.forced for r in records] == [False, True, True, False]
    assert all(r.features.shape == (17,) for r in records)
    tree, records = method.build(committed, forced={2: False})  # the same step drafted again
    assert not any(r.called for r in records)
    tree.validate(SMALL_TREE.budget)


class AskedPerState(FixedLayers):
    """``FixedLayers`` that the layer loop must ask through a state at every layer."""

    def wants_layer(self, layer: int) -> None:
        return None


@pytest.mark.parametrize(("layers", "call_budget"), [((), 3), ((1, 3), 3), ((2, 3, 4), 2), ((1, 2, 3, 4), 1)])
def test_a_policy_deciding_by_layer_builds_what_it_builds_when_asked_per_state(tiny_self_pair, layers, call_budget):
    method, committed = started_method(tiny_self_pair, "all-small", repetitive_prompt(2))
    by_layer, per_state = FixedLayers(call_budget, layers), AskedPerState(call_budget, layers)
    assert by_layer.wants_layer(3) == (3 in layers)
    tree, records = method.build(committed, policy=by_layer)
    again, records_again = method.build(committed, policy=per_state)  # the same step drafted again
    assert [r.called for r in records] == [r.called for r in records_again]
    assert sum(r.called for r in records) == min(call_budget, len(layers))
    for name in ("tokens", "parents", "depths", "scores", "origins"):
        assert torch.equal(getattr(tree, name), getattr(again, name)), name


def test_cut_keeps_ancestors_even_when_chain_scores_exceed_parents():
    tree = DraftTree.from_root(0)
    a = tree.add_children(torch.tensor([0]), torch.tensor([1]), torch.tensor([-2.0]), ORIGIN_MODEL)
    b = tree.add_children(a, torch.tensor([2]), torch.tensor([-0.1]), ORIGIN_NGRAM)  # above its parent
    tree.add_children(torch.tensor([0]), torch.tensor([3]), torch.tensor([-1.0]), ORIGIN_MODEL)
    cut = cut_to_budget(tree, 2)
    cut.validate(2)
    assert cut.size == 2 and set(cut.tokens[1:].tolist()) == {1, 3}  # b's -0.1 is capped at its parent's -2.0
    assert int(b) == 2


# -- the strong drafter's cache -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["all-mid", "fixed:2,4", "treegraft", "treegraft:cost-aware"])
def test_strong_cache_equals_recompute_after_every_step(tiny_self_pair, method):
    drafter_model = tiny_self_pair[0].model
    # costs that make the rules call sometimes (tiny models cost about the same per forward)
    decoder = decoder_for(tiny_self_pair, method, verify_ms=100.0, strong_ms=10.0)
    prompt = repetitive_prompt(2)
    checked = []

    def check(generation):
        strong = decoder.method.strong
        length = strong.committed_length
        committed = torch.cat([prompt, torch.tensor(generation.output_ids)])
        assert strong.lm.cache_length == length <= committed.numel()
        if length == 0:  # the strong drafter was never called yet
            return
        fresh = CausalLM(drafter_model)
        fresh.forward(committed[:length])
        for ours, ref in zip(strong.lm.cache.layers, fresh.cache.layers, strict=True):
            assert torch.allclose(ours.keys, ref.keys, atol=1e-4) and torch.allclose(ours.values, ref.values, atol=1e-4)
        checked.append(length)

    decoder.generate(prompt, on_step=check)
    assert len(checked) > 2 and checked[-1] > checked[0]


# -- the weak drafter -----------------------------------------------------------------------------------


def test_ngram_index_grows_incrementally_and_matches_longest_first():
    tokens = [5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 4, 2, 5, 6]
    grown = NgramIndex(max_n=3)
    grown.extend(tokens[:5])
    grown.extend(tokens[5:])
    rebuilt = NgramIndex(max_n=3)
    rebuilt.extend(tokens)
    assert grown.table == rebuilt.table
    found = grown.continuations(tokens[-3:], max_n=3, count=3, length=3)
    # "2 5 6" never occurred before; "5 6" did: most recent first (→ 7 4 2), then (→ 9 5 6); then (→ 7 8 5) repeats 7
    assert [c.tokens for c in found] == [(7, 4, 2), (9, 5, 6)]
    assert [c.position for c in found] == [8, 5]
    assert grown.continuations([1, 1, 1], max_n=3, count=3, length=3) == []


def test_ngram_index_fills_from_shorter_matches_down_to_min_n():
    index = NgramIndex(max_n=3)
    index.extend([7, 2, 3, 8, 2, 4, 7, 2])  # "7 2" ended at position 1 (→ 3 8); "2" alone also at 4 (→ 4 7)
    assert [c.tokens for c in index.continuations([7, 2], max_n=3, count=3, length=2)] == [(3, 8), (4, 7)]
    assert [c.tokens for c in index.continuations([7, 2], max_n=3, count=3, length=2, min_n=2)] == [(3, 8)]
    assert index.continuations([6, 2], max_n=3, count=3, length=2, min_n=2) == []  # "6 2" never occurred


def test_min_n_is_checked_against_max_n():
    with pytest.raises(ConfigError, match="min_n"):
        TreeGraftConfig(max_n=3, min_n=4)
    assert TreeGraftConfig(max_n=3, min_n=3).min_n == 3


def test_target_logprob_cache_scores_and_penalises():
    cache = TargetLogProbCache(width=2, fallback_penalty=5.0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    cache.append(0, logits)
    scores = cache.score(torch.tensor([0, 0, 1, 7]), torch.tensor([1, 2, 2, 0]))
    assert torch.allclose(scores[:3], torch.tensor([math.log(0.3), math.log(0.3) - 5.0, math.log(0.8)]), atol=1e-5)
    assert float(scores[3]) == -5.0  # no row (the current root): plain penalty
    cache.append(1, logits[:1])  # a later row overwrites
    assert cache.values.shape[0] == 2


def test_target_logprob_cache_keeps_positions_as_a_concatenation_would():
    """Rows written in place into buffers that grow: overwriting from a position forgets the ones after it, a gap
    is refused, and what is kept equals the rows concatenated in the same order."""
    cache, generator = TargetLogProbCache(width=3, fallback_penalty=5.0), torch.Generator().manual_seed(0)
    expected_values, expected_tokens = torch.empty(0, 3), torch.empty(0, 3, dtype=torch.long)
    for start, count in [(0, 50), (49, 3), (52, 40), (60, 1), (61, 100)]:  # past the first buffers' 64 and 128 rows
        values, tokens = torch.randn(count, 3, generator=generator), torch.randint(0, 99, (count, 3), generator=generator)
        cache.append_top(start, values, tokens)
        expected_values = torch.cat([expected_values[:start], values])
        expected_tokens = torch.cat([expected_tokens[:start], tokens])
        assert torch.equal(cache.values, expected_values) and torch.equal(cache.tokens, expected_tokens)
    with pytest.raises(ValueError, match="gap"):
        cache.append_top(cache.length + 1, values[:1], tokens[:1])


@pytest.mark.parametrize("penalty", [5.0, 0.3])  # 0.3 is not a float32: the host path must round as the tensor one
def test_target_logprob_cache_scores_the_same_on_host_lists(penalty):
    generator = torch.Generator().manual_seed(0)
    cache = TargetLogProbCache(width=3, fallback_penalty=penalty)
    cache.append(0, torch.randn(6, 11, generator=generator) * 4)
    positions = torch.randint(0, 8, (40,), generator=generator)  # 6 and 7 have no row
    tokens = torch.randint(0, 11, (40,), generator=generator)
    assert cache.score_on_host(positions.tolist(), tokens.tolist()) == cache.score(positions, tokens).tolist()
    assert TargetLogProbCache(2, penalty).score_on_host([0, 3], [1, 2]) == TargetLogProbCache(2, penalty).score(
        torch.tensor([0, 3]), torch.tensor([1, 2])).tolist()


# -- scheduler features and policies -------------------------------------------------------------------


def hand_state(called=(1, 2), layer=3, verify_ms=100.0, strong_ms=25.0, weak=None) -> SchedulerState:
    """root → a(-0.1), b(-1.0); a → c(-0.5), d(-2.0). Frontier {c, d}; root and a expanded by the strong drafter."""
    tree = DraftTree.from_root(0)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([-0.1, -1.0]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([1, 1]), torch.tensor([3, 4]), torch.tensor([-0.5, -2.0]), ORIGIN_MODEL)
    expanded = torch.tensor([True, True, False, False, False])
    return SchedulerState(
        tree=tree,
        frontier=torch.tensor([3, 4]),
        window=tuple(graft_window(tree, layer, lookback=5, max_depth=10, expanded=expanded).nonzero().flatten().tolist()),
        layer=layer,
        num_layers=5,
        called=called,
        prompt_length=9,
        costs=CostModel(verify_ms, strong_ms),
        width=2,
        budget=63,
        weak=weak,
    )


def test_features_on_a_hand_built_tree():
    state = hand_state()
    assert state.reselection().tolist() == [3, 2]  # c (-0.5) then b (-1.0, shallower than the frontier)
    expected = [math.log(10), 100.0, 25.0, math.log(4), 0.6, 0.4, 1, 1, 0, 0, 0, 2.0, 1.0, 0.5, 0.5, 0.5, -0.75]
    assert torch.allclose(features(state), torch.tensor(expected), atol=1e-6)


def test_policies_respect_the_call_budget():
    state = hand_state(called=(1, 2))
    assert AllMid(call_budget=3).decide(state) and not AllMid(call_budget=2).decide(state)
    assert FixedLayers(5, (3,)).decide(state) and not FixedLayers(5, (1, 2)).decide(state)
    assert LearnedLayerRule(5, 0.8, lambda f: float(f[4]) - 0.5).decide(state)  # layer fraction 0.6 > 0.5
    assert not LearnedLayerRule(5, 0.8, lambda f: -1.0).decide(state)
    assert not LearnedLayerRule(2, 0.8, lambda f: 1.0).decide(state)  # two calls made: the budget is spent


def test_cost_aware_rule_weighs_gain_against_cost():
    cheap, dear = hand_state(called=(), strong_ms=1.0), hand_state(called=(), strong_ms=1000.0)
    rule = CostAwareRule(call_budget=5, hit_rate=0.8)
    assert rule.decide(cheap) and not rule.decide(dear)


def test_cost_aware_rule_leaves_the_strong_drafter_idle_behind_a_confident_ngram_match():
    rule = CostAwareRule(call_budget=5, hit_rate=0.8)
    assert rule.previews(1) and rule.previews(3)
    under_c_and_d = torch.tensor([3, 4])
    nothing = WeakPreview(under_c_and_d[:0], torch.empty(0, 1))
    cheap = {"called": (), "strong_ms": 10.0}  # a call costs a tenth of a verification
    assert rule.decide(hand_state(**cheap)) and rule.decide(hand_state(**cheap, weak=nothing))
    # a skip would add two chains of 8 tokens the target predicted with probability 0.95 each
    confident = WeakPreview(under_c_and_d, torch.full((2, 8), math.log(0.95)))
    assert not rule.decide(hand_state(**cheap, weak=confident))
    doubtful = WeakPreview(under_c_and_d, torch.full((2, 1), -5.0))
    assert rule.decide(hand_state(**cheap, weak=doubtful))


def test_calibration_maps_scores_to_measured_acceptance():
    tree = DraftTree.from_root(0)  # root → 1 (strong, p 0.55), 2 (n-gram, p 0.95); 1 → 3 (strong, p 0.55)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.log(torch.tensor([0.55, 0.95])), ORIGIN_MODEL)
    tree.origins[2] = ORIGIN_NGRAM
    tree.add_children(torch.tensor([1]), torch.tensor([3]), torch.log(torch.tensor([0.55 * 0.55])), ORIGIN_MODEL)
    calibration = AcceptanceCalibration(bins=10, prior_weight=2.0)
    assert torch.allclose(calibration.reach(tree), torch.tensor([1.0, 0.55, 0.95, 0.55 * 0.55]), atol=1e-6)  # prior
    for _ in range(98):  # the strong child at 0.55 is always accepted, the n-gram child at 0.95 never
        calibration.observe(tree, torch.tensor([1, 3, 5]))  # the step committed 1 3 and the bonus 5
    # nodes 1 and 3 share the strong bin 0.5-0.6 (both accepted, twice a step); node 2 the n-gram bin 0.9-1.0
    assert calibration.seen[ORIGIN_MODEL][5] == 2 + 2 * 98 and calibration.seen[ORIGIN_NGRAM][9] == 2 + 98
    strong_rate, ngram_rate = (2 * 0.55 + 2 * 98) / 198, (2 * 0.95) / 100
    reach = calibration.reach(tree)
    assert reach.tolist() == pytest.approx([1.0, strong_rate, ngram_rate, strong_rate**2])


def test_calibration_counts_what_the_committed_path_decides():
    """Nodes under the committed path count up to its length, verified or not; deeper ones and those under a
    missed node do not."""
    tree = DraftTree.from_root(0)  # root → a (1, p 0.55), b (2, p 0.35); a → c (3, p 0.25); c → d (4, p 0.15)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.log(torch.tensor([0.55, 0.35])), ORIGIN_MODEL)
    tree.add_children(torch.tensor([1]), torch.tensor([3]), torch.log(torch.tensor([0.55 * 0.25])), ORIGIN_MODEL)
    tree.add_children(torch.tensor([3]), torch.tensor([4]), torch.log(torch.tensor([0.55 * 0.25 * 0.15])), ORIGIN_MODEL)
    calibration = AcceptanceCalibration(bins=10, prior_weight=0.0)
    calibration.observe(tree, torch.tensor([1, 3]))  # a, then c's token: d lies past what the step committed
    seen, accepted = calibration.seen[ORIGIN_MODEL], calibration.accepted[ORIGIN_MODEL]
    assert (seen[5], accepted[5]) == (1, 1) and (seen[3], accepted[3]) == (1, 0)  # a accepted, b missed
    assert (seen[2], accepted[2]) == (1, 1) and seen[1] == 0  # c accepted; d not counted
    calibration.observe(tree, torch.tensor([2, 7, 7]))  # b: a and everything under it missed or unreached
    assert (seen[5], seen[3], accepted[3], seen[2]) == (2, 2, 1, 1)


def test_verify_cost_grows_with_the_tree_when_the_root_alone_was_timed():
    flat, growing = CostModel(300.0, 90.0), CostModel(300.0, 90.0, verify_root_ms=200.0)
    assert flat.verify_at(0, 16) == flat.verify_at(16, 16) == 300.0
    assert [growing.verify_at(n, 16) for n in (0, 8, 16, 40)] == [200.0, 250.0, 300.0, 300.0]
    assert not flat.grows and growing.grows


def test_verify_cost_follows_the_measured_curve():
    # a CPU-like curve: the second token moves the products off the one-row kernel, later tokens cost little
    curve = CostModel(300.0, 90.0, 100.0, verify_curve=((1, 100.0), (2, 200.0), (4, 220.0), (17, 300.0)))
    assert [curve.verify_at(n, 16) for n in (0, 1, 2, 3, 16, 40)] == pytest.approx([100, 200, 210, 220, 300, 300])
    assert curve.grows


def test_verified_count_weighs_whole_trees_not_only_the_next_node():
    """At 0.005 tokens per ms the line of 6.25 ms per node keeps nodes of reach >= 1/32; on the curve the first
    node costs 100 ms (0.5 tokens) and the next ones about 6 ms: one node of 0.4 does not pay, four together do."""
    line, curve = CostModel(300.0, 90.0, 200.0), CostModel(300.0, 90.0, 100.0, ((1, 100.0), (2, 200.0), (17, 300.0)))
    reach = [0.4, 0.3, 0.2, 0.1, 0.02]
    assert line.verified_count(reach, 0.005, 16) == 4  # 0.02 < 0.03125 <= 0.1
    assert curve.verified_count(reach[:1], 0.005, 16) == 0  # 0.4 − 0.5 < 0
    assert curve.verified_count(reach, 0.005, 16) == 4  # 1.0 − 0.005 · 220 > 0, the fifth adds 0.02 − 0.033
    assert curve.verified_count(reach, 0.02, 16) == 0  # at a rate 4x higher no tree pays for its first node
    assert curve.verified_count([1.0] * 20, 0.001, 16) == 16  # never more than the budget


def test_hit_rate_follows_how_often_strong_children_hold_the_next_token():
    tree = DraftTree.from_root(0)  # root → 1, 2 (strong); 1 → 3 (n-gram only)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([-0.1, -1.0]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([1]), torch.tensor([3]), torch.tensor([-0.5]), ORIGIN_NGRAM)
    rule = CostAwareRule(call_budget=5, hit_rate=0.5, decay=0.5)
    rule.observe(tree, torch.tensor([0, 1]), torch.tensor([1, 7]))  # root's next token 1 is a strong child: hit
    assert rule.hit_rate == pytest.approx(0.75)  # node 1 has no strong children: not counted
    rule.observe(tree, torch.tensor([0]), torch.tensor([9]))  # a miss
    assert rule.hit_rate == pytest.approx(0.375)


def root_state(layer=1, called=(), weak=None, strong_lag=1, costs=None) -> SchedulerState:
    """A step about to build ``layer`` of 4 on a CPU-like cost model: verify 240 ms (root) to 300 ms (N=16), call 90 ms."""
    return SchedulerState(
        tree=DraftTree.from_root(0),
        frontier=torch.tensor([0]),
        window=(0,),
        layer=layer,
        num_layers=4,
        called=called,
        prompt_length=9,
        costs=costs or CostModel(300.0, 90.0, verify_root_ms=240.0),
        width=4,
        budget=16,
        weak=weak,
        strong_lag=strong_lag,
    )


def strong_chain(length: int) -> DraftTree:
    """root → a chain of ``length`` strong nodes, tokens 1..length."""
    tree = DraftTree.from_root(0)
    for depth in range(length):
        tree.add_children(torch.tensor([depth]), torch.tensor([depth + 1]), torch.tensor([-0.1 * (depth + 1)]), ORIGIN_MODEL)
    return tree


class FakeClock:
    """Seconds that move only when told: the rule's measured step times, made deterministic."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_step(rule: StepRule, clock: FakeClock, tree: DraftTree, accepted: int, ms: float, weak=None, lag=1) -> bool:
    """Decide at layer 1, let ``ms`` pass, observe ``accepted`` tokens (1..accepted) verified on ``tree``."""
    strong = rule.decide(root_state(weak=weak, strong_lag=lag))
    clock.now += ms / 1000.0
    rule.observe(tree, torch.arange(accepted), torch.arange(1, accepted + 1))
    return strong


def test_step_rule_calls_at_the_strong_steps_layers_only():
    rule = StepRule(call_budget=5, hit_rate=0.8)
    assert rule.previews(1) and not rule.previews(2)
    assert rule.decide(root_state())  # nothing measured yet: a strong step measures its worth
    assert [rule.decide(root_state(layer, called=tuple(range(1, layer)))) for layer in (2, 3, 4)] == [True, True, False]
    two_and_three = StepRule(call_budget=5, hit_rate=0.8, layers=(2, 3))
    assert not two_and_three.decide(root_state()) and two_and_three.decide(root_state(2))


def test_a_fresh_step_rule_prices_the_prompt_catch_up_before_its_first_strong_step():
    """Nothing measured yet: the first step takes the kind with the best modelled rate. A strong step must first
    forward the whole prompt, modelled at a strong call's ms times what a token adds to a forward on the verify
    line (60 ms over 16 tokens on a 240 ms root: 90 · 60 / (16 · 240) ≈ 1.4 ms a token), over the catch-up horizon."""
    short_prompt = StepRule(call_budget=5, hit_rate=0.8)
    assert short_prompt.decide(root_state(strong_lag=1))  # 3.4 tokens in 570 ms beats 1 token in 240 ms
    assert short_prompt.catch_up_cost(root_state()) == pytest.approx(90.0 * 60.0 / (16 * 240.0))
    prompt = StepRule(call_budget=5, hit_rate=0.8)
    assert prompt.decide(root_state(strong_lag=500))  # + 500 · 1.4 / 8 ≈ 88 ms: 3.4 tokens in 658 ms still win
    long_prompt = StepRule(call_budget=5, hit_rate=0.8)
    assert not long_prompt.decide(root_state(strong_lag=5000))  # + 879 ms: the weak step wins
    flat = CostModel(300.0, 90.0)  # no verify curve: one strong call's ms per token it forwards (90 / 8)
    assert long_prompt.catch_up_cost(root_state(costs=flat)) == pytest.approx(90.0 / 8)


def test_the_drafters_measured_catch_up_rate_prices_the_prompt_before_the_verify_curve_does():
    """A cost model that measured the drafter's wide forward (5 ms a token) prices the catch-up at that rate: the
    500-token prompt a scaled verify curve lets a strong step pay for (above) costs 500 · 5 / 8 ≈ 312 ms, and 3.4
    tokens in 882 ms lose to 1 token in 240 ms. Once a catch-up was measured, its rate stands."""
    measured = CostModel(300.0, 90.0, verify_root_ms=240.0, strong_token_ms=5.0)
    rule = StepRule(call_budget=5, hit_rate=0.8)
    assert rule.catch_up_cost(root_state(costs=measured)) == pytest.approx(5.0)
    assert not rule.decide(root_state(strong_lag=500, costs=measured))
    assert StepRule(call_budget=5, hit_rate=0.8).decide(root_state(strong_lag=40, costs=measured))  # no catch-up
    rule.catch_up_ms_per_token = 2.0
    assert rule.catch_up_cost(root_state(costs=measured)) == pytest.approx(2.0)


def test_step_rule_prefers_a_confident_ngram_match_to_strong_calls():
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), clock=clock)
    assert run_step(rule, clock, strong_chain(4), 5, 3000.0, lag=100)  # the prompt's catch-up: not timed
    assert rule.ms == 0 and rule.kinds["full"].tau == 5.0
    for _ in range(3):  # strong steps of τ 5 in 600 ms: R = 5/600 tokens per ms
        assert run_step(rule, clock, strong_chain(4), 5, 600.0)
    assert rule.kinds["full"].tau == pytest.approx(5.0) and rule.rate == pytest.approx(5 / 600)
    assert rule.kinds["full"].mean_ms(0.0) == pytest.approx(600.0) and rule.kinds["weak"].mean_ms(240.0) == 240.0
    nothing = WeakPreview(torch.zeros(0, dtype=torch.long), torch.empty(0, 1))
    assert rule.decide(root_state(weak=nothing))  # τ 5 − 1 > R · (600 − 240): 4 > 3
    one_chain = WeakPreview(torch.tensor([0]), torch.full((1, 8), math.log(0.95)))  # e = 1 + 6.4
    assert not rule.decide(root_state(weak=one_chain))
    doubtful = WeakPreview(torch.tensor([0]), torch.full((1, 2), math.log(0.15)))  # e = 1.17
    assert rule.decide(root_state(weak=doubtful))


def test_step_rule_learns_what_a_doubtful_looking_ngram_match_is_worth():
    """Copying: chains the target once found unlikely are accepted whole; measured, they win over calls."""
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=100, clock=clock)
    doubtful = WeakPreview(torch.tensor([0]), torch.full((1, 6), math.log(0.35)), torch.tensor([[1, 2, 3, 4, 5, 6]]))
    assert run_step(rule, clock, strong_chain(4), 5, 600.0)  # R = 5/600
    assert rule.decide(root_state(weak=doubtful))  # e = 1.54: 5 − 1.54 > R · (600 − 262.5) = 2.8
    estimate = rule.estimate
    assert run_step(rule, clock, strong_chain(4), 5, 600.0, weak=doubtful)
    # the strong step committed 1 2 3 4 5: the chain would have reached 6 (at least)
    ratio = (0.8 * 2 + 5) / (0.8 * 2 + (estimate - 1))  # the prior, decayed once
    assert rule.weak_outcomes.ratio == pytest.approx(ratio)
    assert rule.weak_outcomes.expected(estimate) == pytest.approx(1 + ratio * (estimate - 1))
    assert not rule.decide(root_state(weak=doubtful))  # 5 − 2.7 < 2.8


def test_weak_outcomes_discount_estimates_that_fell_short():
    outcomes = WeakOutcomes(decay=0.5, prior_gain=2.0)
    assert outcomes.expected(5.0) == 5.0  # the prior: ρ = 1
    outcomes.observe(1.0, 3.0)  # nothing previewed: no evidence about the estimates
    assert outcomes.ratio == 1.0
    for _ in range(8):
        outcomes.observe(7.0, 1.0)  # six tokens promised, none delivered
    assert outcomes.ratio < 0.01 and outcomes.expected(7.0) < 1.1


def test_step_rule_charges_a_prompt_catch_up_over_its_horizon():
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=0, max_lag=64, catch_up_horizon=8.0, clock=clock)
    nothing = WeakPreview(torch.zeros(0, dtype=torch.long), torch.empty(0, 1))
    assert run_step(rule, clock, strong_chain(4), 5, 600.0)  # R = 5/600, T_strong = 600
    # a new prompt: 80 tokens to catch up, priced by the model (90/8 ms a token over 8 steps: still worth it);
    # it takes 400 ms more than a strong step, 5 ms a token, measured
    assert run_step(rule, clock, strong_chain(4), 5, 1000.0, weak=nothing, lag=80)
    assert rule.catch_up_ms_per_token == pytest.approx(5.0) and rule.kinds["full"].mean_ms(0.0) == pytest.approx(600.0)
    # the next prompt's catch-up costs 500 · 5 / 8 ms more: 5 − 1 < R · (912.5 − 240); exploring does not force it
    assert not rule.decide(root_state(weak=nothing, strong_lag=500))
    assert rule.decide(root_state(weak=nothing, strong_lag=10))  # nothing to catch up on: exploring calls


def test_step_rule_prices_a_weak_step_by_its_size():
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=100, clock=clock)
    weak_tree = DraftTree.from_root(0)
    weak_tree.add_children(torch.zeros(8, dtype=torch.long), torch.arange(1, 9), torch.full((8,), -0.05), ORIGIN_NGRAM)
    run_step(rule, clock, strong_chain(4), 5, 600.0)
    confident = WeakPreview(torch.tensor([0]), torch.full((1, 8), math.log(0.95)))
    assert not rule.decide(root_state(weak=confident))
    clock.now += 0.280
    rule.observe(weak_tree, torch.arange(2), torch.arange(1, 3))  # a weak step of 8 nodes took 280 ms
    costs = CostModel(300.0, 90.0, verify_root_ms=240.0)  # 3.75 ms per node
    assert rule.weak_ms(costs, 8, 16) == pytest.approx(280.0)
    assert rule.weak_ms(costs, 0, 16) == pytest.approx(250.0) and rule.weak_ms(costs, 16, 16) == pytest.approx(310.0)


def test_step_rule_prices_a_root_only_step_on_a_bent_curve_by_what_root_steps_take():
    """On a CPU the first node after the root costs most. Weak steps of 0, 0, 0 and 16 nodes that each took 20 ms
    more than their modelled verification price a root-only step at the root's time + 20, not at the curve read at
    their mean size (4 nodes) and moved back to the root."""
    clock = FakeClock()
    costs = CostModel(1800.0, 900.0, verify_root_ms=600.0, verify_curve=((1, 600.0), (2, 1000.0), (17, 1800.0)))
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=100, clock=clock)
    big = DraftTree.from_root(0)
    big.add_children(torch.zeros(16, dtype=torch.long), torch.arange(1, 17), torch.full((16,), -0.05), ORIGIN_NGRAM)
    nothing = WeakPreview(torch.zeros(0, dtype=torch.long), torch.empty(0, 1))
    for tree in (DraftTree.from_root(0), DraftTree.from_root(0), DraftTree.from_root(0), big):
        rule.wants_call(root_state(weak=nothing, costs=costs))
        rule.choice = rule.kinds["weak"]
        clock.now += (costs.verify_at(tree.size, 16) + 20.0) / 1000.0
        rule.observe(tree, torch.arange(1), torch.arange(1, 2))
    assert rule.weak_ms(costs, 0, 16) == pytest.approx(620.0, rel=1e-3)
    assert rule.weak_ms(costs, 16, 16) == pytest.approx(1820.0, rel=1e-3)


def test_step_rule_takes_a_short_strong_step_when_it_pays_best():
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, explore=1, clock=clock)
    assert run_step(rule, clock, strong_chain(4), 5, 600.0)  # the first step is full: τ 5 in 600 ms
    assert rule.choice is rule.kinds["full"]
    assert run_step(rule, clock, strong_chain(3), 4, 400.0)  # short unused for 1 step: explored, τ 4 in 400 ms
    assert rule.choice is rule.kinds["short"] and rule.kinds["short"].tau == 4.0
    rule.explore = 100
    # R = 8.75 / 970: short 4 − 400 R = 0.39 beats full 5 − 600 R = −0.41 and weak 1 − 240 R = −1.16
    assert rule.decide(root_state()) and rule.choice is rule.kinds["short"]
    assert not rule.decide(root_state(2, called=(1,)))  # a short step calls at layer 1 only


def test_chain_match_counts_the_longest_common_prefix_with_the_committed_tokens():
    tokens = torch.tensor([[5, 6, 7], [5, 9, 0], [8, 0, 0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, float("-inf")], [-1.0, float("-inf"), float("-inf")]])
    preview = WeakPreview(torch.tensor([0, 0, 0]), logp, tokens)
    assert chain_match(preview, torch.tensor([5, 6, 8])) == 3
    assert chain_match(preview, torch.tensor([5, 6])) == 3  # a lower bound: the chain matched all it could
    assert chain_match(preview, torch.tensor([7])) == 1
    assert chain_match(WeakPreview(torch.tensor([2]), logp[:1], tokens[:1]), torch.tensor([5])) == 1  # not a root chain


def test_step_rule_explores_after_a_run_of_weak_steps_and_tracks_strong_tau():
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=3, strong_decay=0.5, clock=clock)
    confident = WeakPreview(torch.tensor([0]), torch.full((1, 8), math.log(0.95)))
    run_step(rule, clock, strong_chain(4), 3, 600.0)
    weak_tree = DraftTree.from_root(0)
    weak_tree.add_children(torch.tensor([0]), torch.tensor([1]), torch.tensor([-0.05]), ORIGIN_NGRAM)
    for _ in range(3):
        assert not run_step(rule, clock, weak_tree, 2, 300.0, weak=confident)
    assert rule.kinds["weak"].mean_ms(0.0) == pytest.approx(300.0)
    assert rule.decide(root_state(weak=confident))  # the fourth in a row is strong: τ_strong is re-measured
    rule.observe(strong_chain(4), torch.arange(5), torch.arange(1, 6))
    assert rule.kinds["full"].tau == pytest.approx(0.5 * 3 + 0.5 * 5) and rule.kinds["full"].idle == 0


def test_step_rule_does_not_interrupt_a_copy_to_explore_a_kind_that_cannot_win():
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=2, clock=clock)
    confident = WeakPreview(torch.tensor([0]), torch.full((1, 8), math.log(0.95)), torch.arange(1, 9)[None])
    run_step(rule, clock, strong_chain(4), 2, 600.0)  # strong steps reach τ 2 in 600 ms here
    copy = DraftTree.from_root(0)
    for depth in range(8):
        copy.add_children(torch.tensor([depth]), torch.tensor([depth + 1]), torch.tensor([-0.05 * (depth + 1)]), ORIGIN_NGRAM)
    for _ in range(4):  # whole chains accepted in 300 ms: even τ 4 in 600 ms would not beat them
        assert not run_step(rule, clock, copy, 9, 300.0, weak=confident)
    assert rule.kinds["full"].idle == 4
    rule.explore_upside = 100.0  # a kind that might win is explored
    assert rule.decide(root_state(weak=confident))


def test_step_rule_waits_longer_to_explore_a_kind_each_time_exploring_it_lost():
    """Strong steps of τ 2 in 600 ms against copies of τ 4 in 300 ms: each exploration loses, so the waits between
    them double from ``explore`` up to ``explore_limit``; one that wins resets the wait."""
    clock = FakeClock()
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=2, explore_upside=100.0, explore_limit=8,
                    strong_decay=0.0, clock=clock)
    confident = WeakPreview(torch.tensor([0]), torch.full((1, 8), math.log(0.95)), torch.arange(1, 9)[None])
    copy = DraftTree.from_root(0)
    for depth in range(8):
        copy.add_children(torch.tensor([depth]), torch.tensor([depth + 1]), torch.tensor([-0.05 * (depth + 1)]), ORIGIN_NGRAM)

    def strong_steps(count: int, strong_tau: int) -> list[int]:  # the steps that called
        called = []
        for step in range(count):
            strong = rule.decide(root_state(weak=confident))
            clock.now += (600.0 if strong else 300.0) / 1000.0
            tau = strong_tau if strong else 4
            rule.observe(strong_chain(8) if strong else copy, torch.arange(tau), torch.arange(1, tau + 1))
            called += [step] if strong else []
        return called

    assert strong_steps(30, 2) == [2, 7, 16, 25]  # the copies win from the first step; waits of 2, 4, 8, 8 steps
    assert rule.kinds["full"].backoff == 4
    strong_steps(9, 9)  # the next exploration finds τ 9 in 600 ms, which beats the copies: chosen on its value
    assert rule.kinds["full"].backoff == 1 and rule.choice is rule.kinds["full"]


def test_chain_tokens_are_scored_where_the_ngram_matched(tiny_self_pair):
    drafter, target = tiny_self_pair
    models = Models(CausalLM(target.model), CausalLM(drafter.model), 256)
    method = create_method(DecodeConfig(method="all-small", tree=SMALL_TREE), models)
    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6])
    logits = torch.randn(prompt.numel(), 256)
    method.start(Prefill(prompt, logits))
    committed = torch.cat([prompt, torch.tensor([7])])
    method.index.sync(committed)
    growth = Growth.start(7)
    proposal = method.loop.propose_weak(growth, 1)
    # "5 6 7" matched ending at position 2: the chain 8 9 5 6 7 follows; token j came after position 2 + j
    assert proposal.preview.tokens[:, :4].tolist() == [[8, 9, 5, 6]]
    logp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logp, TreeGraftConfig().top_w, dim=-1)
    wanted = [logp[2 + j, t] if t in top.indices[2 + j] else top.values[2 + j, -1] - 5.0 for j, t in enumerate((8, 9, 5, 6))]
    assert torch.allclose(proposal.preview.logp[0, :4], torch.stack(wanted), atol=1e-5)
    # with rates equal to the log-probs' own probabilities, reach is the chain's cumulative probability
    reach = proposal.preview.reach([1.0] * growth.tree.num_nodes, lambda origin, local: local)
    assert torch.allclose(torch.tensor(reach[:4]), torch.stack(wanted).cumsum(0).exp(), atol=1e-5)
    method.loop.weak_layer(growth, 1, proposal)
    assert torch.allclose(growth.tree.scores[1:5], torch.stack(wanted).cumsum(0), atol=1e-5)


def test_fixed_layers_resolve_from_the_method_name(tiny_self_pair):
    drafter, target = tiny_self_pair
    models = Models(CausalLM(target.model), CausalLM(drafter.model), 256)
    method = create_method(DecodeConfig(method="fixed:1,3"), models)
    assert method.policy.layers == frozenset({1, 3})
    with pytest.raises(ConfigError):
        create_method(DecodeConfig(method="dense:2"), models)
    with pytest.raises(ConfigError):
        create_method(DecodeConfig(method="treegraft", method_options={"polcy": "all-mid"}), models)


def test_method_options_from_the_command_line():
    from treegraft_cli.config import parse_options as parse_method_options

    assert parse_method_options(["layers=1,3", "call_budget=2", "policy=all-mid"]) == {
        "layers": "1,3",
        "call_budget": 2,
        "policy": "all-mid",
    }
    with pytest.raises(ConfigError):
        parse_method_options(["layers"])
    with pytest.raises(ConfigError):
        make_policy("sometimes", TreeGraftConfig())


def test_costs_are_measured_once_per_set_of_models(tiny_self_pair, monkeypatch):
    import treegraft_cli.methods.treegraft as treegraft_module

    timed = []
    real = treegraft_module.measure_costs

    def counting(*args, **kwargs):
        timed.append(args[3:])  # (budget, width)
        return real(*args, **kwargs)

    monkeypatch.setattr(treegraft_module, "measure_costs", counting)
    drafter, target = tiny_self_pair
    measurements: dict = {}
    for tokens in (4, NEW_TOKENS):  # a warm-up decoder, then the timed one
        config = DecodeConfig(method="treegraft", tree=SMALL_TREE, max_new_tokens=tokens)
        decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model), measurements=measurements)
        decoder.generate(repetitive_prompt(1))
        costs = decoder.method.costs
        assert costs.verify_ms > 0 and costs.strong_ms > 0
        # the verification curve reaches the rule: the root alone, the powers of two below N + 1, a full tree
        assert [tokens for tokens, _ in costs.verify_curve] == [1, 2, 4, 8, 16, SMALL_TREE.budget + 1]
        assert costs.verify_root_ms == costs.verify_curve[0][1] and costs.verify_ms == costs.verify_curve[-1][1]
    assert timed == [(SMALL_TREE.budget, SMALL_TREE.top_k)]
    other = DecodeConfig(method="treegraft", tree=TreeConfig(budget=8, depth=3, top_k=2), max_new_tokens=4)
    SpeculativeDecoder(CausalLM(target.model), other, drafter=CausalLM(drafter.model), measurements=measurements).generate(
        repetitive_prompt(1)
    )
    assert timed[-1] == (8, 2)  # another tree shape is timed anew


def test_step_rule_verifies_only_nodes_whose_reach_pays_for_their_verification():
    """R = 5/600 tokens per ms and 3.75 ms per verified node: a node must be expected to add 1/32 of a token."""
    clock = FakeClock()
    costs, flat = CostModel(300.0, 90.0, verify_root_ms=240.0), CostModel(300.0, 90.0)
    tree = DraftTree.from_root(0)  # root → a (p 0.9) → b (0.3) → c (0.05); root → d (0.02)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 4]), torch.tensor([math.log(0.9), math.log(0.02)]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([1]), torch.tensor([2]), torch.tensor([math.log(0.9 * 0.3)]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([3]), torch.tensor([3]), torch.tensor([math.log(0.9 * 0.3 * 0.05)]), ORIGIN_MODEL)
    # R unmeasured: plain decoding's modelled rate, one token per 240 ms, asks 3.75 / 240 of a token per node
    first = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), clock=clock).trim(tree, costs, 16)
    assert first.tokens.tolist() == [0, 1, 4, 2]  # c (reach 0.011 at the calibration's prior) dropped
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), clock=clock)
    run_step(rule, clock, strong_chain(4), 5, 600.0)
    assert rule.rate == pytest.approx(5 / 600)
    reach = rule.calibration.reach(tree)  # a 0.98, b 0.34, c 0.017, d 0.05
    assert reach[4] < 5 / 600 * 3.75 < reach[2]  # what a node must add to pay for its 3.75 ms
    trimmed = rule.trim(tree, costs, 16)
    assert trimmed.tokens.tolist() == [0, 1, 4, 2]  # c dropped; its ancestors and d stay
    assert trimmed.parents.tolist() == [-1, 0, 0, 1]
    # the calibration learns from the tree before the trim: the target went on with c's token after a and b,
    # so c counts as accepted though it was never verified (d, verified, as a miss; both in the lowest bin)
    seen, accepted = rule.calibration.seen[ORIGIN_MODEL][0], rule.calibration.accepted[ORIGIN_MODEL][0]
    rule.observe(trimmed, torch.tensor([0, 1, 3]), torch.tensor([1, 2, 3]))
    assert rule.calibration.seen[ORIGIN_MODEL][0] == seen + 2
    assert rule.calibration.accepted[ORIGIN_MODEL][0] == accepted + 1
    assert rule.trim(tree, flat, 16) is tree  # no per-node cost: nothing to save
    keep_all = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), clock=clock, trim=False)
    run_step(keep_all, clock, strong_chain(4), 5, 600.0)
    assert keep_all.trim(tree, costs, 16) is tree


def test_a_weak_step_trims_at_the_discount_its_estimates_have_earned():
    """ρ (``WeakOutcomes.ratio``) scales a weak step's reach, capped at 1, as it scales τ_weak: chains that have been
    copying keep more nodes, chance repeats fewer; a strong step's trim ignores it. The tree and costs of the test
    above, R unmeasured: a node must add 3.75 / 240 = 0.0156 tokens (reach at the prior: a 0.85, b 0.21, c 0.011,
    d 0.05)."""
    clock = FakeClock()
    costs = CostModel(300.0, 90.0, verify_root_ms=240.0)
    tree = DraftTree.from_root(0)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([1, 4]), torch.tensor([math.log(0.9), math.log(0.02)]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([1]), torch.tensor([2]), torch.tensor([math.log(0.9 * 0.3)]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([3]), torch.tensor([3]), torch.tensor([math.log(0.9 * 0.3 * 0.05)]), ORIGIN_MODEL)

    def kept(kind: str, ratio: float, called: tuple[int, ...] | None = None) -> list[int]:
        rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), clock=clock)
        rule.choice = rule.step_kinds(4)[kind]
        rule.weak_outcomes.measured = ratio * rule.weak_outcomes.estimated
        return rule.trim(tree, costs, 16, called).tokens.tolist()

    assert kept("weak", 1.0) == [0, 1, 4, 2]  # as the rule without a discount: c dropped
    assert kept("weak", 2.0) == [0, 1, 4, 2, 3]  # c's 0.021 pays at twice its reach
    assert kept("weak", 0.25) == [0, 1, 2]  # d's 0.0125 does not at a quarter
    assert kept("weak", 0.001) == [0]
    assert kept("full", 2.0) == kept("full", 0.25) == [0, 1, 4, 2]
    # a forced build (collect's probe of another kind) is trimmed as the layers it called, not as the step's choice
    assert kept("weak", 0.25, called=(1, 2, 3)) == [0, 1, 4, 2]
    assert kept("full", 0.25, called=()) == [0, 1, 2]


def test_a_weak_step_is_judged_on_its_verified_nodes_and_the_dropped_children_of_its_accepted_ones():
    """root → a → b → c and root → d; a and b verified (reach 0.8, 0.4), c and d dropped (reach 0.2, 0.1)."""
    parents, tokens, depths = [-1, 0, 1, 2, 0], [0, 1, 2, 3, 4], [0, 1, 2, 3, 1]
    reach = [1.0, 0.8, 0.4, 0.2, 0.1]
    # the target took a and b, then c's token: c (rate 0.2 / 0.4 given b) would have been accepted; d (0.1) missed
    assert verified_outcome(parents, tokens, depths, reach, {1, 2}, [1, 2, 3]) == (pytest.approx(0.8 + 0.4 + 0.5 + 0.1), 3)
    # the target took a, then 9: b verified and rejected; c's parent was not accepted, so c shows nothing
    assert verified_outcome(parents, tokens, depths, reach, {1, 2}, [1, 9]) == (pytest.approx(0.8 + 0.4 + 0.1), 1)
    # trimmed to the root: the committed token still judges the root's children
    assert verified_outcome(parents, tokens, depths, reach, set(), [4]) == (pytest.approx(0.8 + 0.1), 1)
    assert verified_outcome(parents, tokens, depths, reach, set(), [7]) == (pytest.approx(0.8 + 0.1), 0)


def test_a_discount_that_trims_every_tree_to_its_root_still_learns_when_the_chains_copy():
    """A ρ so low that the trim keeps nothing: the chains' first tokens, right every step, raise it until the trim
    verifies chains again (a ρ measured on verified nodes only would stay where it was for good)."""
    clock = FakeClock()
    costs = CostModel(300.0, 90.0, verify_root_ms=240.0)
    rule = StepRule(call_budget=5, hit_rate=0.8, short_layers=(), explore=100, clock=clock)
    rule.choice = rule.step_kinds(4)["weak"]
    rule.weak_outcomes.measured = 0.001 * rule.weak_outcomes.estimated
    copy = DraftTree.from_root(0)
    for depth in range(4):
        copy.add_children(torch.tensor([depth]), torch.tensor([depth + 1]), torch.tensor([-0.05 * (depth + 1)]), ORIGIN_NGRAM)
    ratios, sizes = [rule.weak_outcomes.ratio], []
    for _ in range(12):
        trimmed = rule.trim(copy, costs, 16)
        sizes.append(trimmed.size)
        accepted = trimmed.size + 1  # the kept nodes are the chain's head, all accepted, then the bonus
        rule.observe(trimmed, torch.arange(accepted), torch.arange(1, accepted + 1))
        ratios.append(rule.weak_outcomes.ratio)
    assert sizes[0] == 0 and ratios[1] > ratios[0]
    assert sizes[-1] == 4  # the whole chain is verified again


def test_a_strong_call_forwards_the_nodes_with_children_in_order_then_the_pool_best_first():
    """Unforwarded nodes with children (n-gram chains to rescore) come first, ascending, so every node follows its
    ancestors and an accepted path's cache rows ascend; then the best of the window, best first; never the root."""
    parents = [-1, 0, 0, 1, 3, 0, 2]  # nodes 0 (the root) .. 6
    scores = [0.0, -1.0, -0.5, -1.5, -2.0, -0.2, -0.9]
    rows = [-1, 0, -1, -1, -1, -1, -1]  # node 1 forwarded already; the root's row comes with the pending tokens
    window = [0, 2, 4, 5, 6]
    assert needed_nodes(parents, scores, rows, window, pool=2) == [2, 3, 5]  # the pool's best two: 5, and 2 (listed)
    assert needed_nodes(parents, scores, rows, window, pool=4) == [2, 3, 5, 6, 4]
