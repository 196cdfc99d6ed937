"""``ar``: plain autoregressive decoding of the target, the baseline every speedup is measured against."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from .base import Method, register


@register
class AutoregressiveMethod(Method):
    """No draft: each step verifies the root alone and commits the bonus token."""

    name = "ar"
    description = "plain target decoding (baseline)"

    def draft(self, committed: torch.Tensor) -> DraftTree:
        return DraftTree.from_root(committed[-1:], self.models.target.device, capacity=1)
