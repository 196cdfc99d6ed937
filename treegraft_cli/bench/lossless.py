"""Is a method's greedy output the target's own greedy output?

In fp32 it must be identical to ``ar``. In bf16/fp16 a many-token verification forward rounds
differently from a one-token forward, so a correct method can part from ``ar`` where the target's two
best tokens are nearly tied. At the first divergence of a turn we run the target once over the prompt
plus the common prefix and look at its top-2 logits there: when both diverging tokens are the top two
and their logit gap is under the tie tolerance, the divergence is a *tie* (reported, still lossless);
anything else is a *mismatch* (not lossless). Later turns of a conversation whose earlier turn diverged
see different histories and are not compared (status ``after-divergence``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Largest top-2 logit gap (in logits) still called a tie, per dtype. fp32: none, outputs must match.
# bf16 keeps 8 mantissa bits: at |logit| in [16, 32) one step is 0.125, so 0.5 is four rounding steps.
TIE_TOLERANCE = {"fp32": 0.0, "bf16": 0.5, "fp16": 0.125}

EXACT, TIE, MISMATCH, AFTER_DIVERGENCE, UNCHECKED = "exact", "tie", "mismatch", "after-divergence", "unchecked"


@dataclass(frozen=True)
class TurnCheck:
    """The verdict on one turn's output against the reference (``ar``)."""

    status: str  # exact | tie | mismatch | after-divergence | unchecked
    position: int | None = None  # index of the first differing new token
    gap: float | None = None  # target's top-1 minus top-2 logit there

    @property
    def lossless(self) -> bool:
        return self.status != MISMATCH


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first differing token, or None when the two are identical."""
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


@torch.no_grad()
def check_turn(
    target: torch.nn.Module,
    prompt_ids: torch.Tensor,  # [prompt_length]
    reference: Sequence[int],
    candidate: Sequence[int],
    tolerance: float,
) -> TurnCheck:
    position = first_divergence(reference, candidate)
    if position is None:
        return TurnCheck(EXACT)
    if position >= min(len(reference), len(candidate)):
        return TurnCheck(MISMATCH, position)  # one stopped (EOS or length) where the other went on
    prefix = torch.tensor(list(reference[:position]), dtype=torch.long)
    ids = torch.cat([prompt_ids.cpu(), prefix]).to(target.device)[None]  # [1, prompt_length + position]
    logits = target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()  # [vocab]
    top_values, top_tokens = torch.topk(logits, 2)
    gap = float(top_values[0] - top_values[1])
    pair = {int(reference[position]), int(candidate[position])}
    if pair <= set(top_tokens.tolist()) and gap <= tolerance and tolerance > 0:
        return TurnCheck(TIE, position, gap)
    return TurnCheck(MISMATCH, position, gap)
