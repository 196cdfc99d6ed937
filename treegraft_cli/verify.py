"""Tree verification, torch reference implementations.

Shapes carry a batch dimension (``[batch, nodes]``, ``[batch, nodes, vocab]``) even though the engine
runs batch 1; the Triton kernels in ``treegraft_cli.kernels`` have the same signatures. ``accept_on_host`` is
the same walk over one tree's host lists, and ``StepVerdict`` what the engine reads of one step's verdict.

Acceptance (DESIGN.md §3). Every node i gets the target's *choice* ``c_i`` for the token after it: the
argmax at T=0, or a sample from the processed target distribution at T>0, drawn by inverse CDF from the
uniform ``u_i`` passed in. A child is accepted iff its token equals its parent's choice and its parent
was accepted; the bonus token is the choice at the deepest accepted node.

Why this is exact at T>0 for deterministic drafts (distinct siblings, drafter probability 1 on the
proposed token): the classic multi-candidate rule accepts sibling x_j with probability
``p(x_j) / (1 - sum_{l<j} p(x_l))`` and, if all fail, samples the bonus from p with the siblings zeroed.
Unrolled, child x_j is taken with probability exactly p(x_j) and the bonus is a draw from p conditioned on
missing every child: the same law as one draw y ~ p that is followed into the tree when it hits a child
and becomes the bonus otherwise. Each node uses its own uniform and only nodes on the walked path
matter, so every committed token is an independent draw from the target. Drafter scores never enter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """What the target decided about one batch of trees."""

    path: torch.Tensor  # [batch, nodes] node indices root→deepest accepted, -1 padded; path[:, 0] == 0
    num_accepted: torch.Tensor  # [batch] accepted non-root nodes; accepted length τ = num_accepted + 1
    bonus: torch.Tensor  # [batch] token id the target chose after the deepest accepted node


def tree_buffers(
    parents: torch.Tensor,  # [batch, nodes] int64, -1 for the root (node 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor mask ``[batch, nodes, nodes]`` (bool, i sees j iff j is i or its ancestor) and depths ``[batch, nodes]``.

    Position ids of the verification forward are ``prefix_length + depths``.
    """
    batch, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n)
    parent_of = torch.zeros(batch, n, n, dtype=torch.bool, device=parents.device)
    parent_of.scatter_(2, parents.clamp(min=0)[..., None], (parents >= 0)[..., None])
    reach = (eye | parent_of).float()
    # pointer doubling: after k squarings a row reaches 2**k generations up
    for _ in range(max(1, (n - 1).bit_length())):
        reach = (torch.bmm(reach, reach) > 0).float()
    mask = reach > 0
    depths = mask.sum(dim=-1) - 1
    return mask, depths


def accept_choices(
    tokens: torch.Tensor,  # [batch, nodes]
    parents: torch.Tensor,  # [batch, nodes]
    depths: torch.Tensor,  # [batch, nodes]
    ancestor_mask: torch.Tensor,  # [batch, nodes, nodes] bool
    choices: torch.Tensor,  # [batch, nodes] the target's token after each node
) -> Verdict:
    """Walk the tree along the target's choices; see the module docstring.

    ``depths`` is not needed: the accepted nodes form one chain from the root, and nodes are stored
    parents first, so ordering them by index orders them by depth.
    """
    n = tokens.shape[-1]
    matches = tokens == torch.gather(choices, 1, parents.clamp(min=0))
    matches[:, 0] = True  # the root is committed
    # a node is accepted iff every node on its root path matches: each ancestor-mask entry implies a match
    accepted = (ancestor_mask <= matches[:, None, :]).all(dim=-1)  # [batch, nodes]
    node_ids = torch.arange(n, device=tokens.device)
    # the accepted chain by index (= by depth), then n for every other node, which becomes -1
    path = torch.sort(torch.where(accepted, node_ids, n), dim=-1).values
    path = path.masked_fill(path == n, -1)
    num_accepted = accepted.sum(dim=-1) - 1
    deepest = path.amax(dim=-1, keepdim=True)  # [batch, 1] the accepted chain's last node
    bonus = torch.gather(choices, 1, deepest).squeeze(1)
    return Verdict(path=path, num_accepted=num_accepted, bonus=bonus)


