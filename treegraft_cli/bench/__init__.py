"""Bench: methods and transformers peers side by side on benchmark suites (no printing here)."""

from .answers import write_outputs, write_partial
from .contenders import PEERS, PairShape, contender_names
from .regression import Regression, check_against, load_baseline
from .results import SCHEMA, build_results, summary
from .runner import BASELINE, Bench, BenchPlan, check_plan, default_methods, plan_configs, run_bench
from .suites import BENCHMARKS, data_dir, suite_questions

__all__ = [
    "BASELINE", "BENCHMARKS", "PEERS", "SCHEMA", "Bench", "BenchPlan", "PairShape", "Regression", "build_results",
    "check_against", "check_plan", "contender_names", "data_dir", "default_methods", "load_baseline",
    "plan_configs", "run_bench", "suite_questions", "summary", "write_outputs", "write_partial",
]
