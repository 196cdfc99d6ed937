"""Triton kernels of verification and grafting, one module per kernel, each beside a launcher whose signature equals
its torch reference (Liger-Kernel layout):

| module | launcher | torch reference |
|---|---|---|
| ``tree_buffers`` | ``tree_buffers(parents)`` | ``verify.tree_buffers`` |
| ``walk`` | ``accept(tokens, parents, choices)`` | ``verify.accept`` |
| ``greedy`` | ``argmax_choices(logits)``, ``verify_greedy(logits, tokens, parents)`` | ``verify.argmax_choices``, ``verify.verify_greedy`` |
| ``sampling`` | ``sample_choices(...)``, ``verify_sampling(...)`` | ``verify.sample_choices``, ``verify.verify_sampling`` |
| ``kv_commit`` | ``gather_rows(tensors, keep_positions, start)`` | ``lm.gather_rows`` |
| ``graft_candidates`` | ``graft_candidates(successors, tree_tokens, tree_parents, tree_scores, template, slots, tree_depth)`` | ``drafters.adjacency.graft_candidates`` |

This package imports without triton; the kernel modules themselves need it, so import them only after
``triton_status()`` says they can run. ``cross_compile`` compiles them for GPU architectures this machine
may not have (no launch). Triton runs on CUDA tensors, or on CPU tensors when
``TRITON_INTERPRET=1`` was set before triton was first imported (how CI tests the kernels).
"""

from __future__ import annotations

import importlib.util
import os

import torch

INSTALL_HINT = "pip install triton (Linux), or use --kernels torch"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (slow; meant for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_status(device: torch.device) -> tuple[bool, str, str]:
    """(usable, why not, how to fix) for running the kernels on tensors of ``device``."""
    if not triton_installed():
        return False, "triton is not installed", INSTALL_HINT
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return True, "", ""
    return (
        False,
        f"the Triton kernels cannot run on {device.type} tensors",
        "use --kernels torch, or set TRITON_INTERPRET=1 before starting to run them interpreted (slow)",
    )
