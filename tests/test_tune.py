"""tune on the tiny-random pair: 3 trials on SQLite across two runs (resume), a profile that loads, spaces that load."""

from __future__ import annotations

import json

import optuna
import pytest
from typer.testing import CliRunner

from treegraft_cli.cli import app
from treegraft_cli.config import DecodeConfig
from treegraft_cli.errors import ConfigError
from treegraft_cli.methods import METHODS
from treegraft_cli.profiles import load_profile
from treegraft_cli.tune import apply, load_space, space_names

PAIR = "tiny-random@layers=2:tiny-random"


def test_tune_runs_resumes_and_exports_a_profile(tmp_path):
    prompts = tmp_path / "tune.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["Count to three."]}) + "\n")
    out = tmp_path / "best.yaml"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["tune", "--pair", PAIR, "--method", "dense", "--prompts", str(prompts), "-n", "4", "--dtype", "fp32",
            "--storage", storage, "--study", "s", "--out", str(out)]
    first = CliRunner().invoke(app, args + ["--trials", "2"])
    assert first.exit_code == 0, first.output
    second = CliRunner().invoke(app, args + ["--trials", "1"])
    assert second.exit_code == 0, second.output
    study = optuna.load_study(study_name="s", storage=storage)
    assert len(study.trials) == 3
    assert study.trials[0].params == load_space("dense").defaults  # the reference settings go first, once
    assert study.trials[2].params != study.trials[1].params  # the resumed run does not replay the first run's draws
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["trials"] == 3 and summary["profile"] == str(out)
    profile = load_profile(str(out))
    assert profile.pair == PAIR and profile.tuned["study"] == "s"
    best = study.trials[summary["best_trial"]].params
    assert profile.decode.tree.budget == best["tree.budget"] and profile.decode.tree.depth == best["tree.depth"]
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("method", ["dense", "graft", "treegraft"])
def test_every_space_loads_and_its_defaults_build_a_config(method):
    assert method in space_names()
    space = load_space(method)
    config = apply(DecodeConfig(), space.method, space.resolve(space.defaults))
    assert config.method == method
    METHODS[method].parse_options(config.method_options)  # the space's keys are the method's own options
    if method == "graft":
        assert config.method_options["draft_nodes"] == [8, 24, 40]
        assert config.method_options["base_template"] == [8, 10, 8, 6, 5, 4, 4, 4, 3]


def test_export_only_needs_an_existing_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'none.db'}"
    result = CliRunner().invoke(app, ["tune", "--pair", PAIR, "--storage", storage, "--study", "nope", "--trials", "0",
                                      "--out", str(tmp_path / "x.yaml")])
    assert isinstance(result.exception, ConfigError) and "no study 'nope'" in str(result.exception)
    assert not (tmp_path / "x.yaml").exists()
    assert optuna.get_all_study_names(storage) == []  # exporting created nothing


def test_malformed_space_names_the_field(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("params:\n  tree.budget: {type: int, low: 9, high: 2}\n")
    with pytest.raises(ConfigError, match="params.tree.budget"):
        load_space("x", bad)
    with pytest.raises(ConfigError, match="spaces exist for"):
        load_space("nosuch")
