"""Bench: methods and transformers peers side by side on benchmark suites (no printing here)."""

from .contenders import PEERS, contender_names
from .regression import Regression, check_against, load_baseline
from .results import SCHEMA, atomic_write_text, build_results, summary, write_outputs
from .runner import BASELINE, default_methods, plan_configs, run_bench
from .suites import BENCHMARKS, data_dir, suite_questions

__all__ = [
    "BASELINE", "BENCHMARKS", "PEERS", "SCHEMA", "Regression", "atomic_write_text", "build_results",
    "check_against", "contender_names", "data_dir", "default_methods", "load_baseline", "plan_configs",
    "run_bench", "suite_questions", "summary", "write_outputs",
]
