"""Warm-up cost measurement, used when no profile or explicit costs are given.

Times target forwards of trees from the root alone to a full tree (N + 1 tokens: the verification curve),
a strong drafter forward of a typical call (2·K tokens) and one of ``CATCH_UP_TOKENS`` (what a token adds when the
drafter catches up on a prompt) after a short context, each on a scratch KV cache so no decoding state is touched.
The median of a few repeats after one untimed run.

An EAGLE-3 head is timed the same way (``timing_lm``): one head forward of 2·K tokens, zero features in
place of the target's states (the cost does not depend on their values). A strong call of the head may
take one such forward per tree depth it spans (``drafters.strong_eagle3``); the cost model counts one.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ..lm import CausalLM, additive_mask, inference
from ..models.eagle3_head import Eagle3Head
from .policies import CostModel, token_ms
from .values import MAX_LAG

COST_CONTEXT = 64  # prompt tokens before the timed forwards of the warm-up measurement
CATCH_UP_TOKENS = MAX_LAG  # the wide strong forward's tokens: a catch-up forwards more than MAX_LAG at once


class HeadTimingLM(CausalLM):
    """An EAGLE-3 head driven like a causal LM, for timing only: zero features stand in for the target's."""

    @inference
    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        position_ids: torch.Tensor | None = None,  # [n]; default: continue after the cache
        visible: torch.Tensor | None = None,  # [n, cache_length + n] bool; default: causal
        logits_to_keep: int = 0,  # the head returns every row; kept for CausalLM's signature
    ) -> torch.Tensor:
        n, start = input_ids.shape[0], self.cache_length
        if position_ids is None:
            position_ids = torch.arange(start, start + n, device=self.device)
        if visible is None:
            visible = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(diagonal=start)
        features = torch.zeros(n, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        logits, _ = self.model(input_ids, features, position_ids, additive_mask(visible, self.dtype), self.cache)
        self.forward_calls += 1
        return logits


def timing_lm(model: nn.Module) -> CausalLM:
    """A scratch ``CausalLM`` over ``model`` (a causal LM or an EAGLE-3 head) for timed forwards."""
    return HeadTimingLM(model) if isinstance(model, Eagle3Head) else CausalLM(model)


def forward_ms(model: nn.Module, context: torch.Tensor, tokens: int, repeats: int = 3) -> float:
    """Median milliseconds of one ``tokens``-wide masked forward after ``context`` ([c] token ids)."""
    lm = timing_lm(model)
    lm.forward(context.to(lm.device), logits_to_keep=1)
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
    target: nn.Module,
    drafter: nn.Module | None,  # a causal LM or an EAGLE-3 head
    context: torch.Tensor,  # [c] e.g. the prompt's tail
    budget: int,
    width: int,
) -> CostModel:
    """One strong call, the strong drafter's ms per caught-up token, and the target's verification curve: the root
    alone, trees of 2, 4, 8, … tokens below a full tree, and a full tree (N + 1 tokens)."""
    curve = tuple((tokens, forward_ms(target, context, tokens)) for tokens in curve_tokens(budget))
    strong_ms = forward_ms(drafter, context, 2 * width) if drafter is not None else 0.0
    catch_up = 0.0
    if drafter is not None and CATCH_UP_TOKENS > 2 * width:
        catch_up = token_ms((2 * width, strong_ms), (CATCH_UP_TOKENS, forward_ms(drafter, context, CATCH_UP_TOKENS)))
    return CostModel(verify_ms=curve[-1][1], strong_ms=strong_ms, verify_root_ms=curve[0][1], verify_curve=curve,
                     strong_token_ms=catch_up)


def curve_tokens(budget: int) -> tuple[int, ...]:
    """Tree sizes (root included) the verification curve is measured at: 1, the powers of two below N + 1, N + 1."""
    sizes, tokens = [1], 2
    while tokens < budget + 1:
        sizes.append(tokens)
        tokens *= 2
    return (*sizes, budget + 1) if budget >= 1 else (1,)
