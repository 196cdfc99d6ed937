"""Decoding methods. Importing this package registers every built-in method."""

from . import ar, graft, model_drafting, treegraft  # noqa: F401  (registration side effect)
from .base import (
    METHODS,
    Method,
    Models,
    Observation,
    Prefill,
    bare_method_names,
    check_method,
    create_method,
    method_class,
    method_names,
)

__all__ = [
    "METHODS", "Method", "Models", "Observation", "Prefill", "bare_method_names", "check_method", "create_method",
    "method_class", "method_names",
]
