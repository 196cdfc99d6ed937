"""`treegraft tune` on a real PostgreSQL server: concurrent workers, a worker killed mid-trial, bad storage.

The server is started once per session (see postgres_server.py: Debian's ``postgresql`` package, a Unix
socket in a temp dir); each test gets its own database. Workers are separate ``treegraft tune``
processes on the tiny-random pair, as on many machines sharing one database.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from postgres_server import Server, unavailable
from processes import finish, start_cli
from test_cli_errors import assert_clean_failure, run_cli

from treegraft_cli.config import DecodeConfig
from treegraft_cli.pipeline import Pipeline
from treegraft_cli.profiles import load_profile
from treegraft_cli.tune import TuneSettings, load_space, open_study

pytestmark = pytest.mark.postgres

PAIR = "tiny-random@layers=2:tiny-random"
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
HEARTBEAT = 1  # seconds; a dead worker's trial is stale after 2 * HEARTBEAT


def require_driver() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable("psycopg is not installed (pip install 'treegraft[postgres]')")


@pytest.fixture(scope="session")
def postgres():
    require_driver()
    server = Server().start()
    yield server
    server.stop()


def prompts_file(directory: Path, count: int) -> Path:
    path = directory / "tune.jsonl"
    lines = [json.dumps({"question_id": i, "turns": [f"Count to {i + 3}."]}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def tune_args(url: str, study: str, prompts: Path, out: Path, trials: int, tokens: int = 16) -> list[str]:
    return ["tune", "--pair", PAIR, "--method", "dense", "--prompts", str(prompts), "--num-prompts", "9", "-n", str(tokens),
            "--dtype", "fp32", "--storage", url, "--study", study, "--out", str(out), "--trials", str(trials),
            "--heartbeat", str(HEARTBEAT), "--validation-prompts", "0"]


def test_two_workers_share_one_study(postgres, tmp_path, capsys, monkeypatch):
    url = postgres.url("two_workers")
    # Trials of seconds each, so both workers are inside the study together even when one of them
    # starts up (imports, model load, baseline) a second or two later than the other.
    prompts = prompts_file(tmp_path, 4)
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [start_cli(tune_args(url, "s", prompts, tmp_path / f"w{i}.yaml", 3, tokens=128), log) for i, log in enumerate(logs)]
    results = [finish(w, log) for w, log in zip(workers, logs, strict=True)]

    study = optuna.load_study(study_name="s", storage=url)
    assert sorted(t.number for t in study.trials) == list(range(6))  # every trial of both, none twice
    assert all(t.state in FINISHED for t in study.trials)
    ran = [set(r["ran"]) for r in results]
    assert len(ran[0]) == len(ran[1]) == 3 and not ran[0] & ran[1]
    for result, numbers in zip(results, ran, strict=True):
        assert {study.trials[n].user_attrs["worker"] for n in numbers} == {result["worker"]}
    spans = [(min(study.trials[n].datetime_start for n in s), max(study.trials[n].datetime_complete for n in s)) for s in ran]
    assert max(s for s, _ in spans) < min(e for _, e in spans), "the workers did not run at the same time"
    defaults = load_space("dense").defaults
    assert sum(t.params == defaults for t in study.trials) == 1  # enqueued once, by the worker that created the study

    out = tmp_path / "best.yaml"
    code, _, err = run_cli(tune_args(url, "s", prompts, out, 0), capsys, monkeypatch)  # --trials 0: export only
    assert code == 0, err
    best = max((t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE), key=lambda t: t.value)
    profile = load_profile(str(out))
    assert profile.tuned["trial"] == best.number and profile.tuned["trials"] == 6
    assert (profile.decode.tree.budget, profile.decode.tree.depth, profile.decode.tree.top_k) == (
        best.params["tree.budget"], best.params["tree.depth"], best.params["tree.top_k"])
    print(f"\nworkers: {[(r['worker'], r['ran']) for r in results]}; "
          f"trials: {[(t.number, t.state.name, t.user_attrs['worker'], t.value) for t in study.trials]}; "
          f"exported best trial {best.number} ({best.value:.3f}x)")


def wait_mid_trial(storage: optuna.storages.RDBStorage, study: str, worker: subprocess.Popen) -> int:
    """Trial 0 (never pruned: the pruner's startup trial) after its first question: the worker is inside it."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert worker.poll() is None, "the worker ended before it could be killed"
        try:
            trials = storage.get_all_trials(storage.get_study_id_from_name(study), deepcopy=False)
        except KeyError:  # not created yet
            trials = []
        running = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING and t.user_attrs.get("speedup_by_question")]
        if running:
            return running[0].number
        time.sleep(0.05)
    raise AssertionError("no trial reached its second question")


