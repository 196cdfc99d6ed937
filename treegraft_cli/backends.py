"""Verification backends: where tree buffers, acceptance and KV commit run.

The backend is chosen once when the engine is built. ``torch`` runs the reference implementations in
``verify.py`` and ``CausalLM.commit``; the Triton kernels plug in behind the same four calls.
"""

from __future__ import annotations

import torch

from . import verify
from .errors import ConfigError
from .lm import CausalLM


class VerifyBackend:
    """The torch reference backend; subclasses swap in kernels with identical signatures."""

    name = "torch"

    def tree_buffers(self, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, nodes]
        return verify.tree_buffers(parents)

    def verify_greedy(self, logits, tokens, parents) -> verify.Verdict:
        return verify.verify_greedy(logits, tokens, parents)

    def verify_sampling(self, logits, tokens, parents, uniforms, temperature, top_k, top_p) -> verify.Verdict:
        return verify.verify_sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p)

    def commit(self, lm: CausalLM, keep_positions: torch.Tensor, start: int) -> None:  # [m]
        lm.commit(keep_positions, start)


BACKENDS: dict[str, type[VerifyBackend]] = {"torch": VerifyBackend}


def select_backend(kernels: str, device: torch.device) -> VerifyBackend:
    """``auto`` takes Triton on CUDA when it is available, the torch reference elsewhere."""
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" and "triton" in BACKENDS else "torch"
    if kernels not in BACKENDS:
        raise ConfigError(f"kernel backend {kernels!r} is not available here", "use --kernels torch")
    return BACKENDS[kernels]()
