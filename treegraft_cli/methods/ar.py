"""``ar``: plain autoregressive decoding of the target, the baseline every speedup is measured against."""

from __future__ import annotations

import torch

from ..config import DecodeConfig
from ..tree import DraftTree, RootTrees
from .base import Method, Models, register


@register
class AutoregressiveMethod(Method):
    """No draft: each step verifies the root alone and commits the bonus token."""

    name = "ar"
    description = "plain target decoding (baseline)"

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        self.roots = RootTrees()

    def draft(self, committed: torch.Tensor) -> DraftTree:
        return self.roots.tree(committed[-1:], self.models.target.device, capacity=1)
