"""Random trees and well-separated sampling cases for the kernel tests.

Trees have distinct siblings (the verification contract). Sampling cases keep every float comparison
away from its boundary by construction, so kernel and reference must agree exactly on integer outputs:
uniforms sit mid-interval of the chosen token's CDF step, and every row permutes one shared logit vector
so a single top-p can sit midway between two cumulative masses of all rows at once.
"""

from __future__ import annotations

import torch

from treegraft_cli.drafters.adjacency import AdjacencyTable
from treegraft_cli.tree import ORIGIN_MODEL, DraftTree
from treegraft_cli.verify import process_logits


def random_parents(generator: torch.Generator, batch: int, n: int) -> torch.Tensor:
    """[batch, n] parents-before-children trees, node 0 the root."""
    parents = torch.full((batch, n), -1, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = (torch.rand(batch, generator=generator) * i).long()
    return parents


def tokens_against(generator: torch.Generator, parents: torch.Tensor, choices: torch.Tensor, vocab: int) -> torch.Tensor:
    """Tokens with distinct siblings; each parent has one child matching its choice about half the time."""
    batch, n = parents.shape
    tokens = torch.randint(0, vocab, (batch, n), generator=generator)
    for b in range(batch):
        children: dict[int, list[int]] = {}
        for i in range(1, n):
            children.setdefault(int(parents[b, i]), []).append(i)
        for parent, kids in children.items():
            # consecutive tokens ending or starting at the choice: distinct, one matches when hit < len(kids)
            hit = int(torch.randint(0, 2 * len(kids), (1,), generator=generator))
            for rank, kid in enumerate(kids):
                tokens[b, kid] = (int(choices[b, parent]) + rank - hit) % vocab
    return tokens


def permuted_logits(generator: torch.Generator, batch: int, n: int, vocab: int, scale: float) -> torch.Tensor:
    """[batch, n, vocab]: every row a permutation of one random vector (distinct values)."""
    shared = torch.randn(vocab, generator=generator) * scale
    order = torch.rand(batch * n, vocab, generator=generator).argsort(dim=-1)
    return shared[order].reshape(batch, n, vocab)


def separated_top_p(logits_row: torch.Tensor, temperature: float, top_k: int, fraction: float) -> float:
    """A top-p midway between two consecutive cumulative masses (after top-k), near ``fraction``."""
    probs = process_logits(logits_row.double(), temperature, top_k).sort(descending=True).values
    cumulative = probs.cumsum(0)
    steps = torch.nonzero(probs > 1e-3).flatten()
    j = int(steps[min(int(fraction * steps.numel()), steps.numel() - 1)])
    low = float(cumulative[j - 1]) if j > 0 else 0.0
    return min((low + float(cumulative[j])) / 2, 0.999)


def midpoint_uniforms(generator: torch.Generator, probs: torch.Tensor) -> torch.Tensor:
    """[...]: a uniform per row at the middle of a random token's CDF step (tokens of mass > 1e-4)."""
    probs = probs.double()
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    draw = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.double)[..., None] * total
    token = torch.searchsorted(cdf, draw, right=True).clamp(max=probs.shape[-1] - 1)
    # land on a token with real mass: a vanishing step has no middle far from its edges
    heavy = torch.gather(probs, -1, token) > 1e-4 * total
    token = torch.where(heavy, token, probs.argmax(-1, keepdim=True))
    upper = torch.gather(cdf, -1, token)
    lower = upper - torch.gather(probs, -1, token)
    return ((lower + upper) / 2 / total).squeeze(-1).float()


def random_graft_case(generator: torch.Generator, vocab: int, k: int, layers: int, written: int):
    """A drafted tree (random parents and tokens), and an adjacency table with ``written``
    random rows written (at least one; all rows when ``written`` >= vocab): the inputs of a graft."""
    tree = DraftTree.from_root(int(torch.randint(0, vocab, (1,), generator=generator)))
    for _ in range(layers):
        m = int(torch.randint(1, 9, (1,), generator=generator))
        parents = torch.randint(0, tree.num_nodes, (m,), generator=generator)
        tokens = torch.randint(0, vocab, (m,), generator=generator)
        tree.add_children(parents, tokens, tree.scores[parents] - torch.rand(m, generator=generator), ORIGIN_MODEL)
    table = AdjacencyTable(min(k, vocab))
    rows = torch.arange(vocab) if written >= vocab else torch.randint(0, vocab, (max(written, 1),), generator=generator)
    table.write(rows, torch.randn(rows.numel(), vocab, generator=generator))
    return tree, table
