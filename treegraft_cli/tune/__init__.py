"""Tune: an Optuna study over a method's search space; exports the best configuration as a profile."""

from .space import SearchSpace, apply, load_space, space_names
from .study import TuneSettings, best_trial, completed, export_profile, run_tune

__all__ = ["SearchSpace", "TuneSettings", "apply", "best_trial", "completed", "export_profile", "load_space",
           "run_tune", "space_names"]
