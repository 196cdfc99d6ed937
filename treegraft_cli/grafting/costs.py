"""Warm-up cost measurement, used when no profile or explicit costs are given.

Times a target forward of a full tree (N + 1 tokens) and a strong drafter forward of a typical call
(2·K tokens) after a short context, each on a scratch KV cache so no decoding state is touched. The
median of a few repeats after one untimed run.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import PreTrainedModel

from ..lm import CausalLM
from .scheduler import CostModel


def forward_ms(model: PreTrainedModel, context: torch.Tensor, tokens: int, repeats: int = 3) -> float:
    """Median milliseconds of one ``tokens``-wide masked forward after ``context`` ([c] token ids)."""
    lm = CausalLM(model)
    lm.forward(context.to(lm.device))
    base = lm.cache_length
    inputs = context[-1:].to(lm.device).repeat(tokens)
    positions = torch.arange(base, base + tokens, device=lm.device)
    visible = torch.ones(tokens, base + tokens, dtype=torch.bool, device=lm.device)
    visible[:, base:] = torch.ones(tokens, tokens, dtype=torch.bool, device=lm.device).tril()
    times = []
    for _ in range(repeats + 1):
        lm.crop(base)
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        started = time.perf_counter()
        lm.forward(inputs, positions, visible)
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times[1:])


def measure_costs(
    target: PreTrainedModel,
    drafter: PreTrainedModel | None,
    context: torch.Tensor,  # [c] e.g. the prompt's tail
    budget: int,
    width: int,
) -> CostModel:
    verify_ms = forward_ms(target, context, budget + 1)
    strong_ms = forward_ms(drafter, context, 2 * width) if drafter is not None else 0.0
    return CostModel(verify_ms=verify_ms, strong_ms=strong_ms)
