"""The bench runner on tiny models: interleaving, repeats, state reset, the speedup interval, Ctrl-C and resume."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from treegraft_cli.bench import BenchPlan, PairShape, build_results, default_methods, plan_configs
from treegraft_cli.bench import runner as bench_runner
from treegraft_cli.bench.contenders import build_contender
from treegraft_cli.bench.journal import Journal
from treegraft_cli.bench.records import ContenderRecord, QuestionRecord, TurnRecord
from treegraft_cli.bench.regression import check_against
from treegraft_cli.bench.results import acceptance_by_origin
from treegraft_cli.bench.runner import Bench
from treegraft_cli.bench.stats import PerQuestion, bootstrap_interval, pooled_speedup
from treegraft_cli.bench.suites import Question
from treegraft_cli.cli import app
from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.engine import Generation, StepStats
from treegraft_cli.pipeline import Pipeline
from treegraft_cli.tree import ORIGIN_ADJACENCY, ORIGIN_MODEL

PAIR = "tiny-random@layers=2:tiny-random"
QUESTIONS = [Question("x", i, "", (text,)) for i, text in
             enumerate(["Say hi hi hi hi.", "Count: one two three one two three.", "Hamlet Hamlet Hamlet who?"])]
SMALL = DecodeConfig(max_new_tokens=16, tree=TreeConfig(budget=8, depth=3, top_k=2))


@pytest.fixture(scope="module")
def pipeline(tiny_self_pair):
    drafter, target = tiny_self_pair
    return Pipeline(target=target, drafter=drafter)


class Recorder:
    """Wraps every contender so that each timed ``generate`` is logged as (contender, question text)."""

    def __init__(self, fail_at: tuple[str, int] | None = None):
        self.calls: list[tuple[str, str]] = []
        self.fail_at = fail_at  # (contender, nth timed call of the whole run) raises KeyboardInterrupt
        self.timed = set()

    def build(self, pipeline, config):
        contender = build_contender(pipeline, config)
        if config.max_new_tokens == SMALL.max_new_tokens:  # warm-up contenders decode fewer tokens
            self.timed.add(id(contender))
        original = contender.generate

        def generate(prompt_ids):
            if id(contender) in self.timed:
                text = pipeline.tokenizer.decode(prompt_ids)
                question = next(q.turns[0] for q in QUESTIONS if q.turns[0] in text)
                self.calls.append((contender.name, question))
                if self.fail_at and self.fail_at == (contender.name, len(self.calls)):
                    raise KeyboardInterrupt
            return original(prompt_ids)

        contender.generate = generate
        return contender


def test_contenders_interleave_per_question_ar_first(pipeline):
    recorder = Recorder()
    configs = plan_configs(SMALL, ["graft", "ngram"])
    plan = BenchPlan(tuple(configs), tuple(QUESTIONS[:2]), 0.0, repeats=2)
    run = Bench(pipeline, plan, build=recorder.build).run()
    one_pass = [(name, q.turns[0]) for q in QUESTIONS[:2] for name in ("ar", "graft", "ngram")]
    assert recorder.calls == one_pass * 2
    assert run.done == run.total == 4 and run.interrupted is None
    assert [(q.question.question_id, q.repeat) for q in run.records[1].questions] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def _steps_per_question(pipeline, questions, reset):
    configs = plan_configs(SMALL, ["adjacency", "graft", "treegraft:cost-aware"],
                           {"treegraft": {"verify_ms": 10.0, "strong_ms": 3.0}})  # given costs: decisions not timed
    run = Bench(pipeline, BenchPlan(tuple(configs), tuple(questions), 0.0, reset_per_question=reset)).run()
    return {(r.name, q.question.question_id): ([t.generation.output_ids for t in q.turns],
                                               [s.accepted_length for t in q.turns for s in t.generation.steps])
            for r in run.records for q in r.questions}


def test_reset_per_question_makes_results_order_independent(pipeline):
    forward = _steps_per_question(pipeline, QUESTIONS, reset=True)
    backward = _steps_per_question(pipeline, QUESTIONS[::-1], reset=True)
    assert forward == backward
    carried = _steps_per_question(pipeline, QUESTIONS[::-1], reset=False)
    assert carried != _steps_per_question(pipeline, QUESTIONS, reset=False)  # the adjacency table leaks otherwise


def _turn(tokens: int, wall: float, text: str = "same") -> TurnRecord:
    return TurnRecord(None, Generation(prompt_length=4, output_ids=[1] * tokens, wall_s=wall), text)


def _record(name: str, rows: list[list[tuple[int, float, str]]]) -> ContenderRecord:
    record = ContenderRecord(name, "method", DecodeConfig(method=name))
    for i, turns in enumerate(rows):
        record.questions.append(QuestionRecord(Question("b", i, "", ("q",) * len(turns)), [_turn(*t) for t in turns]))
    return record


def test_speedup_interval_on_a_hand_made_record():
    # four questions, 10 tokens each: ar takes 2 s on each, the method 1, 2, 3 and 4 s
    ar = _record("ar", [[(10, 2.0, "a")], [(10, 2.0, "b")], [(10, 2.0, "c")], [(10, 2.0, "d")]])
    method = _record("m", [[(10, 1.0, "a")], [(10, 2.0, "other")], [(10, 3.0, "c")], [(10, 4.0, "d")]])
    results = build_results([ar, method], {"pair": "p"})
    m = results["methods"]["m"]
    assert m["speedup"] == pytest.approx((40 / 10) / (40 / 8))
    # the exact bootstrap distribution: all 4^4 equally likely resamples of the four questions
    walls = (1.0, 2.0, 3.0, 4.0)
    exact = [(40 / sum(walls[i] for i in pick)) / (40 / 8) for pick in itertools.product(range(4), repeat=4)]
    low, high = np.quantile(exact, [0.025, 0.975], method="inverted_cdf")
    assert m["speedup_ci"] == pytest.approx([low, high], abs=1e-6)  # 4/7 and 4/3
    assert build_results([ar, method], {"pair": "p"})["methods"]["m"]["speedup_ci"] == m["speedup_ci"]  # seeded
    # same text as ar: every question but the second
    assert m["same_text_turns"] == 3 and m["turns"] == 4
    assert m["speedup_same_text"] == pytest.approx((30 / 8) / (30 / 6))
    assert results["methods"]["ar"]["speedup_ci"] == [1.0, 1.0]
    assert m["per_benchmark"]["b"]["speedup_ci"] == m["speedup_ci"]


def test_interval_degenerates_to_the_point_with_one_question():
    data = PerQuestion.of([(10, 1.0, 10, 2.0)])
    assert pooled_speedup(data) == pytest.approx(2.0)
    assert bootstrap_interval(data) == pytest.approx((2.0, 2.0))
    assert bootstrap_interval(PerQuestion.of([])) is None


def test_gate_fails_only_when_the_interval_lies_below_the_floor():
    baseline = {"methods": {"m": {"speedup": 2.0, "tau": 3.0}}}
    noisy = {"methods": {"m": {"speedup": 1.5, "speedup_ci": [1.2, 1.9], "tau": 3.0}}}
    assert check_against(noisy, baseline, 0.1)[0] == []  # point below 1.8, but the interval reaches it
    slow = {"methods": {"m": {"speedup": 1.5, "speedup_ci": [1.3, 1.7], "tau": 2.0}}}
    regressions, compared = check_against(slow, baseline, 0.1)
    assert compared == ["m"] and {(r.metric, r.interval) for r in regressions} == {("speedup", (1.3, 1.7)), ("tau", None)}
    assert "interval" in regressions[0].describe()


def test_default_methods_show_the_papers_methods_against_the_best_peer():
    assert default_methods(PairShape(True, True)) == ["graft", "treegraft", "hf-assisted"]
    assert default_methods(PairShape(True, True), greedy=False) == ["graft", "treegraft"]
    everything = default_methods(PairShape(True, True), everything=True)
    assert {"dense", "chain", "all-mid", "hf-lookup", "hf-assisted"} <= set(everything)
    alone = default_methods(PairShape(False, False))
    assert "graft" not in alone and {"adjacency", "all-small", "ngram", "hf-lookup"} <= set(alone)


def test_acceptance_by_origin_counts_verified_and_accepted_nodes_by_depth():
    steps = [
        # model nodes at depths 1, 2; an adjacency node at depth 1; the model path 1 -> 2 accepted
        StepStats(3, 3, {}, 0.0, 0.0, 0.0, node_origins=(ORIGIN_MODEL, ORIGIN_MODEL, ORIGIN_ADJACENCY),
                  node_depths=(1, 2, 1), accepted_nodes=(0, 1)),
        # an adjacency node at depth 1 accepted, its child at depth 2 not
        StepStats(2, 2, {}, 0.0, 0.0, 0.0, node_origins=(ORIGIN_ADJACENCY, ORIGIN_ADJACENCY), node_depths=(1, 2),
                  accepted_nodes=(0,)),
    ]
    assert acceptance_by_origin(steps) == {
        "model": {"verified": [1, 1], "accepted": [1, 1], "rate": [1.0, 1.0]},
        "adjacency": {"verified": [2, 1], "accepted": [1, 0], "rate": [0.5, 0.0]},
    }
    assert acceptance_by_origin([StepStats(1, 0, {}, 0.0, 0.0, 0.0)]) == {}


def test_interrupted_run_is_kept_partial_and_resumed(tmp_path, pipeline):
    configs = plan_configs(SMALL, ["graft"])
    plan = BenchPlan(tuple(configs), tuple(QUESTIONS), 0.0)
    journal = Journal(tmp_path / "resume.jsonl", {"pair": PAIR})
    recorder = Recorder(fail_at=("graft", 4))  # ar q0, graft q0, ar q1, graft q1 <- interrupted
    bench = Bench(pipeline, plan, journal, recorder.build)
    run = bench.run()
    assert run.done == 1 and run.interrupted.finished == ("ar",) and run.interrupted.not_started == 1
    assert run.interrupted.question == QUESTIONS[1]
    assert [len(r.questions) for r in run.records] == [1, 1]  # the unfinished question run is dropped whole
    again = Recorder()
    resumed = Bench(pipeline, plan, Journal(tmp_path / "resume.jsonl", {"pair": PAIR}), again.build).run()
    assert [q for _, q in again.calls] == [QUESTIONS[1].turns[0]] * 2 + [QUESTIONS[2].turns[0]] * 2
    assert resumed.done == 3 and resumed.resumed == 1
    first, restored = run.records[1].questions[0], resumed.records[1].questions[0]
    assert restored.resumed and restored.turns[0].generation.output_ids == first.turns[0].generation.output_ids
    assert restored.turns[0].check == first.turns[0].check
    assert restored.turns[0].generation.steps == first.turns[0].generation.steps  # every field, origins too
    other = Journal(tmp_path / "resume.jsonl", {"pair": "another"})
    assert other.stale and not other.runs


def test_ctrl_c_in_the_cli_writes_partial_results_and_a_rerun_resumes(tmp_path, monkeypatch):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": q.question_id, "turns": list(q.turns)}) + "\n"
                               for q in QUESTIONS[:2]))
    out = tmp_path / "out"
    args = ["bench", "--pair", PAIR, "--methods", "ngram", "--prompts", str(prompts), "-n", "6", "--dtype", "fp32",
            "--out", str(out), "--no-plots"]
    calls = []

    def failing(pipeline, config):
        contender = build_contender(pipeline, config)
        original = contender.generate

        def generate(prompt_ids):
            if config.max_new_tokens == 6:  # timed (the warm-up decodes 8 tokens)
                calls.append(config.method)
                if calls == ["ar", "ngram", "ar", "ngram"]:
                    raise KeyboardInterrupt  # ngram on the second question
            return original(prompt_ids)

        contender.generate = generate
        return contender

    monkeypatch.setattr(bench_runner, "build_contender", failing)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stderr and "lost" in result.stderr and "resume" in result.stderr
    partial = json.loads((out / "results.partial.json").read_text())
    assert partial["partial"] is True and partial["finished_question_runs"] == 1 and partial["total_question_runs"] == 2
    assert partial["interrupted"]["finished_then_dropped"] == ["ar"] and not (out / "results.json").exists()
    monkeypatch.setattr(bench_runner, "build_contender", build_contender)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "resuming: 1 question run" in again.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["question_runs"] == 2 and results["resumed_question_runs"] == 1
    assert not (out / "results.partial.json").exists() and not (out / "resume.jsonl").exists()
