"""The host walk and the step verdict against the device reference (``verify.accept``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import random_parents, tokens_against

from treegraft_cli import verify
from treegraft_cli.tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
trees = st.tuples(st.integers(1, 40), st.sampled_from([40, 200]), st.integers(0, 2**31 - 1))


def random_case(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents, tokens (distinct siblings, about half the parents with a child on their choice), choices; [1, n] each."""
    generator = torch.Generator().manual_seed(seed)
    parents = random_parents(generator, 1, n)
    choices = torch.randint(0, vocab, (1, n), generator=generator)
    return parents, tokens_against(generator, parents, choices, vocab), choices


@SETTINGS
@given(tree=trees)
def test_accept_on_host_equals_the_device_walk(tree):
    parents, tokens, choices = random_case(*tree)
    want = verify.accept(tokens, parents, choices)
    path, bonus = verify.accept_on_host(choices[0].tolist(), tokens[0].tolist(), parents[0].tolist())
    a = int(want.num_accepted[0])
    assert path == want.path[0, : a + 1].tolist()
    assert want.path[0, a + 1 :].eq(-1).all()
    assert bonus == int(want.bonus[0])


def test_accept_on_host_stops_at_a_mismatch():
    # root → 1 (token 5) → 3 (token 7); the root chooses 5, node 1 chooses 8: only node 1 is accepted, bonus 8
    path, bonus = verify.accept_on_host([5, 8, 0, 0], [9, 5, 6, 7], [-1, 0, 0, 1])
    assert (path, bonus) == ([0, 1], 8)


def draft_tree(parents: torch.Tensor, tokens: torch.Tensor, host: bool = False) -> DraftTree:  # [1, n] each
    tree = DraftTree.from_root(int(tokens[0, 0]), host=True) if host else DraftTree.from_root(tokens[0, :1])
    for i in range(1, parents.shape[1]):
        origin = ORIGIN_NGRAM if i % 3 == 0 else ORIGIN_MODEL  # mixed origins: the read must keep each its own
        tree.add_children(parents[0, i : i + 1], tokens[0, i : i + 1], torch.zeros(1), origin)
    return tree


@SETTINGS
@given(tree=trees)
def test_step_verdicts_greedy_and_device_read_the_same(tree):
    """What the engine makes of one read: the host walk over the choices and the device verdict agree on the accepted
    nodes, the new tokens, depths and origins; both find the reference's rows along the accepted path, and the tokens
    the step commits (what a drafter forwards ahead of the read) before any read."""
    parents, tokens, choices = random_case(*tree)
    drafted = draft_tree(parents, tokens)
    want = verify.accept(tokens, parents, choices)
    greedy = verify.StepVerdict(drafted, choices=choices[0])
    device = verify.StepVerdict(drafted, device_verdict=want)
    assert greedy.unpack(greedy.packed().tolist()) == device.unpack(device.packed().tolist())
    deepest = int(drafted.depths.max())
    rows = want.path[0, : deepest + 1].clamp(min=0)  # the accepted nodes by depth, the root's index after them
    assert torch.equal(greedy.path_rows(deepest), rows) and torch.equal(device.path_rows(deepest), rows)
    accepted, new_tokens, depths, origins = greedy.unpack(greedy.packed().tolist())
    assert new_tokens[-1] == int(want.bonus[0]) and len(accepted) == int(want.num_accepted[0]) + 1
    assert depths == drafted.depths[1:].tolist() and origins == drafted.origins[1:].tolist()
    for verdict in (greedy, device):
        block, count = verdict.committed_block(verdict.path_rows(deepest))
        assert count.tolist() == [len(new_tokens) - 1] and block.tolist()[: len(new_tokens)] == new_tokens
    # a host-side builder's tree: the host holds its columns, the read carries the verdict's part alone
    host = draft_tree(parents, tokens, host=True)
    for verdict in (verify.StepVerdict(drafted, choices=choices[0], host_tree=host),
                    verify.StepVerdict(drafted, device_verdict=want, host_tree=host)):
        packed = verdict.packed()
        assert packed.numel() == (drafted.num_nodes if verdict.choices is not None else drafted.num_nodes + 2)
        assert verdict.unpack(packed.tolist()) == (accepted, new_tokens, depths, origins)