def accept_on_host(
    choices: list[int],  # [nodes] the target's token after each node
    tokens: list[int],  # [nodes]
    parents: list[int],  # [nodes] -1 at the root
) -> tuple[list[int], int]:
    """``accept_choices`` for one tree on host lists: the accepted node indices root first, and the bonus token.

    Siblings carry distinct tokens, so each node has at most one child matching its choice: the walk follows it
    down from the root. A Python walk over a tree's few dozen nodes costs less than the dozen tensor calls of the
    device walk once the choices are read anyway (the engine reads them with the step's one synchronisation).
    """
    child = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    path = [0]
    while (node := child.get((path[-1], choices[path[-1]]))) is not None:
        path.append(node)
    return path, choices[path[-1]]


Buffers = tuple[torch.Tensor, torch.Tensor]  # ancestor mask [batch, nodes, nodes] bool, depths [batch, nodes]


def accept(
    tokens: torch.Tensor,  # [batch, nodes]
    parents: torch.Tensor,  # [batch, nodes]
    choices: torch.Tensor,  # [batch, nodes] the target's token after each node
    buffers: Buffers | None = None,
) -> Verdict:
    """``accept_choices`` with the tree buffers given (a ``DraftTree`` keeps them), else built from ``parents``."""
    ancestor_mask, depths = buffers if buffers is not None else tree_buffers(parents)
    return accept_choices(tokens, parents, depths, ancestor_mask, choices)


def argmax_choices(
    logits: torch.Tensor,  # [batch, nodes, vocab]
) -> torch.Tensor:  # [batch, nodes]
    """The greedy choice at every node: the first index of the largest logit."""
    # on a CPU an argmax over bf16 is ~5x slower than over float32 (exact: the same order)
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        logits = logits.float()
    return logits.argmax(dim=-1)


def verify_greedy(
    logits: torch.Tensor,  # [batch, nodes, vocab] target logits at every node
    tokens: torch.Tensor,  # [batch, nodes]
    parents: torch.Tensor,  # [batch, nodes]
    buffers: Buffers | None = None,
) -> Verdict:
    """Greedy acceptance: the target's choice at every node is its argmax."""
    return accept(tokens, parents, argmax_choices(logits), buffers)