def test_killed_worker_leaves_no_trial_running(postgres, tmp_path):
    url = postgres.url("killed_worker")
    # Trials of seconds each, so both workers are inside the study together even when one of them
    # starts up (imports, model load, baseline) a second or two later than the other.
    prompts = prompts_file(tmp_path, 4)
    storage = optuna.storages.RDBStorage(url)
    worker = start_cli(tune_args(url, "k", prompts, tmp_path / "k.yaml", 20, tokens=32), tmp_path / "killed.log")
    killed = wait_mid_trial(storage, "k", worker)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    study = optuna.load_study(study_name="k", storage=url)
    record = study.trials[killed]
    assert record.state == optuna.trial.TrialState.RUNNING  # as the kill left it
    time.sleep(2 * HEARTBEAT + 1.5)  # past the grace period: the trial is stale

    rerun = finish(start_cli(tune_args(url, "k", prompts, tmp_path / "k.yaml", 2, tokens=32), tmp_path / "rerun.log"),
                   tmp_path / "rerun.log")
    study = optuna.load_study(study_name="k", storage=url)
    assert study.trials[killed].state == optuna.trial.TrialState.FAIL
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed]
    assert len(retries) == 1, [t.system_attrs for t in study.trials]
    retry = retries[0]
    assert retry.params == record.params and retry.state in FINISHED and retry.number in rerun["ran"]
    assert retry.user_attrs["worker"] == rerun["worker"]  # not the dead worker's
    assert len(rerun["ran"]) == 2 and all(study.trials[n].state in FINISHED for n in rerun["ran"])  # the rerun resumed
    assert not [t for t in study.trials if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)]
    print(f"\nkilled trial {killed} {record.params} left {record.state.name}; after the rerun: "
          f"{[(t.number, t.state.name, t.system_attrs.get('failed_trial')) for t in study.trials]}")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def no_models(monkeypatch):
    """Storage errors must come before any model loads."""
    def refuse(*args, **kwargs):
        raise AssertionError("models loaded before the storage was checked")

    monkeypatch.setattr(Pipeline, "load", refuse)


@pytest.mark.parametrize(
    "storage, needles",
    [
        ("postgres://treegraft@localhost/db", ["unknown database kind 'postgres'", "postgresql://USER"]),
        ("not a url", ["is not a database URL", "sqlite:///PATH.db"]),
        ("postgresql://treegraft@127.0.0.1:{port}/db", ["cannot open the study database", "refused", "start the server"]),
    ],
    ids=["wrong-scheme", "not-a-url", "unreachable"],
)
def test_bad_storage_is_one_clear_line(storage, needles, tmp_path, capsys, monkeypatch):
    if "{port}" in storage:  # reaching a server needs the driver
        require_driver()
    no_models(monkeypatch)
    args = tune_args(storage.format(port=closed_port()), "s", prompts_file(tmp_path, 1), tmp_path / "x.yaml", 1)
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_clean_failure(code, err, *needles)
    print(f"\n{storage}: {err.strip()}")


def test_missing_database_names_the_fix(postgres, tmp_path, capsys, monkeypatch):
    no_models(monkeypatch)
    url = postgres.url("exists").replace("/exists?", "/nosuch?")
    code, _, err = run_cli(tune_args(url, "s", prompts_file(tmp_path, 1), tmp_path / "x.yaml", 1), capsys, monkeypatch)
    assert_clean_failure(code, err, 'database "nosuch" does not exist', "createdb")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_study_of_another_space_is_refused(backend, request, tmp_path, capsys, monkeypatch):
    url = request.getfixturevalue("postgres").url("spaces") if backend == "postgresql" else f"sqlite:///{tmp_path / 's.db'}"
    settings = TuneSettings(PAIR, "fp32", "cpu", DecodeConfig(method="dense"), 1, url, "s")
    open_study(settings, load_space("dense"))  # the study is made with the bundled space
    other = tmp_path / "other.yaml"
    other.write_text("method: dense\nparams:\n  tree.budget: {type: int, low: 8, high: 32}\n  tree.depth: {type: int, low: 2, high: 8}\n")
    no_models(monkeypatch)
    args = tune_args(url, "s", prompts_file(tmp_path, 1), tmp_path / "x.yaml", 1) + ["--space", str(other)]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_clean_failure(code, err, "another search space", "tree.budget, tree.top_k differ", "--study NAME")
    code, _, err = run_cli(tune_args(url, "s", prompts_file(tmp_path, 1), tmp_path / "x.yaml", 1) + ["--method", "graft"],
                           capsys, monkeypatch)
    assert_clean_failure(code, err, "tunes dense", "this run graft")
