"""Tune: an Optuna study over a method's search space; exports the configuration best on validation questions as a profile."""

from .space import SearchSpace, apply, load_space, space_names
from .storage import hide_password, open_storage, worker_id
from .study import (
    TuneSettings,
    completed,
    export_profile,
    open_study,
    run_tune,
    selected_trial,
    validation_speedups,
)
from .validation import validate_trials

__all__ = ["SearchSpace", "TuneSettings", "apply", "completed", "export_profile", "hide_password",
           "load_space", "open_storage", "open_study", "run_tune", "selected_trial", "space_names", "validate_trials", "validation_speedups", "worker_id"]
