"""Kernel backends: where tree buffers, acceptance, KV commit and a graft's candidates run.

The backend is chosen once when the engine is built (and by the methods that graft). ``torch`` runs the reference implementations in
``verify.py``, ``lm.gather_rows`` and ``drafters.adjacency.graft_candidates``; ``triton`` runs the kernels in ``treegraft_cli.kernels`` behind the
same calls, so the engine never knows which one it has. ``buffers`` (ancestor mask and depths, which a
``DraftTree`` keeps) spare the torch reference rebuilding them; the Triton walk does not need them.
"""

from __future__ import annotations

import importlib

import torch

from . import verify
from .drafters import adjacency
from .errors import ConfigError
from .kernels import triton_status
from .lm import CausalLM


class VerifyBackend:
    """The torch reference backend; subclasses swap in kernels with identical signatures."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def tree_buffers(self, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, nodes]
        return verify.tree_buffers(parents)

    def greedy_choices(self, logits: torch.Tensor) -> torch.Tensor:  # [batch, nodes, vocab] -> [batch, nodes]
        return verify.argmax_choices(logits)

    def verify_greedy(self, logits, tokens, parents, buffers=None) -> verify.Verdict:
        return verify.verify_greedy(logits, tokens, parents, buffers)

    def verify_sampling(self, logits, tokens, parents, uniforms, temperature, top_k, top_p, buffers=None) -> verify.Verdict:
        return verify.verify_sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p, buffers)

    def commit(self, lm: CausalLM, keep_positions: torch.Tensor, start: int) -> None:  # [m]
        lm.commit(keep_positions, start)

    # an ``AdjacencyTable``'s graft: its candidates, then (the count read) the nodes it appends
    graft_candidates: adjacency.GraftCandidates = staticmethod(adjacency.graft_candidates)
    appended_nodes: adjacency.AppendedNodes = staticmethod(adjacency.appended_nodes)


class TritonBackend(VerifyBackend):
    """The Triton kernels. Importable without triton; building one where it cannot run is a ConfigError."""

    name = "triton"

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        usable, why, fix = triton_status(self.device)
        if not usable:
            raise ConfigError(f"--kernels triton: {why}", fix)
        # imported here, not at module load: the kernel modules need triton (and TRITON_INTERPRET set first)
        load = importlib.import_module
        self._tree_buffers = load("treegraft_cli.kernels.tree_buffers").tree_buffers
        greedy = load("treegraft_cli.kernels.greedy")
        self._greedy, self._argmax = greedy.verify_greedy, greedy.argmax_choices
        self._sampling = load("treegraft_cli.kernels.sampling").verify_sampling
        self._gather_rows = load("treegraft_cli.kernels.kv_commit").gather_rows
        # one launch each instead of a few per template depth, and a sort and gathers: on a GPU their host time
        # outweighs the work
        graft = load("treegraft_cli.kernels.graft_candidates")
        self.graft_candidates, self.appended_nodes = graft.graft_candidates, graft.appended_nodes

    def tree_buffers(self, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, nodes]
        return self._tree_buffers(parents)

    def greedy_choices(self, logits: torch.Tensor) -> torch.Tensor:  # [batch, nodes, vocab] -> [batch, nodes]
        return self._argmax(logits)

    def verify_greedy(self, logits, tokens, parents, buffers=None) -> verify.Verdict:
        # the walk kernel climbs parents itself: it needs no ancestor mask
        return self._greedy(logits, tokens, parents)

    def verify_sampling(self, logits, tokens, parents, uniforms, temperature, top_k, top_p, buffers=None) -> verify.Verdict:
        if filters_vocabulary(logits.shape[-1], top_k, top_p):
            # the kernel finds a top-k or top-p cut by bisection, 33-65 passes over the vocabulary per row: on an
            # H200 at 16-128 nodes of a 152k vocabulary that ran at 0.4-0.9x the speed of the reference's one sort
            # (top-p alone at 128 nodes: 1.7x; benchmarks/verify_kernels.py), while plain temperature sampling ran 4-7x
            # faster
            return super().verify_sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p, buffers)
        return self._sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p)

    def commit(self, lm: CausalLM, keep_positions: torch.Tensor, start: int) -> None:  # [m]
        lm.commit(keep_positions, start, gather=self._gather_rows)


def filters_vocabulary(vocab: int, top_k: int, top_p: float) -> bool:
    """Whether sampling keeps only part of the vocabulary (top-k or top-p on)."""
    return 0 < top_k < vocab or top_p < 1.0


BACKENDS: dict[str, type[VerifyBackend]] = {"torch": VerifyBackend, "triton": TritonBackend}


def select_backend(kernels: str, device: torch.device | str) -> VerifyBackend:
    """``auto`` takes Triton on CUDA when triton is installed, the torch reference elsewhere."""
    device = torch.device(device)
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" and triton_status(device)[0] else "torch"
    if kernels not in BACKENDS:
        raise ConfigError(f"kernel backend {kernels!r} is not available here", "use --kernels auto, torch or triton")
    return BACKENDS[kernels](device)
