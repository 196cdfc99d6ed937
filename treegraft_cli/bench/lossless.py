"""Is a method's greedy output the target's own greedy output?

In fp32 it must be identical to ``ar``. In bf16/fp16 a many-token verification forward rounds
differently from a one-token forward, so a correct method can part from ``ar`` where the target's best
tokens are nearly tied. At the first divergence of a turn we run the target once over the prompt plus
the common prefix and measure, for each of the two diverging tokens, its *distance* from the target's
best logit there (``max logit − logit(token)``, 0 for the best token itself). The divergence is a *tie*
(reported, still lossless) when both distances are at most the tie tolerance: any token within rounding
reach of the maximum could have been the argmax under the other rounding, however many tokens share the
near-tie (three digits after "is" are a common case); ``near_best`` says how many tokens that is. Anything else is a *mismatch* (not lossless).
Later turns of a conversation whose earlier turn diverged see different histories and are not compared
(status ``after-divergence``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Largest distance from the best logit (in logits) still called a tie, per dtype. fp32: none, outputs must match.
# bf16 keeps 8 mantissa bits: at |logit| in [16, 32) one step is 0.125, so 0.5 is four rounding steps.
TIE_TOLERANCE = {"fp32": 0.0, "bf16": 0.5, "fp16": 0.125}

EXACT, TIE, MISMATCH, AFTER_DIVERGENCE, UNCHECKED = "exact", "tie", "mismatch", "after-divergence", "unchecked"


@dataclass(frozen=True)
class TurnCheck:
    """The verdict on one turn's output against the reference (``ar``)."""

    status: str  # exact | tie | mismatch | after-divergence | unchecked
    position: int | None = None  # index of the first differing new token
    gap: float | None = None  # target's top-1 minus top-2 logit there
    distances: tuple[float, float] | None = None  # (reference token, candidate token): max logit − its logit
    ranks: tuple[int, int] | None = None  # (reference token, candidate token): 1 = the target's best
    near_best: int | None = None  # vocabulary tokens within the tie tolerance of the best logit (3: a three-way tie)

    @property
    def lossless(self) -> bool:
        return self.status != MISMATCH


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first differing token, or None when the two are identical."""
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def judge_divergence(
    logits: torch.Tensor,  # [vocab] the target's logits at the divergence
    reference_token: int,
    candidate_token: int,
    tolerance: float,
    position: int | None = None,
) -> TurnCheck:
    """Tie iff both tokens lie within ``tolerance`` of the best logit (and the tolerance is positive)."""
    logits = logits.float()
    best = logits.max()
    distances = (float(best - logits[reference_token]), float(best - logits[candidate_token]))
    ranks = (int((logits > logits[reference_token]).sum()) + 1, int((logits > logits[candidate_token]).sum()) + 1)
    top_two = torch.topk(logits, 2).values if logits.numel() > 1 else logits.repeat(2)
    gap = float(top_two[0] - top_two[1])
    tied = tolerance > 0 and max(distances) <= tolerance
    near_best = int((logits >= best - tolerance).sum())
    return TurnCheck(TIE if tied else MISMATCH, position, gap, distances, ranks, near_best)


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
    logits = target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]  # [vocab]
    return judge_divergence(logits, int(reference[position]), int(candidate[position]), tolerance, position)
