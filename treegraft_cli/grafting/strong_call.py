"""One strong call of the host layer loop, on host lists: which nodes it forwards (``needed_nodes``), what it reads
back (``strong_lookup``: one read), how the tree is rescored and where it grafts (``rescored``, ``reselect``).

The device run (``strong_run``) and the dense layout (``drafters.dense_layout``) draft the same trees as tensor ops;
these functions are the reference they are tested against.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..drafters.logp_rows import LogProbRows
from ..hostlists import longs
from ..lm import on_device_of
from ..syncs import fetch, host_only
from ..tree import float32


@dataclass(frozen=True)
class StrongLookup:
    """What one strong call sends back to the host, read at once: each non-root node's strong log-prob given its
    parent, and the top-K children of every grafting candidate."""

    local: list[float]  # [num_nodes - 1] nodes 1.. in order
    top_logp: list[list[float]]  # [candidates, K] the candidates' top-K strong log-probs
    top_tokens: list[list[int]]  # [candidates, K]


def strong_lookup(
    logp_rows: LogProbRows,  # the strong drafter's log-prob rows of this step, on its device
    parents: list[int],  # [num_nodes] the host tree's columns
    tokens: list[int],  # [num_nodes]
    rows: list[int],  # [num_nodes] each node's row in ``logp_rows``, -1 if none
    candidates: list[int],  # [c] nodes a reselection may pick (each has a row)
    k: int,
    rescore: bool = True,
) -> StrongLookup:
    """Gather every node's local strong log-prob and every candidate's top-``k`` children on the device; one read.

    The reselection itself needs the rescored scores, a sequential sum down each path: the host does it
    (``rescored``, ``reselect``) on what this returns, so the device pass needs no loop over depths.
    ``rescore`` False: every node is the strong drafter's own child, scored with the log-prob rescoring would sum
    again (a tree without n-gram chains, ``LayerLoop.pool_at``), so no local log-prob is gathered (``local`` empty).
    """
    logp = logp_rows.view  # [rows, vocab]
    if not rescore:
        top_logp, top_tokens = fetch(*logp_rows.top(on_device_of(longs([rows[c] for c in candidates]), logp.device), k))
        with host_only():
            return StrongLookup([], top_logp.tolist(), top_tokens.tolist())
    device, m = logp.device, len(parents) - 1
    vocab = logp.shape[1]
    # each node's (row, token) entry as a flat index, then the candidates' rows: one host tensor, one copy
    index = on_device_of(longs([rows[p] * vocab + t for p, t in zip(parents[1:], tokens[1:], strict=True)]
                               + [rows[c] for c in candidates]), device)
    local = logp.reshape(-1).index_select(0, index[:m])
    top_logp, top_tokens = logp_rows.top(index[m:], k)
    local, top_logp, top_tokens = fetch(local, top_logp, top_tokens)
    with host_only():
        return StrongLookup(local.tolist(), top_logp.tolist(), top_tokens.tolist())


def needed_nodes(
    parents: list[int], scores: list[float], rows: list[int], window: list[int], pool: int
) -> list[int]:  # all [num_nodes] but window: the window's nodes, ascending
    """Nodes a strong call forwards, in forward order: every unforwarded node with children (they need rescoring),
    ascending, so each comes after its ancestors and a committed path's cache rows ascend; then the best ``pool``
    window nodes without a row and without children, best first (the root's row comes with the pending committed
    tokens). A run forwards its positions in the same order (``run_strong_layers``, ``OpenLayout``)."""
    with_children = {p for p in parents[1:] if p > 0 and rows[p] < 0}
    best = best_nodes(scores, [i for i in window if i > 0 and rows[i] < 0], pool)
    return sorted(with_children) + [i for i in best if i not in with_children]


def best_nodes(scores: list[float], allowed: list[int], k: int) -> list[int]:
    """``top_nodes`` on host lists: up to ``k`` of ``allowed`` (ascending), best score first, ties to the lower index."""
    return sorted(allowed, key=scores.__getitem__, reverse=True)[:k]  # a reversed sort is stable too


def rescored(scores: list[float], parents: list[int], local: list[float]) -> list[float]:  # [num_nodes]
    """Every node's cumulative strong log-prob along its root path, summed in float32 parents first (the root's
    score stays): the values a float32 pass per depth gives."""
    scores = list(scores)
    for i in range(1, len(scores)):
        scores[i] = float32(scores[parents[i]] + local[i - 1])
    return scores


def reselect(scores: list[float], candidates: list[int], k: int) -> list[int]:
    """The ``k`` best candidates by score, best first, as a stable descending sort of every node's score (-inf
    off the candidates) picks them: candidates scored -inf compete with the other nodes by index."""
    order = [i for i in best_nodes(scores, candidates, k) if scores[i] > float("-inf")]
    if len(order) == k:
        return order
    finite = set(order)
    chosen = set(candidates)
    rest = (i for i in range(len(scores)) if i not in finite)
    return order + [i for i in itertools.islice(rest, k - len(order)) if i in chosen]
