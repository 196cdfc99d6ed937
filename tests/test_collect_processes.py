"""`treegraft collect` from several processes on one output directory: a worker killed mid-prompt and rerun,
two workers given the same shard by mistake, and the claim lock and shared settings underneath."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path

import pytest
from processes import finish, start_cli, worker_of
from typer.testing import CliRunner

from treegraft_cli.bench.suites import Question
from treegraft_cli.cli import app
from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.errors import ConfigError
from treegraft_cli.pipeline import Pipeline
from treegraft_cli.scheduling.cost_profile import load_cost_profile
from treegraft_cli.scheduling.rollouts import CollectSettings, collect
from treegraft_cli.scheduling.shards import (
    claim_shard,
    read_rollouts,
    read_settings,
    read_shard,
    shard_holder,
    shard_keys,
    shard_state,
    write_shard,
)

PAIR = "tiny-random@layers=2:tiny-random"
TREE = ["-N", "12", "-D", "3", "-K", "3"]
QUESTIONS = ["Count to five.", "Name three colours.", "Say hello twice.", "Spell cat."]
KEYS = [f"prompts-{i}" for i in range(len(QUESTIONS))]


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "costs.yaml"
    result = CliRunner().invoke(app, ["profile", "--pair", PAIR, "--dtype", "fp32", "--tokens", "1,4,16", "--contexts",
                                      "16,64", "--repeats", "1", "--width", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def prompts_file(directory: Path) -> Path:
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "turns": [q]}) + "\n" for i, q in enumerate(QUESTIONS)))
    return path


def collect_args(out: Path, prompts: Path, shard: str, cost: Path) -> list[str]:
    return ["collect", "--pair", PAIR, "--dtype", "fp32", "--prompts", str(prompts), "-n", "12", *TREE,
            "--cost", str(cost), "--out", str(out), "--shard", shard, "--format", "jsonl"]


def receipts(out: Path) -> dict[str, dict]:
    return {p.name[: -len(".done.json")]: json.loads(p.read_text()) for p in (out / "shards").glob("*.done.json")}


def claimed_unsealed(out: Path, worker: str) -> list[str]:
    """Keys ``worker`` has claimed and not sealed: the prompt it is inside."""
    sealed = receipts(out)
    keys = []
    for lock in (out / "shards").glob(".*.lock") if (out / "shards").is_dir() else ():
        key = lock.name[1 : -len(".lock")]
        try:
            holder = json.loads(lock.read_text())["worker"]
        except (json.JSONDecodeError, KeyError):  # being rewritten right now
            continue
        if holder == worker and key not in sealed:
            keys.append(key)
    return keys


def wait_mid_prompt(out: Path, process, deadline_s: float = 240) -> str:
    """The key ``process`` is collecting, once it has sealed one prompt already."""
    worker = worker_of(process)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the worker ended before it could be killed"
        if any(r.get("worker") == worker for r in receipts(out).values()):
            inside = claimed_unsealed(out, worker)
            if inside:
                return inside[0]
        time.sleep(0.02)
    raise AssertionError("the worker never started a second prompt")


def assert_every_prompt_once(out: Path) -> dict:
    """Every prompt sealed and verified, each decision row present once; distill trains on them."""
    assert shard_keys(out) == sorted(KEYS)
    assert all(shard_state(out, key).status == "done" for key in KEYS)
    _, table = read_rollouts(out)  # every receipt's checksum and row count verified
    rows = list(zip(table["key"], table["turn"], table["step"], table["layer"], strict=True))
    assert len(rows) == len(set(rows)) > 0
    result = CliRunner().invoke(app, ["distill", "--rollouts", str(out), "--out", str(out.parent / "s.json"), "--epochs", "5"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_two_workers_one_killed_mid_prompt_and_rerun(tmp_path, cost_file):
    out, prompts = tmp_path / "roll", prompts_file(tmp_path)
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [start_cli(collect_args(out, prompts, f"{i}/2", cost_file), log) for i, log in enumerate(logs)]
    killed_key = wait_mid_prompt(out, workers[1])
    workers[1].send_signal(signal.SIGKILL)
    workers[1].wait()
    sealed_before = sorted(k for k, r in receipts(out).items() if r["worker"] == worker_of(workers[1]))
    survivor = finish(workers[0], logs[0])
    assert survivor["collected"] == 2
    assert shard_state(out, killed_key).status == "torn" and shard_holder(out, killed_key) is None
    with pytest.raises(ConfigError, match="torn"):
        read_rollouts(out)  # distill refuses until the shard is redone

    rerun = finish(start_cli(collect_args(out, prompts, "1/2", cost_file), tmp_path / "rerun.log"), tmp_path / "rerun.log")
    assert rerun["redone"] == 1 and rerun["skipped"] == len(sealed_before) and rerun["collected"] == 2 - len(sealed_before)
    assert receipts(out)[killed_key]["worker"] == rerun_worker(out, killed_key)
    distilled = assert_every_prompt_once(out)
    print(f"\nkilled worker 1 inside {killed_key} after sealing {sealed_before}; survivor {survivor}; rerun {rerun}; "
          f"distill held-out prompts {distilled['held_out']['prompts']}")


def rerun_worker(out: Path, key: str) -> str:
    lock = json.loads((out / "shards" / f".{key}.lock").read_text())
    return lock["worker"]  # the lock records the last holder: the rerun that sealed it


def test_two_workers_on_the_same_shard_collect_each_prompt_once(tmp_path, cost_file):
    out, prompts = tmp_path / "roll", prompts_file(tmp_path)
    logs = [tmp_path / f"same{i}.log" for i in range(2)]
    workers = [start_cli(collect_args(out, prompts, "0/1", cost_file), log) for log in logs]
    reports = [finish(w, log) for w, log in zip(workers, logs, strict=True)]
    assert sum(r["collected"] for r in reports) == len(QUESTIONS)  # no prompt collected twice
    assert all(r["collected"] + r["skipped"] == len(QUESTIONS) for r in reports)
    assert {r["worker"] for r in receipts(out).values()} <= {worker_of(w) for w in workers}
    assert_every_prompt_once(out)
    print(f"\nsame shard twice: {[(r['collected'], r['skipped'], r['waited']) for r in reports]} (collected, skipped, waited)")


def test_a_claimed_shard_is_busy_then_torn(tmp_path):
    out = tmp_path / "roll"
    with claim_shard(out, "k") as held:
        assert held
        with claim_shard(out, "k") as again:
            assert not again  # a second claim (another worker) is refused while the first holds it
        assert shard_holder(out, "k") is not None
        with pytest.raises(ConfigError, match="being collected by"):
            read_shard(out, "k")
    assert shard_holder(out, "k") is None and shard_state(out, "k").status == "torn"  # released, never sealed
    with claim_shard(out, "k") as held:
        assert held
        write_shard(out, "k", [{"x": 1}], "jsonl")
    assert shard_state(out, "k").status == "done" and len(read_shard(out, "k")) == 1


def test_a_worker_that_measured_its_costs_takes_the_recorded_profile(tmp_path, cost_file, tiny_self_pair):
    drafter, target = tiny_self_pair
    pipeline = Pipeline(target=target, drafter=drafter)
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=4,
                          method_options={"policy": "cost-aware"})
    settings = CollectSettings(PAIR, "fp32", config, fmt="jsonl")
    recorded = load_cost_profile(cost_file)
    mine = dataclasses.replace(recorded, target_ms=tuple(tuple(2 * v for v in row) for row in recorded.target_ms))
    assert mine.identity != recorded.identity
    questions = [Question("prompts", 0, "", ("Count to five.",))]
    out = tmp_path / "roll"
    first = collect(pipeline, questions, settings, recorded, out)
    assert read_settings(out)["cost_profile"]["identity"] == recorded.identity == first.cost_profile
    with pytest.raises(ConfigError, match="other settings"):
        collect(pipeline, questions, settings, mine, out)  # chosen with --cost: a mismatch is an error
    second = collect(pipeline, questions, settings, mine, out, costs_measured=True)
    assert second.cost_profile == recorded.identity and second.skipped == 1
