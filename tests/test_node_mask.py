"""A drafter's mask over a forward's tree-node rows (``ModelDrafter.node_mask``).

Vocabulary: the *committed* rows of the drafter's cache come first; a step's *node rows* follow them in the order
the nodes were forwarded (``step_nodes``). A node row must see every committed row and, of the step's node rows,
exactly its ancestors' and its own.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt

from treegraft_cli.drafters.strong import TreeDrafter
from treegraft_cli.lm import CausalLM
from treegraft_cli.tree import ORIGIN_MODEL, DraftTree


def recording(drafter: TreeDrafter) -> list[torch.Tensor]:
    """The additive masks of the drafter's forwards, as ``[rows, columns]``, in call order."""
    masks, forward = [], drafter.lm.forward

    def record(tokens, positions=None, logits_to_keep=0, mask=None, **kwargs):
        masks.append(None if mask is None else mask.reshape(-1, mask.shape[-1]).clone())
        return forward(tokens, positions, logits_to_keep=logits_to_keep, mask=mask, **kwargs)

    drafter.lm.forward = record
    return masks


def grown_tree(root: int) -> DraftTree:
    """Root → 1, 2; 1 → 3, 4; 2 → 5; 3 → 6 (a host tree)."""
    tree = DraftTree.from_root(root, host=True)
    tree.add_root_children([11, 12], [-0.1, -0.2], ORIGIN_MODEL)
    for parents, tokens in (([1, 1, 2], [13, 14, 15]), ([3], [16])):
        tree.add_rescored_children(parents, tokens, [-1.0] * len(parents), ORIGIN_MODEL, tree.host_list("scores"))
    return tree


def seen_columns(mask: torch.Tensor) -> list[set[int]]:  # mask: [rows, columns] additive
    return [set(torch.nonzero(row == 0).flatten().tolist()) for row in mask]


def test_node_rows_see_the_committed_rows_and_their_ancestors_rows_of_the_step(tiny_self_pair):
    drafter = TreeDrafter(CausalLM(tiny_self_pair[0].model))
    masks = recording(drafter)
    committed = random_prompt(3, length=12)
    tree = grown_tree(int(committed[-1]))
    drafter.reset()
    drafter.start_step()
    calls = [[1, 2], [3, 5], [6, 4]]  # the first call forwards the committed tokens too (pending)
    for nodes in calls:
        drafter.forward(committed, tree, torch.tensor(nodes), None, tree.ancestor_mask())
    length, slots = committed.shape[0], tree.kv_slot.tolist()
    assert slots[1:] == [length, length + 1, length + 2, length + 5, length + 3, length + 4]  # forward order
    parents = tree.parents.tolist()
    for call, (nodes, mask) in enumerate(zip(calls, masks, strict=True)):
        rows = seen_columns(mask)[-len(nodes):]  # the pending rows come first at the first call
        for node, seen in zip(nodes, rows, strict=True):
            wanted, ancestor = set(range(length)), node
            while ancestor > 0:
                wanted.add(slots[ancestor])
                ancestor = parents[ancestor]
            assert seen == wanted, (call, node)
        assert mask.shape[1] == length + sum(len(n) for n in calls[: call + 1])


def test_a_cache_holding_rows_the_drafter_did_not_record_is_refused(tiny_self_pair):
    drafter = TreeDrafter(CausalLM(tiny_self_pair[0].model))
    committed = random_prompt(4, length=10)
    tree = grown_tree(int(committed[-1]))
    drafter.reset()
    drafter.start_step()
    drafter.forward(committed, tree, torch.tensor([1, 2]), None, tree.ancestor_mask())
    drafter.lm.forward(torch.tensor([7]))  # a row the drafter knows nothing of
    with pytest.raises(RuntimeError, match="crop it before a step's first call"):
        drafter.forward(committed, tree, torch.tensor([3]), None, tree.ancestor_mask())
    drafter.start_step()  # a step starts from the committed rows again
    drafter.forward(committed, tree, torch.tensor([1, 3]), None, tree.ancestor_mask())
    assert tree.kv_slot[3] == committed.shape[0] + 1
