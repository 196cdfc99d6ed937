"""Drafters: things that propose tokens for the draft tree."""

from __future__ import annotations

from ..lm import CausalLM
from ..models.eagle3_head import Eagle3Head
from .eagle3 import Eagle3Drafter
from .model import ModelDrafter
from .strong import TreeDrafter
from .strong_eagle3 import Eagle3TreeDrafter

StrongDrafter = TreeDrafter | Eagle3TreeDrafter  # what TreeGraft's layer loop calls: start_step, forward, commit


def make_model_drafter(drafter: CausalLM, target: CausalLM) -> ModelDrafter:
    """The drafter for a pair's drafter model: an EAGLE-3 head reads the target's states, a small LM does not.

    Every method that drafts with a model builds its drafter here, so none of them branches on the kind.
    """
    if isinstance(drafter.model, Eagle3Head):
        return Eagle3Drafter(drafter, target)
    return ModelDrafter(drafter)


def make_strong_drafter(drafter: CausalLM, target: CausalLM) -> StrongDrafter:
    """TreeGraft's strong drafter for a pair's drafter model, the same choice as ``make_model_drafter``."""
    if isinstance(drafter.model, Eagle3Head):
        return Eagle3TreeDrafter(drafter, target)
    return TreeDrafter(drafter)


__all__ = [
    "Eagle3Drafter",
    "Eagle3TreeDrafter",
    "ModelDrafter",
    "StrongDrafter",
    "TreeDrafter",
    "make_model_drafter",
    "make_strong_drafter",
]
