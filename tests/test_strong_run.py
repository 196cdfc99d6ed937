"""Strong layers run on the device from layer 1 on (``grafting.strong_run``): the same trees as the host layer
loop, node for node and score for score, with one read for the whole run, or none when the run covers every layer
and nothing reads the tree on the host (``all-mid``, drafted on the dense layout: ``drafters.dense_layout.OpenLayout``)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, reference_greedy

from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.grafting.strong_run import plan_run
from treegraft_cli.lm import CausalLM
from treegraft_cli.methods.treegraft import TreeGraftMethod
from treegraft_cli.scheduling.policies import AllMid, FixedLayers
from treegraft_cli.tree import COLUMNS

TREE = TreeConfig(budget=16, depth=4, top_k=4)
NEW_TOKENS = 40


def test_a_plan_counts_what_each_layer_forwards_and_grafts():
    plan = plan_run(layers=4, width=4, pool=8, max_depth=10)
    layers = range(1, 5)
    assert [plan.forwarded(layer) for layer in layers] == [0, 4, 4, 4]  # the pending tokens only, then the K best
    assert [plan.positions(layer) for layer in layers] == [1, 4, 4, 4]
    assert [plan.nodes_before(layer) for layer in (1, 2, 3, 4)] == [1, 5, 21, 37]
    assert plan.capacity == 53


@pytest.mark.parametrize(("layers", "width", "pool", "max_depth"), [
    (3, 4, 3, 10),  # a pool below K: a layer could find fewer than K candidates
    (4, 4, 8, 3),  # deeper than max_depth: children would leave the window
])
def test_a_run_whose_counts_depend_on_the_data_is_not_planned(layers, width, pool, max_depth):
    assert plan_run(layers, width, pool, max_depth) is None
    assert plan_run(2, width, max(pool, width), max(max_depth, 2)) is not None  # two layers from the root always are


def test_policies_plan_the_layers_they_call_from_the_first_on():
    assert AllMid(call_budget=5).planned_calls(4) == 4
    assert AllMid(call_budget=2).planned_calls(4) == 2
    assert FixedLayers(5, (1, 2, 4)).planned_calls(4) == 2
    assert FixedLayers(5, (2, 3)).planned_calls(4) == 0


def drafted(pair, method: str, prompt: torch.Tensor, tree: TreeConfig = TREE,
            **options) -> tuple[list[dict], list[int], list[int], int]:
    """Every tree the method drafted (its columns and ancestor mask), the output, each step's reads, and the strong
    drafter's forwards."""
    drafter, target = pair
    config = DecodeConfig(method=method, tree=tree, max_new_tokens=NEW_TOKENS, method_options=options)
    decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model))
    trees = []
    draft = decoder.method.draft

    def recording(committed):
        tree = draft(committed)
        trees.append({**{name: getattr(tree, name).tolist() for name in COLUMNS}, "mask": tree.ancestor_mask().tolist()})
        return tree

    decoder.method.draft = recording
    result = decoder.generate(prompt)
    return (trees, result.output_ids, [step.syncs for step in result.steps],
            sum(step.drafter_calls.get("model", 0) for step in result.steps))


# the most reads a step takes on the host loop and with the device runs: the verdict's, and one per strong call on the
# host (the look-ahead's first-layer call reads with the verdict), one per device run
@pytest.mark.parametrize(("method", "options", "host_reads", "device_reads"), [
    ("all-mid", {}, 5, 1),  # the whole step strong: not read at all
    ("fixed:1,2", {}, 3, 2),  # a run, then weak layers on the host
    ("fixed:1,2,3", {}, 4, 2),  # what the step rule's full steps call (its choices follow measured times: not repeatable)
    ("fixed:1,2,4", {}, 4, 3),  # a strong call after the run and a weak layer: it rescores from the run's rows
    ("all-mid", {"lookback": 1, "pool": 16}, 5, 1),  # a narrow window, a wide pool
    ("fixed:1,3", {}, 2, 2),  # a lone call after a weak layer forwards the pool (on the host in both)
    ("fixed:2,3", {}, 3, 3),  # strong layers after a weak one: each read on its own (the run starts at the root)
])
@pytest.mark.parametrize("pair_name", ["tiny_self_pair", "tiny_pair"])
def test_the_device_run_drafts_the_host_loops_trees_with_one_read(request, method, options, host_reads, device_reads,
                                                                  pair_name):
    pair = request.getfixturevalue(pair_name)
    prompt = torch.cat([random_prompt(5, length=12)] * 2)
    on_host = drafted(pair, method, prompt, device_layers=False, **options)
    on_device = drafted(pair, method, prompt, **options)
    assert len(on_device[0]) == len(on_host[0]) > 3
    for step, (device_tree, host_tree) in enumerate(zip(on_device[0], on_host[0], strict=True)):
        assert device_tree == host_tree, f"step {step}"
    assert on_device[1] == on_host[1] == reference_greedy(pair[1], prompt, NEW_TOKENS)
    assert max(on_host[2]) == host_reads and max(on_device[2]) == device_reads


