"""bench on the tiny-random pair: results.json schema, Spec-Bench answers, the CI gate, the lossless check."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from treegraft_cli.bench import SCHEMA, check_against, suite_questions
from treegraft_cli.bench.lossless import EXACT, MISMATCH, TIE, check_turn, judge_divergence
from treegraft_cli.cli import app
from treegraft_cli.errors import ConfigError

PAIR = "tiny-random@layers=2:tiny-random"
METHOD_KEYS = {"kind", "config", "speedup", "tau", "tokens_per_s", "new_tokens", "wall_s", "steps", "lossless", "ties",
               "mismatches", "after_divergence", "acceptance_by_depth", "drafter_calls_per_step", "time_split",
               "peak_memory_mb", "per_benchmark", "syncs_per_step", "acceptance_by_origin"}


def write_prompts(tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question_id": 7, "category": "qa", "turns": ["Who wrote Hamlet?"]}) + "\n")
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Say hi.", "Again, louder."]}) + "\n")
    return qa, mt


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    qa, mt = write_prompts(tmp)
    out = tmp / "out"
    args = ["bench", "--pair", PAIR, "--methods", "dense,hf-lookup", "--prompts", str(qa), "--prompts", str(mt),
            "-n", "6", "--dtype", "fp32", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return tmp, out, args, result


def test_bench_writes_documented_schema(bench_run):
    _, out, _, result = bench_run
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["results"] == str(out / "results.json") and summary["lossless"] is True
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == SCHEMA and results["baseline"] == "ar"
    assert results["lossless_basis"].startswith("every turn compared with ar")
    assert results["thinking"] is None  # no --thinking/--no-thinking, no profile: the template's default
    assert results["benchmarks"] == ["qa", "mt"] and results["num_questions"] == 2
    assert list(results["methods"]) == ["ar", "dense", "hf-lookup"]
    for name, method in results["methods"].items():
        assert METHOD_KEYS <= set(method), name
        assert set(method["per_benchmark"]) == {"qa", "mt"}
        assert method["lossless"] is True
    assert results["methods"]["ar"]["speedup"] == pytest.approx(1.0)
    assert results["methods"]["ar"]["tau"] == pytest.approx(1.0)
    assert results["methods"]["hf-lookup"]["kind"] == "peer"
    assert results["methods"]["dense"]["syncs_per_step"] == pytest.approx(1.0)  # the verdict read alone
    dense = results["methods"]["dense"]
    by_origin = dense["acceptance_by_origin"]
    assert list(by_origin) == ["model"]  # dense's nodes all come from the model drafter
    assert sum(by_origin["model"]["accepted"]) == round((dense["tau"] - 1) * dense["steps"])
    assert sum(by_origin["model"]["verified"]) == dense["steps"] * dense["config"]["tree"]["budget"]
    assert results["methods"]["ar"]["acceptance_by_origin"] == {} == results["methods"]["hf-lookup"]["acceptance_by_origin"]
    # per benchmark, drafter calls per step weight back to the whole run's
    per_benchmark = dense["per_benchmark"].values()
    calls = sum(b["drafter_calls_per_step"]["model"] * b["steps"] for b in per_benchmark) / dense["steps"]
    assert calls == pytest.approx(dense["drafter_calls_per_step"]["model"]) and calls > 0
    assert (out / "speedup.png").stat().st_size > 0 and (out / "tau.png").stat().st_size > 0


def test_answers_are_spec_bench_format(bench_run):
    _, out, _, _ = bench_run
    for method in ("ar", "dense", "hf-lookup"):
        lines = [json.loads(line) for line in (out / "answers" / f"{method}.jsonl").read_text().splitlines()]
        assert [line["question_id"] for line in lines] == ["qa/7", "mt/81"]
        assert [line["source_question_id"] for line in lines] == [7, 81]
        assert [line["category"] for line in lines] == ["qa", "writing"]
        choice = lines[1]["choices"][0]
        assert len(choice["turns"]) == 2 and len(choice["new_tokens"]) == 2 and len(choice["wall_time"]) == 2
        assert all(n <= 6 for n in choice["new_tokens"]) and isinstance(choice["accept_lengths"], list)


def test_check_against_fails_on_doctored_and_passes_on_honest(bench_run):
    tmp, out, args, _ = bench_run
    results = json.loads((out / "results.json").read_text())
    assert check_against(results, results, 0.1)[0] == []
    doctored = json.loads(json.dumps(results))
    doctored["methods"]["dense"]["speedup"] *= 10
    doctored["methods"]["hf-lookup"]["tau"] += 5
    regressions, compared = check_against(results, doctored, 0.1)
    assert {(r.method, r.metric) for r in regressions} == {("dense", "speedup"), ("hf-lookup", "tau")}
    assert set(compared) == {"ar", "dense", "hf-lookup"}
    baseline = tmp / "doctored.json"
    baseline.write_text(json.dumps(doctored))
    again = CliRunner().invoke(app, args[:-1] + [str(tmp / "again"), "--check-against", str(baseline), "--no-plots"])
    assert again.exit_code == 1
    assert json.loads(again.stdout.strip().splitlines()[-1])["regressions"]


def test_lossless_check_tells_ties_from_mismatches(tiny_self_pair):
    target = tiny_self_pair[1].model
    prompt = torch.tensor([5, 6, 7, 8])
    with torch.no_grad():
        logits = target(input_ids=prompt[None]).logits[0, -1]
    best, second = torch.topk(logits, 2).indices.tolist()
    gap = float(logits[best] - logits[second])
    assert check_turn(target, prompt, [best, 1], [best, 1], 0.0).status == EXACT
    assert check_turn(target, prompt, [best], [second], 0.0).status == MISMATCH  # fp32: any divergence fails
    tie = check_turn(target, prompt, [best], [second], gap + 1)
    assert tie.status == TIE and tie.distances == pytest.approx((0.0, gap), abs=1e-5) and tie.ranks == (1, 2)
    third = torch.topk(logits, 3).indices[2].item()
    far = float(logits[best] - logits[third])
    assert check_turn(target, prompt, [best], [third], far / 2).status == MISMATCH  # third token beyond the tolerance
    assert check_turn(target, prompt, [best, 1], [best], 1e9).status == MISMATCH  # one stopped early: never a tie


def test_three_way_near_tie_is_judged_by_distance_from_the_best():
    logits = torch.full((10,), -5.0)
    logits[[2, 5, 7]] = torch.tensor([12.0, 11.875, 11.75])  # three near-equal tokens, bf16 steps apart
    tie = judge_divergence(logits, 5, 7, tolerance=0.5, position=8)
    assert tie.status == TIE and tie.position == 8
    assert tie.distances == pytest.approx((0.125, 0.25)) and tie.ranks == (2, 3) and tie.near_best == 3
    assert tie.gap == pytest.approx(0.125)  # top-1 minus top-2, kept for compatibility
    assert judge_divergence(logits, 2, 7, tolerance=0.2).status == MISMATCH  # 0.25 from the best: beyond 0.2
    assert judge_divergence(logits, 2, 0, tolerance=0.5).distances == pytest.approx((0.0, 17.0))
    assert judge_divergence(logits, 2, 0, tolerance=0.5).status == MISMATCH
    assert judge_divergence(logits, 2, 5, tolerance=0.0).status == MISMATCH  # fp32: no ties at all


def test_bad_inputs_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRAFT_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="TREEGRAFT_DATA"):
        suite_questions("quick")
    with pytest.raises(ConfigError, match="mt_bench"):
        suite_questions("nosuch")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": "not a list"}\n')
    with pytest.raises(ConfigError, match="turns"):
        suite_questions(prompt_files=[bad])
    result = CliRunner().invoke(app, ["bench", "--pair", PAIR, "--methods", "nosuch", "--prompts", str(bad)])
    assert result.exit_code != 0


def test_unknown_method_lists_valid_ones():
    from treegraft_cli.bench import plan_configs
    from treegraft_cli.config import DecodeConfig

    with pytest.raises(ConfigError) as error:
        plan_configs(DecodeConfig(), ["nosuch"])
    assert "hf-assisted" in error.value.hint and "dense" in error.value.hint


def test_sampled_bench_says_losslessness_comes_from_the_sampling_tests(tmp_path):
    qa, _ = write_prompts(tmp_path)
    args = ["bench", "--pair", PAIR, "--methods", "dense", "--prompts", str(qa), "-n", "4", "--dtype", "fp32",
            "--temperature", "0.8", "--no-plots", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["lossless"] is None and results["methods"]["dense"]["tau"] >= 1
    assert "tests/test_sampling_methods.py" in results["lossless_basis"]
    assert "proven equal to the target's" in " ".join(result.stderr.split())
