"""Model names, offline fetching and loading."""

from .load import LoadedModel, load_model, load_pair
from .registry import ALIASES, parse_pair, resolve

__all__ = ["ALIASES", "LoadedModel", "load_model", "load_pair", "parse_pair", "resolve"]
