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
from treegraft_cli.tune import apply, completed, load_space, selected_trial, space_names

PAIR = "tiny-random@layers=2:tiny-random"


def test_tune_runs_resumes_and_exports_a_profile(tmp_path):
    prompts = tmp_path / "tune.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["Count to three."]}) + "\n")
    out = tmp_path / "best.yaml"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["tune", "--pair", PAIR, "--method", "dense", "--prompts", str(prompts), "-n", "4", "--dtype", "fp32",
            "--storage", storage, "--study", "s", "--out", str(out), "--validation-prompts", "0"]
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
    assert profile.pair == PAIR and profile.tuned["study"] == "s" and profile.tuned["selected_by"] == "search"
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


def questions_file(path, count: int):
    path.write_text("".join(json.dumps({"question_id": i, "turns": [f"Count to {i + 3}."]}) + "\n" for i in range(count)))
    return path


def test_the_best_search_trials_are_validated_on_unseen_questions_and_the_best_there_exported(tmp_path):
    prompts = questions_file(tmp_path / "q.jsonl", 3)
    out = tmp_path / "best.yaml"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["tune", "--pair", PAIR, "--method", "dense", "--prompts", str(prompts), "-n", "4", "--dtype", "fp32",
            "--storage", storage, "--study", "v", "--out", str(out), "--trials", "3", "--num-prompts", "1",
            "--validation-prompts", "2", "--validate-top", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    study = optuna.load_study(study_name="v", storage=storage)
    record = study.user_attrs["validation"]
    assert record["questions"] == ["q/1", "q/2"] and record["max_new_tokens"] == 4  # the questions after the search's
    validated = {int(n): v for n, v in record["speedups"].items()}
    by_search = sorted(completed(study), key=lambda t: -t.values[0])
    assert set(validated) == {t.number for t in by_search[:2]} and all(v > 0 for v in validated.values())
    chosen = max(validated, key=validated.get)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["best_trial"] == chosen and summary["selected_by"] == "validation"
    assert summary["validation_speedup"] == pytest.approx(validated[chosen])
    profile = load_profile(str(out))
    assert profile.tuned["trial"] == chosen and profile.tuned["validation_speedup"] == pytest.approx(validated[chosen])
    assert profile.tuned["validation_questions"] == ["q/1", "q/2"]


def test_export_prefers_validation_over_search():
    study = optuna.create_study(direction="maximize")
    for value in (1.5, 1.4, 1.2):
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=value))
    assert selected_trial(study)[0].number == 0 and selected_trial(study)[1] is None  # nothing validated: search
    study.set_user_attr("validation", {"questions": ["q/1"], "max_new_tokens": 4, "speedups": {"0": 1.1, "1": 1.3}})
    best, speedup = selected_trial(study)
    assert (best.number, speedup) == (1, 1.3)  # search's winner was luckier on the search questions


def test_validation_needs_questions_after_the_search_ones(tmp_path):
    prompts = questions_file(tmp_path / "q.jsonl", 1)
    result = CliRunner().invoke(app, ["tune", "--pair", PAIR, "--prompts", str(prompts), "--trials", "1",
                                      "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "x.yaml")])
    assert isinstance(result.exception, ConfigError)
    assert "no validation questions" in str(result.exception) and "--validation-prompts 0" in str(result.exception)