def process_logits(
    logits: torch.Tensor,  # [..., vocab]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (in that order, as transformers does)."""
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample_from_probs(
    probs: torch.Tensor,  # [..., vocab]
    uniforms: torch.Tensor,  # [...] in [0, 1)
) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative mass exceeds ``u * total``."""
    cdf = probs.cumsum(dim=-1)
    threshold = (uniforms * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf.contiguous(), threshold.contiguous(), right=True).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)


def sample_choices(
    logits: torch.Tensor,  # [batch, nodes, vocab]
    uniforms: torch.Tensor,  # [batch, nodes] in [0, 1)
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [batch, nodes]
    """The sampled choice at every node: inverse CDF of the processed target distribution at ``u``."""
    return sample_from_probs(process_logits(logits, temperature, top_k, top_p), uniforms)


def verify_sampling(
    logits: torch.Tensor,  # [batch, nodes, vocab]
    tokens: torch.Tensor,  # [batch, nodes]
    parents: torch.Tensor,  # [batch, nodes]
    uniforms: torch.Tensor,  # [batch, nodes] one uniform in [0, 1) per node
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    buffers: Buffers | None = None,
) -> Verdict:
    """Exact tree rejection sampling for deterministic drafts (see the module docstring)."""
    return accept(tokens, parents, sample_choices(logits, uniforms, temperature, top_k, top_p), buffers)


class StepVerdict:
    """The target's verdict on one decoding step's tree, kept for the step's one read.

    Greedy (built on ``choices``): the target's choice at every node stays on the device, is read (with the tree's
    columns when the host does not hold them) and walked on the host (``accept_on_host``), a dozen tensor calls fewer
    than walking on the device.
    A method's ``readback`` that gathers rows along the path before the read finds them with ``path_rows``. Sampling
    (built on ``device_verdict``): the backend's verdict, whose draws only its own walk consumes.
    """

    def __init__(
        self,
        tree: DraftTree,  # on the logits' device
        choices: torch.Tensor | None = None,  # [nodes] greedy
        device_verdict: Verdict | None = None,  # batch 1
        host_tree: DraftTree | None = None,
    ):
        """``host_tree``: the tree as a host-side builder drafted it (``tree`` itself, or what ``tree`` was uploaded
        from), when one did: its columns are known on the host, so the read carries the verdict's part alone."""
        self.tree = tree
        self.choices = choices
        self.device_verdict = device_verdict
        self.host_tree = host_tree

    def path_rows(self, depth: int) -> torch.Tensor:  # [depth + 1] on the device
        """The root and the accepted node at each depth up to ``depth`` (the tree's deepest), the root (0) past the
        deepest accepted one: the rows a method gathers along the path before the read.

        Greedy, without the walk: a node is accepted when every node on its root path matches its parent's choice
        (the ancestor mask), and each depth holds at most one accepted node, so one ``index_add_`` of the accepted
        node indices by depth places them (a few tensor calls fewer than ``accept`` and its padding)."""
        if self.device_verdict is not None:
            return self.device_verdict.path[0, : depth + 1].clamp(min=0)
        tree = self.tree
        if depth == 0:  # the root alone
            return torch.zeros(1, dtype=torch.long, device=tree.device)
        matches = tree.tokens == self.choices.index_select(0, tree.parents.clamp(min=0))
        matches[0].fill_(True)  # the root is committed
        accepted = (tree.ancestor_mask() <= matches).all(dim=1)  # [nodes]
        nodes = torch.arange(tree.num_nodes, device=tree.device).mul_(accepted)  # accepted node indices, 0 elsewhere
        return torch.zeros(depth + 1, dtype=torch.long, device=tree.device).index_add_(0, tree.depths, nodes)

    def committed_block(
        self, path: torch.Tensor  # [depth + 1] ``path_rows(depth)``, depth the tree's deepest
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [depth + 1], [1] on the device
        """The tokens this step commits, before the read: the accepted nodes' tokens and the bonus, then anything up to
        ``depth`` + 1 tokens; and how many nodes were accepted (the bonus's index). What a drafter forwards ahead of
        the read (``TreeDrafter.forward_ahead``), which keeps nothing past the bonus.

        Greedy, each accepted node's token is its parent's choice and the bonus the deepest one's: the choices along
        the path."""
        accepted = (path > 0).sum(0, keepdim=True)  # [1] (the root, first, is node 0)
        if self.choices is not None:
            return self.choices.index_select(0, path), accepted
        tokens = self.tree.tokens.index_select(0, path.roll(-1))  # [depth + 1] the accepted tokens, then the root's
        return tokens.index_copy_(0, accepted, self.device_verdict.bonus[:1]), accepted

    def packed(self) -> torch.Tensor:  # greedy [nodes] (+ 4 · nodes), sampling [2 + nodes] (+ 3 · nodes)
        """What the step reads, one tensor: the verdict's part, then the tree's tokens, (greedy) parents, depths and
        origins (for the walk and the acceptance statistics) unless the host knows them (``host_tree``)."""
        tree = self.tree
        if self.choices is not None:
            if self.host_tree is not None:
                return self.choices
            return torch.cat([self.choices, tree.tokens, tree.parents, tree.depths, tree.origins])
        verdict = self.device_verdict
        part = [verdict.num_accepted, verdict.bonus, verdict.path[0]]
        return torch.cat(part if self.host_tree is not None else [*part, tree.tokens, tree.depths, tree.origins])

    def unpack(self, values: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """From the read ``packed``: the accepted node indices root first, the new tokens (the accepted ones, then the
        bonus), and the depths and origins of the non-root nodes."""
        n = self.tree.num_nodes
        host = self.host_columns()
        if self.choices is not None:
            choices = values[:n]
            tokens, parents, depths, origins = host or (
                values[n : 2 * n], values[2 * n : 3 * n], values[3 * n : 4 * n], values[4 * n :])
            accepted, _ = accept_on_host(choices, tokens, parents)
            # an accepted node's token is its parent's choice: the new tokens are the choices along the path
            return accepted, [choices[node] for node in accepted], depths[1:], origins[1:]
        num_accepted, bonus = values[0], values[1]
        accepted = values[2 : num_accepted + 3]
        tokens, _, depths, origins = host or (
            values[n + 2 : 2 * n + 2], None, values[2 * n + 2 : 3 * n + 2], values[3 * n + 2 :])
        new_tokens = [tokens[node] for node in accepted[1:]] + [bonus]
        return accepted, new_tokens, depths[1:], origins[1:]

    def host_columns(self) -> tuple[list[int], list[int], list[int], list[int]] | None:
        """The host tree's tokens, parents, depths and origins as lists; None without a host tree."""
        tree = self.host_tree
        if tree is None:
            return None
        return tree.listed("tokens"), tree.listed("parents"), tree.listed("depths"), tree.host_list("origins")