def test_a_run_over_every_layer_read_to_the_host_drafts_the_host_loops_trees(tiny_self_pair, monkeypatch):
    """A caller that reads the step's tree on the host (``collect``, a policy's measured history) gets a run over every
    layer read back whole, then cut on the host: the host loop's trees, with two reads a step."""
    monkeypatch.setattr(TreeGraftMethod, "device_tree", property(lambda method: False))
    prompt = torch.cat([random_prompt(5, length=12)] * 2)
    on_host = drafted(tiny_self_pair, "all-mid", prompt, device_layers=False)
    on_device = drafted(tiny_self_pair, "all-mid", prompt)
    assert on_device[0] == on_host[0] and len(on_host[0]) > 3
    assert on_device[1] == on_host[1] == reference_greedy(tiny_self_pair[1], prompt, NEW_TOKENS)
    assert max(on_host[2]) == 5 and max(on_device[2]) == 2


@pytest.mark.parametrize("depth", [4, 6])  # 6: later layers forward such children, at their positions
def test_children_of_an_open_node_a_later_layer_forwards_hang_one_level_below_it(tiny_self_pair, depth):
    """A layer may forward a node an earlier layer left open, shallower than the layer before forwarded: its children
    sit one level below it, not at the depth of the layer's block in the dense layout (the target verifies each node
    at its depth's position). On the tiny pair every layer's open nodes of an earlier layer outrank the children of
    the last, and a budget of the whole pool (4 + 16 per later layer) keeps the children they get."""
    whole_pool = TreeConfig(budget=4 + 16 * (depth - 1), depth=depth, top_k=4)
    prompt = torch.cat([random_prompt(5, length=12)] * 2)
    on_host = drafted(tiny_self_pair, "all-mid", prompt, whole_pool, device_layers=False, call_budget=depth)
    on_device = drafted(tiny_self_pair, "all-mid", prompt, whole_pool, call_budget=depth)
    # the case arises: depth-3 nodes under more than the K depth-2 nodes layer 3 forwarded
    assert all(len({p for p, d in zip(t["parents"], t["depths"], strict=True) if d == 3}) > 4 for t in on_host[0])
    assert len(on_device[0]) == len(on_host[0]) > 3
    for step, (device_tree, host_tree) in enumerate(zip(on_device[0], on_host[0], strict=True)):
        assert device_tree == host_tree, f"step {step}"
    assert on_device[1] == on_host[1] == reference_greedy(tiny_self_pair[1], prompt, NEW_TOKENS)


@pytest.mark.parametrize("method", ["fixed:1,3", "fixed:1"])
@pytest.mark.parametrize("pair_name", ["tiny_self_pair", "tiny_pair"])
def test_a_lone_first_layer_call_made_ahead_drafts_the_same_trees_with_one_read_less(request, method, pair_name):
    """The next step's layer-1 call, made before the verdict is read over the tokens the step commits padded to the
    tree's depth, grafts what the call made in its own step grafts (its root row from another forward: the same up to
    float rounding), keeps the drafter's cache right for the calls after it, and saves that call's read."""
    pair = request.getfixturevalue(pair_name)
    prompt = torch.cat([random_prompt(5, length=12)] * 2)
    in_step = drafted(pair, method, prompt, look_ahead=False)
    ahead = drafted(pair, method, prompt)
    assert len(ahead[0]) == len(in_step[0]) > 3
    for step, (early, late) in enumerate(zip(ahead[0], in_step[0], strict=True)):
        assert {k: v for k, v in early.items() if k != "scores"} == {k: v for k, v in late.items() if k != "scores"}, step
        assert early["scores"] == pytest.approx(late["scores"], abs=1e-5), step
    assert ahead[1] == in_step[1] == reference_greedy(pair[1], prompt, NEW_TOKENS)
    assert [syncs + 1 for syncs in ahead[2]] == in_step[2]
    assert ahead[3] == in_step[3]  # the call moved, not added: the first step's after the prefill, the last step's extra


def test_the_step_rules_strong_steps_read_twice(tiny_self_pair):
    """Verification priced far above a strong call: the step rule takes full strong steps, each one run."""
    prompt = torch.cat([random_prompt(6, length=12)] * 2)
    trees, output, reads, _ = drafted(tiny_self_pair, "treegraft", prompt, verify_ms=100.0, strong_ms=5.0)
    full = [step for step, tree in enumerate(trees) if sum(origin == 1 for origin in tree["origins"]) > TREE.top_k]
    assert full and max(reads) == 2
    assert output == reference_greedy(tiny_self_pair[1], prompt, NEW_TOKENS)
