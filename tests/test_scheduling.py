"""profile → collect → distill → replay on the tiny-random pair; the value system stays lossless; features by hand."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import datasets
import pytest
import torch
import yaml
from conftest import reference_greedy
from test_sampling_methods import learned_artifact
from typer.testing import CliRunner

from treegraft_cli.bench.suites import Question
from treegraft_cli.cli import app
from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.errors import ConfigError
from treegraft_cli.methods import Prefill
from treegraft_cli.methods.treegraft import TreeGraftMethod
from treegraft_cli.pipeline import Pipeline
from treegraft_cli.profiles import load_profile, profiles_dir
from treegraft_cli.scheduling.artifact import DistilledScheduler, Normaliser, build_mlp, load_scheduler
from treegraft_cli.scheduling.cost_profile import CostProfile, check_profile_pair, load_cost_profile, save_cost_profile
from treegraft_cli.scheduling.distill import Decisions, DistillSettings, choose_correction_scale, fit
from treegraft_cli.scheduling.history import StepHistory
from treegraft_cli.scheduling.options import TreeGraftConfig
from treegraft_cli.scheduling.policies import (
    FEATURE_NAMES,
    FEATURE_SETS,
    HISTORY_FEATURE_NAMES,
    PREVIEW_FEATURE_NAMES,
    CostModel,
    SchedulerState,
    WeakPreview,
    features,
    preview_features,
)
from treegraft_cli.scheduling.registry import LEARNED, make_policy
from treegraft_cli.scheduling.replay import PricedSteps, price, price_steps
from treegraft_cli.scheduling.rollouts import CollectSettings, collect_question, probing_decoder
from treegraft_cli.scheduling.shards import read_rollouts
from treegraft_cli.scheduling.step_rule import LearnedLayerRule, LearnedStepRule, StepRule
from treegraft_cli.scheduling.values import CATCH_UP_HORIZON, CATCH_UP_SHARE, LAG_COLUMN, MAX_LAG
from treegraft_cli.tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree

PAIR = "tiny-random@layers=2:tiny-random"
TREE = ["-N", "12", "-D", "3", "-K", "3"]
QUESTIONS = ["Count to five.", "Name three colours.", "Say hello twice.", "Spell cat.", "List two fruits."]


def invoke(args: list[str]) -> dict:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "costs.yaml"
    line = invoke(["profile", "--pair", PAIR, "--dtype", "fp32", "--tokens", "1,4,16", "--contexts", "16,64",
                   "--repeats", "1", "--width", "3", "--out", str(out)])
    return out, line


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, cost_file):
    tmp = tmp_path_factory.mktemp("collect")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [q]}) + "\n" for i, q in enumerate(QUESTIONS)))
    out = tmp / "rollouts"
    args = ["collect", "--pair", PAIR, "--dtype", "fp32", "--prompts", str(prompts), "-n", "10", *TREE,
            "--cost", str(cost_file[0]), "--out", str(out)]
    first = invoke(args)
    return out, args, first


def test_profile_writes_sane_costs(cost_file):
    path, line = cost_file
    profile = load_cost_profile(path)
    assert yaml.safe_load(path.read_text())["identity"] == profile.identity == line["identity"]
    assert path.with_suffix(".png").stat().st_size > 0
    assert profile.dtype == "fp32" and {"torch", "transformers"} <= set(profile.versions)
    grids = [v for row in (*profile.target_ms, *profile.drafter_ms) for v in row] + list(profile.host_ms.values())
    assert grids and all(math.isfinite(v) and v > 0 for v in grids)
    assert profile.target_forward_ms(256, 4096) >= profile.target_ms[-1][-1] - 1e-9
    costs = profile.cost_model(budget=12, width=3, context=30)
    assert costs.verify_ms > 0 and costs.strong_ms > 0


def test_profile_times_a_pairs_shapes_with_random_weights(tmp_path):
    """A directory with a config and a tokenizer but no weights: ``--random-weights`` builds the model it describes
    and times it, and the profile says where its times come from."""
    from transformers import LlamaConfig

    from treegraft_cli.models.tiny import byte_level_tokenizer

    model = tmp_path / "shapes-only"
    tokenizer = byte_level_tokenizer()
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "costs.yaml"
    line = invoke(["profile", "--pair", f"{model}:{model}", "--dtype", "fp32", "--tokens", "1,4", "--contexts", "8,16",
                   "--repeats", "1", "--warmup", "0", "--width", "3", "--random-weights", "--out", str(out)])
    profile = load_cost_profile(out)
    assert line["identity"] == profile.identity and profile.pair == f"{model}:{model}"
    assert profile.versions["weights"] == "random (shapes only)"
    assert all(math.isfinite(v) and v > 0 for row in (*profile.target_ms, *profile.drafter_ms) for v in row)


def test_cost_surface_interpolates_and_extrapolates():
    profile = CostProfile(pair="p", device="cpu", dtype="fp32", tree_tokens=(1, 3), contexts=(10, 30),
                          target_ms=((1.0, 3.0), (2.0, 8.0)), drafter_ms=((0.5, 0.5), (0.5, 0.5)), host_ms={"ngram": 0.1})
    assert profile.target_forward_ms(2, 10) == pytest.approx(2.0)  # halfway along tokens
    assert profile.target_forward_ms(2, 20) == pytest.approx(3.5)  # then halfway along contexts (2.0 and 5.0)
    assert profile.target_forward_ms(5, 10) == pytest.approx(5.0)  # along the last segment beyond the grid
    assert profile.target_forward_ms(1, 100) == pytest.approx(2.0 + 70 / 20 * 1.0)
    assert profile.step_ms(3, 2, 1, 3, 10) == pytest.approx(3.0 + 2 * 0.5 + 0.1)


def test_a_profiles_cost_model_carries_the_drafters_catch_up_rate():
    """A strong call is the drafter's forward of 2·K tokens; what a caught-up token adds is its slope from there to
    the widest forward the profile measured."""
    profile = CostProfile(pair="p", device="cpu", dtype="fp32", tree_tokens=(1, 6, 26), contexts=(10,),
                          target_ms=((2.0, 3.0, 4.0),), drafter_ms=((1.0, 1.0, 6.0),))
    costs = profile.cost_model(budget=16, width=3, context=10)
    assert costs.strong_ms == pytest.approx(1.0) and costs.strong_token_ms == pytest.approx(5.0 / 20)
    no_drafter = CostProfile(pair="p", device="cpu", dtype="fp32", tree_tokens=(1, 6, 26), contexts=(10,),
                             target_ms=((2.0, 3.0, 4.0),))
    assert no_drafter.cost_model(budget=16, width=3, context=10).strong_token_ms == 0.0


def test_a_strong_step_pays_for_catching_up_on_the_text_its_drafter_has_not_seen():
    # drafter: 1 ms for up to 6 tokens, then +0.25 ms per token (along the last segment)
    profile = CostProfile(pair="p", device="cpu", dtype="fp32", tree_tokens=(2, 6, 10), contexts=(10,),
                          target_ms=((2.0, 2.0, 2.0),), drafter_ms=((1.0, 1.0, 2.0),))
    assert profile.step_ms(3, 2, 0, 3, 10, lag=0) == pytest.approx(2.0 + 2 * 1.0)
    assert profile.step_ms(3, 0, 2, 3, 10, lag=40) == pytest.approx(2.0)  # a weak step catches up on nothing
    # the tokens since the last call, or the prompt: the step pays its share of work the next call would do anyway
    for lag in (4, MAX_LAG, MAX_LAG + 16):
        assert profile.step_ms(3, 1, 0, 3, 10, lag=lag) == pytest.approx(2.0 + 1.0 + lag * 0.25 / CATCH_UP_HORIZON)
        # a policy that rarely calls pays the whole catch-up (``distill --catch-up-share 1``)
        assert profile.step_ms(3, 1, 0, 3, 10, lag=lag, catch_up_share=1.0) == pytest.approx(2.0 + 1.0 + lag * 0.25)
    with pytest.raises(ConfigError, match="non-positive"):
        CostProfile(pair="p", device="cpu", dtype="fp32", tree_tokens=(1,), contexts=(10,), target_ms=((0.0,),))


def test_each_strong_call_is_priced_at_the_nodes_it_forwarded():
    # drafter: 1 ms for one token, +0.25 ms per token after it
    profile = CostProfile(pair="p", device="cpu", dtype="fp32", tree_tokens=(1, 9), contexts=(10,),
                          target_ms=((2.0, 2.0),), drafter_ms=((1.0, 3.0),))
    # a call from the root forwards the pending tokens alone (lag 3, its share charged), the next two 4 and 8 nodes
    assert profile.step_ms(3, 3, 1, 4, 10, lag=3, forwarded=(0, 4, 8)) == pytest.approx(
        2.0 + (1.0 + 2 * 0.25 / CATCH_UP_HORIZON) + (1.0 + 3 * 0.25) + (1.0 + 7 * 0.25))
    assert profile.step_ms(3, 1, 0, 4, 10, lag=0, forwarded=(0,)) == pytest.approx(2.0 + 1.0)  # at least one token
    # without the counts (older rollouts) every call forwards 2·K = 8 nodes, the lag on top of the first
    assert profile.step_ms(3, 2, 0, 4, 10, lag=3) == pytest.approx(2.0 + 2 * (1.0 + 7 * 0.25) + 3 * 0.25 / CATCH_UP_HORIZON)


def test_features_on_a_hand_built_tree():
    tree = DraftTree.from_root(0)
    a = tree.add_children(torch.tensor([0]), torch.tensor([5]), torch.tensor([-0.5]), ORIGIN_MODEL)
    tree.add_children(torch.tensor([0]), torch.tensor([6]), torch.tensor([-1.0]), ORIGIN_MODEL)
    c = tree.add_children(a, torch.tensor([7]), torch.tensor([-0.7]), ORIGIN_MODEL)
    # nodes: 0 root, 1 a (depth 1, -0.5), 2 b (depth 1, -1.0), 3 c (depth 2, -0.7, child of a)
    state = SchedulerState(tree=tree, frontier=c, window=(1, 2, 3), layer=2,
                           num_layers=4, called=(1,), prompt_length=20, costs=CostModel(40.0, 10.0), width=2, budget=8)
    # a reselection picks the 2 best candidates: a (-0.5, depth 1) and c (-0.7, depth 2)
    expected = [math.log(21), 40.0, 10.0, math.log(4.0), 0.5, 0.25, 1, 0, 0, 0, 0,
                2.0,  # frontier mean depth: c
                1.0,  # c is a leaf
                0.5,  # depth lost: 2 − mean(1, 2)
                0.5,  # a's depth 1 is outside the frontier's depths {2}
                0.5,  # c is in the frontier
                -0.6]  # mean score of a and c
    assert len(expected) == len(FEATURE_NAMES)
    assert torch.allclose(features(state), torch.tensor(expected, dtype=torch.float32), atol=1e-6)


def test_preview_features_by_hand():
    """Two previewed chains under the root, p 0.5 then 0.5, and p 0.25 (padded): three tokens whose cumulative
    probabilities are 0.5, 0.25 and 0.25; a budget of 2 counts the best two."""
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.0]]))
    logp[1, 1] = float("-inf")
    weak = WeakPreview(torch.tensor([0, 0]), logp)
    state = SchedulerState(tree=DraftTree.from_root(0), frontier=torch.tensor([0]), window=(0,), layer=1, num_layers=4,
                           called=(), prompt_length=20, costs=CostModel(40.0, 10.0), width=2, budget=2, weak=weak)
    assert preview_features(state) == pytest.approx((math.log1p(3), 0.75))
    assert preview_features(dataclasses.replace(state, weak=None)) == (0.0, 0.0)


def test_probing_decoder_stays_lossless(tiny_self_pair, cost_file):
    drafter, target = tiny_self_pair
    pipeline = Pipeline(target=target, drafter=drafter)
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=16)
    decoder, probe = probing_decoder(pipeline, CollectSettings(PAIR, "fp32", config), load_cost_profile(cost_file[0]))
    prompt = pipeline.encode_chat([{"role": "user", "content": "abcabcabc abc"}])
    generation = decoder.generate(prompt)
    assert generation.output_ids == reference_greedy(target, prompt, 16)
    assert probe.rows and all(r["tau_call"] >= 1 and r["tau_skip"] >= 1 for r in probe.rows)


def per_step_collection(tiny_self_pair, cost_file, policy: str):
    """The tiny pair's pipeline, a per-step probing decoder with ``policy`` driving, and its probing method."""
    drafter, target = tiny_self_pair
    pipeline = Pipeline(target=target, drafter=drafter)
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=16,
                          method_options={"policy": policy})
    return pipeline, *probing_decoder(pipeline, CollectSettings(PAIR, "fp32", config, decide="step"),
                                      load_cost_profile(cost_file[0]))


def test_the_policy_collecting_keeps_time_on_the_profiles_clock(tiny_self_pair, cost_file):
    """The step rule driving a collection measures every step at its time under the cost profile: its clock reads
    the sum of the decoded steps' modelled times, whatever the probes and this machine took."""
    pipeline, decoder, probe = per_step_collection(tiny_self_pair, cost_file, "step")
    generation = decoder.generate(pipeline.encode_chat([{"role": "user", "content": "abcabcabc abc"}]))
    rows = probe.labelled_rows()
    assert len(rows) == len(generation.steps)  # a row per decoded step: every step could call at layer 1
    assert probe.inner.policy.clock is probe.clock
    assert probe.clock() * 1000.0 == pytest.approx(sum(row["ms_real"] for row in rows), rel=1e-5)
    assert probe.inner.policy.ms > 0  # the rule timed its steps on it


def test_rollouts_record_the_features_the_policy_decided_on(tiny_self_pair, cost_file, monkeypatch):
    """A row's features are the state's at the decision, before the layer grows the tree: what a distilled scheduler
    reads when it decides. At layer 1 the tree is the root alone, so its one frontier node is a leaf."""
    seen = []
    choose = StepRule.choose
    monkeypatch.setattr(StepRule, "choose", lambda rule, state: seen.append(features(state).tolist()) or choose(rule, state))
    pipeline, decoder, probe = per_step_collection(tiny_self_pair, cost_file, "step")
    decoder.generate(pipeline.encode_chat([{"role": "user", "content": "abcabcabc abc"}]))
    rows = probe.labelled_rows()
    leaf = FEATURE_NAMES.index("frontier_leaf_share")
    assert rows and all(row["features"][leaf] == 1.0 for row in rows)
    assert all(any(row["features"] == pytest.approx(decided) for decided in seen) for row in rows)


def test_probes_leave_the_strong_drafter_where_the_real_policy_left_it(tiny_self_pair, cost_file):
    """Probes call the strong drafter; a policy that never calls must still see its lag grow step after step."""
    pipeline, decoder, probe = per_step_collection(tiny_self_pair, cost_file, "all-small")
    prompt = pipeline.encode_chat([{"role": "user", "content": "abcabcabc abc"}])
    generation = decoder.generate(prompt)
    assert generation.output_ids == reference_greedy(pipeline.target, prompt, 16)
    lags = [row[LAG_COLUMN] for row in probe.labelled_rows()]
    assert len(lags) > 1 and lags[0] == prompt.numel() + 1  # the prompt and the first root
    assert all(later > earlier for earlier, later in zip(lags, lags[1:], strict=False))
    # a policy that calls at every step catches the drafter up itself: after the first step it lags by a few tokens
    pipeline, decoder, probe = per_step_collection(tiny_self_pair, cost_file, "all-mid")
    decoder.generate(prompt)
    rows = probe.labelled_rows()
    assert len(rows) > 1 and all(row[LAG_COLUMN] < row["context_length"] for row in rows[1:])


def test_every_question_is_collected_from_a_fresh_policy(tiny_self_pair, cost_file, monkeypatch):
    """What the rule measured on one question does not decide the next one's steps, as in ``bench``'s default."""
    decided = []  # (the rule, its measured ms) at each decision
    choose = StepRule.choose
    monkeypatch.setattr(StepRule, "choose", lambda rule, state: decided.append((rule, rule.ms)) or choose(rule, state))
    pipeline, decoder, probe = per_step_collection(tiny_self_pair, cost_file, "step")
    firsts = []
    for number, text in enumerate(("abcabcabc abc", "xyz xyz xy")):
        firsts.append(len(decided))
        collect_question(pipeline, decoder, probe, Question("prompts", number, "", (text,)), f"prompts-{number}")
    first_rule, second_rule = decided[firsts[0]][0], decided[firsts[1]][0]
    assert decided[firsts[1] - 1][1] > 0  # the first question's rule had measured its steps
    assert second_rule is not first_rule and decided[firsts[1]][1] == 0.0


def test_a_step_drafted_again_gives_the_same_tree(tiny_self_pair):
    drafter, target = tiny_self_pair
    pipeline = Pipeline(target=target, drafter=drafter)
    decoder = pipeline.decoder(DecodeConfig(method="all-mid", tree=TreeConfig(budget=12, depth=3, top_k=3)))
    prompt = pipeline.encode_chat([{"role": "user", "content": "abcabc"}])
    decoder.target.reset()
    logits = decoder.target.forward(prompt)
    decoder.method.start(Prefill(prompt, logits))
    committed = torch.cat([prompt, logits[-1:].argmax(-1)])
    first, _ = decoder.method.build(committed)
    again, _ = decoder.method.build(committed)
    assert first.size > 0 and torch.equal(first.tokens, again.tokens) and torch.equal(first.parents, again.parents)


def test_collect_writes_labelled_shards(rollouts):
    out, _, first = rollouts
    assert first["collected"] == len(QUESTIONS) and first["rows"] > 0 and first["seconds"] > 0
    settings, table = read_rollouts(out)
    assert settings["feature_names"] == list(FEATURE_NAMES) and settings["tree"]["depth"] == 3
    assert len(table) == first["rows"] and len(set(table["key"])) == len(QUESTIONS)
    row = table[0]
    assert len(row["features"]) == 17 and 1 <= row["layer"] <= 3
    # values are stored as float32 and R·T is close to τ by design: compare to float32 precision of the terms,
    # not relative to a difference that may be near zero
    assert row["margin"] == pytest.approx(row["value_call"] - row["value_skip"], abs=1e-6)
    assert row["value_call"] == pytest.approx(row["tau_call"] - row["rate"] * row["ms_call"], abs=1e-5 * row["tau_call"])
    assert row["calls_call"] >= 1 and all(v > 0 for v in table["ms_skip"])
    # R: the generation's real tokens over its real modelled time, each probed step once
    generation = [r for r in table if r["key"] == row["key"] and r["turn"] == row["turn"]]
    steps = {r["step"]: r for r in generation}
    rate = sum(r["tau_real"] for r in steps.values()) / sum(r["ms_real"] for r in steps.values())
    assert all(r["rate"] == pytest.approx(rate, rel=1e-5) for r in generation)
    assert all(r["tau_real"] >= 1 and r["nodes_real"] >= 0 for r in generation)


def test_a_huber_fit_keeps_the_sign_a_few_outlying_labels_would_flip():
    """Nineteen states where calling gains half a token, one where it lost 50 (a catch-up priced on a long article):
    squared error fits their mean, below 0; the Huber loss keeps what most of them say."""
    gen = torch.Generator().manual_seed(0)
    features = torch.cat([torch.zeros(20, 1), torch.ones(20, 1)]) + 0.01 * torch.randn(40, 1, generator=gen)
    value_call = torch.cat([torch.full((19,), 0.5), torch.tensor([-50.0]), torch.full((20,), -0.5)])
    decisions = Decisions(features, value_call, torch.zeros(40), [f"p{i}" for i in range(40)])

    def margin_at_zero(huber_delta: float) -> float:
        mlp, normaliser = fit(decisions, DistillSettings(epochs=400, huber_delta=huber_delta))
        with torch.no_grad():
            return float(normaliser.margins(mlp(normaliser.inputs(torch.zeros(1, 1))).squeeze(-1)))

    assert margin_at_zero(0.0) < 0 < margin_at_zero(DistillSettings.huber_delta)


def test_distill_artifact_loads_and_decides(rollouts, cost_file, tmp_path, tiny_self_pair):
    out, _, _ = rollouts
    artifact = tmp_path / "scheduler.json"
    measured = load_cost_profile(cost_file[0])  # a second "device" whose strong drafter is 10x slower
    slow = dataclasses.replace(measured, drafter_ms=tuple(tuple(10 * v for v in row) for row in measured.drafter_ms))
    save_cost_profile(slow, tmp_path / "slow.yaml")
    line = invoke(["distill", "--rollouts", str(out), "--out", str(artifact), "--epochs", "50",
                   "--cost", str(tmp_path / "slow.yaml")])
    held = line["held_out"]
    assert 0.0 <= held["sign_accuracy"] <= 1.0 and held["policies"]["oracle"]["regret"] == 0.0
    assert all(p["regret"] >= 0 for p in held["policies"].values())
    folded = invoke(["distill", "--rollouts", str(out), "--out", str(tmp_path / "folded.json"), "--epochs", "20",
                     "--folds", "2", "--cost", str(tmp_path / "slow.yaml")])
    rows = len(read_rollouts(out)[1])
    assert folded["held_out"]["rows"] == 2 * rows  # every decision out-of-fold, under both profiles
    scheduler = load_scheduler(artifact)
    assert scheduler.cost_profile["also_priced_under"] == [slow.identity] != [measured.identity]
    assert math.isfinite(scheduler.margin(torch.zeros(17)))
    # the treegraft method decides with it (-o scheduler=FILE) and stays lossless
    drafter, target = tiny_self_pair
    pipeline = Pipeline(target=target, drafter=drafter)
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=12,
                          method_options={"scheduler": str(artifact), "verify_ms": 5.0, "strong_ms": 1.0})
    decoder = pipeline.decoder(config)
    assert isinstance(decoder.method.policy, LearnedLayerRule)
    prompt = pipeline.encode_chat([{"role": "user", "content": "one two one two"}])
    assert decoder.generate(prompt).output_ids == reference_greedy(target, prompt, 12)
    replayed = invoke(["replay", "--rollouts", str(out), "--cost", str(cost_file[0]), "--scheduler", str(artifact)])
    names = [r["policy"] for r in replayed["results"]]
    assert names == ["always-call", "never-call", "oracle", "collected", "learned"]
    assert all(r["speedup"] > 0 and math.isfinite(r["speedup"]) for r in replayed["results"])
    by_name = {r["policy"]: r for r in replayed["results"]}
    assert by_name["always-call"]["call_rate"] == 1.0 and by_name["never-call"]["call_rate"] == 0.0
    # beside a bench's results: each policy's measured speedup from the contender it stands for
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"methods": {"all-small": {"speedup": 1.1}, "all-mid": {"speedup": 0.9},
                                               "treegraft": {"speedup": 1.3}}}))
    side = invoke(["replay", "--rollouts", str(out), "--cost", str(cost_file[0]), "--scheduler", str(artifact),
                   "--measured", str(results), "--match", "learned=treegraft", "--match", "collected=none"])
    measured = {r["policy"]: (r.get("measured_speedup"), r.get("contender")) for r in side["results"]}
    assert measured["never-call"] == (1.1, "all-small") and measured["always-call"] == (0.9, "all-mid")
    assert measured["learned"] == (1.3, "treegraft") and measured["oracle"] == (None, None) == measured["collected"]


def test_rerun_resumes_and_redoes_torn_or_corrupt_shards(rollouts, tmp_path):
    out, args, _ = rollouts
    again = invoke(args)
    assert again["skipped"] == len(QUESTIONS) and again["collected"] == 0
    shards = sorted((out / "shards").glob("*.parquet"))
    shards[0].write_bytes(shards[0].read_bytes()[:40])  # a corrupt shard
    with pytest.raises(ConfigError, match="corrupt"):
        read_rollouts(out)
    result = CliRunner().invoke(app, ["distill", "--rollouts", str(out), "--out", str(tmp_path / "s.json")])
    assert result.exit_code != 0
    receipt = sorted((out / "shards").glob("*.done.json"))[1]
    receipt.unlink()  # a torn shard: data without its receipt
    redo = invoke(args)
    assert redo["collected"] == 2 and redo["redone"] == 2 and redo["skipped"] == len(QUESTIONS) - 2
    read_rollouts(out)


def test_collect_refuses_other_settings_and_bad_artifacts(rollouts, tmp_path):
    out, args, _ = rollouts
    changed = [a if a != "10" else "11" for a in args]
    result = CliRunner().invoke(app, changed)
    assert result.exit_code != 0 and "other settings" in str(result.exception)
    bad = tmp_path / "bad.json"
    bad.write_text("{\"kind\": \"something\"}")
    with pytest.raises(ConfigError, match="not a treegraft scheduler"):
        load_scheduler(bad)


def test_values_by_hand_on_a_hand_built_rollout():
    """V = τ − R·T with R = Σ τ_real / Σ T_real over each generation's distinct steps, under any profile."""
    profile = CostProfile(pair="p", device="cpu", dtype="fp32", tree_tokens=(1, 11), contexts=(10, 100),
                          target_ms=((10.0, 20.0), (10.0, 20.0)), drafter_ms=((3.0, 3.0), (3.0, 3.0)), host_ms={"ngram": 1.0})
    # verify ms = 10 + (tree tokens − 1); a strong call 3 ms; a weak layer 1 ms (context does not matter here)
    rows = {
        "key": ["a", "a", "a", "b"], "turn": [0, 0, 0, 0], "step": [0, 0, 1, 0], "layer": [1, 2, 1, 1],
        "context_length": [20, 20, 23, 30], "real_call": [True, False, False, True], "features": [[0.0] * 17] * 4,
        "tau_call": [3, 2, 1, 4], "nodes_call": [4, 4, 2, 6], "calls_call": [1, 1, 1, 2], "weak_call": [1, 1, 1, 0],
        "tau_skip": [1, 2, 2, 1], "nodes_skip": [2, 4, 3, 0], "calls_skip": [0, 1, 0, 1], "weak_skip": [2, 1, 2, 1],
        "tau_real": [3, 3, 2, 4], "nodes_real": [4, 4, 3, 6], "calls_real": [1, 1, 0, 2], "weak_real": [1, 1, 2, 0],
    }
    priced = price(datasets.Dataset.from_dict(rows), profile, {"top_k": 2, "budget": 10})
    # generation a: step 0 real = 3 tokens in 10+4 + 3 + 1 = 18 ms, step 1 real = 2 tokens in 10+3 + 0 + 2 = 15 ms
    # generation b: 4 tokens in 10+6 + 6 + 0 = 22 ms
    rate_a, rate_b = 5 / 33, 4 / 22
    assert priced.rate.tolist() == pytest.approx([rate_a, rate_a, rate_a, rate_b])
    ms_call, ms_skip = [18.0, 18.0, 16.0, 22.0], [14.0, 18.0, 15.0, 14.0]
    assert priced.ms_call.tolist() == pytest.approx(ms_call) and priced.ms_skip.tolist() == pytest.approx(ms_skip)
    rates = [rate_a, rate_a, rate_a, rate_b]
    expected = [(tc - r * mc) - (ts - r * ms) for tc, ts, mc, ms, r in
                zip(rows["tau_call"], rows["tau_skip"], ms_call, ms_skip, rates, strict=True)]
    assert (priced.value_call - priced.value_skip).tolist() == pytest.approx(expected, rel=1e-5)
    # without the real outcome (older rollouts) the value is the one-step rate, tokens per modelled second
    old = {k: v for k, v in rows.items() if not k.endswith("_real")}
    legacy = price(datasets.Dataset.from_dict(old), profile, {"top_k": 2, "budget": 10})
    assert legacy.rate is None and legacy.value_call.tolist() == pytest.approx([1000 * t / m for t, m in zip(rows["tau_call"], ms_call, strict=True)])


def test_on_policy_collection_uses_the_given_scheduler_and_distills_per_iteration(rollouts, cost_file, tmp_path):
    """collect --policy learned:FILE decodes and continues with that scheduler; distill over both iterations
    reports the held-out regret of each."""
    first_dir, args, _ = rollouts
    late = learned_artifact(tmp_path, early=False)  # skips in the first half of the layers, calls after
    out = tmp_path / "iteration1"
    changed = [str(out) if a == str(first_dir) else a for a in args] + ["--policy", f"learned:{late}"]
    assert invoke(changed)["rows"] > 0
    settings, table = read_rollouts(out)
    assert settings["method_options"]["policy"] == f"learned:{late}" and settings["continuation"] == "policy"
    first_layer = [r for r in table if r["layer"] == 1]
    assert first_layer and not any(r["real_call"] for r in first_layer)  # the scheduler skips layer 1 (1/3 < 1/2)
    # the rest of the step is the scheduler's: after a skip at layer 1 it calls where it can (layers 2 and 3)
    assert any(r["calls_skip"] >= 1 for r in first_layer)
    assert all(r["calls_skip"] == r["calls_real"] for r in first_layer)  # skipping layer 1 is what it really did
    line = invoke(["distill", "--rollouts", str(first_dir), "--rollouts", str(out), "--out", str(tmp_path / "s2.json"),
                   "--epochs", "20"])
    iterations = line["held_out_by_iteration"]
    assert [it["rollouts"] for it in iterations] == [str(first_dir), str(out)]
    assert all(it["policies"]["mlp"]["regret"] >= 0 and it["rows"] > 0 for it in iterations)
    assert sum(it["rows"] for it in iterations) == line["held_out"]["rows"]
    assert line["value"].startswith("tau - R*T")


def test_an_artifact_for_another_pair_or_feature_set_is_refused(tmp_path, tiny_self_pair):
    drafter, target = tiny_self_pair
    path = learned_artifact(tmp_path)
    document = json.loads((tmp_path / "scheduler.json").read_text())
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=8,
                          method_options={"scheduler": path, "verify_ms": 5.0, "strong_ms": 1.0})
    document["cost_profile"] = {"pair": "qwen2.5-coder-0.5b:qwen2.5-coder-1.5b", "identity": "abc123", "dtype": "bf16"}
    (tmp_path / "scheduler.json").write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="distilled for the pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b .*abc123.*not "
                                          + PAIR.replace("@", ".")) as refused:
        Pipeline(target=target, drafter=drafter, pair=PAIR).decoder(config)
    assert "--pair " + PAIR in refused.value.hint
    # the same artifact for its own pair decides (no check when the pair is not known)
    document["cost_profile"]["pair"] = PAIR
    (tmp_path / "scheduler.json").write_text(json.dumps(document))
    assert isinstance(Pipeline(target=target, drafter=drafter, pair=PAIR).decoder(config).method.policy, LearnedLayerRule)
    document["feature_names"] = [*FEATURE_NAMES[:-1], "something_else"]
    (tmp_path / "scheduler.json").write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="other features"):
        load_scheduler(path)


def test_a_profile_finds_its_shipped_scheduler_and_clock_beside_it(tmp_path, monkeypatch):
    profiles = tmp_path / "profiles"
    (profiles / "schedulers").mkdir(parents=True)
    learned_artifact(profiles / "schedulers")
    (profiles / "pair.yaml").write_text(yaml.safe_dump({
        "pair": PAIR, "dtype": "fp32", "decode": {"method": "treegraft"},
        "method_options": {"treegraft": {"scheduler": "schedulers/scheduler.json", "clock": "costs/this.yaml"}}}))
    monkeypatch.chdir(tmp_path / "profiles" / "schedulers")  # anywhere but the profile's directory
    options = load_profile(str(profiles / "pair.yaml")).method_options["treegraft"]
    assert options["scheduler"] == str(profiles / "schedulers" / "scheduler.json")
    assert options["clock"] == str(profiles / "costs" / "this.yaml")  # the modelled clock's cost profile too
    load_scheduler(options["scheduler"])


def test_the_qwen_pairs_profile_ships_a_scheduler_priced_under_its_shipped_cost_profile():
    """The bundled per-step scheduler loads, was distilled for the profile's pair under the shipped Zen 5 bf16 cost
    profile (same identity) and also priced under the other shipped profiles of the pair, so its cost features
    varied; ``treegraft`` decides with the step rule there and ``treegraft:learned`` with it."""
    profile = load_profile("qwen2.5-coder-0.5b--1.5b")
    options = TreeGraftConfig(**profile.method_options["treegraft"])
    scheduler = load_scheduler(options.scheduler)
    costs_dir = profiles_dir() / "costs"
    costs = load_cost_profile(costs_dir / "qwen2.5-coder-0.5b--1.5b-zen5-bf16.yaml")
    others = {load_cost_profile(costs_dir / f"qwen2.5-coder-0.5b--1.5b-{name}.yaml").identity
              for name in ("cpu-bf16", "cpu-fp32", "a100-published")}
    assert scheduler.cost_profile["pair"] == profile.pair == costs.pair
    assert scheduler.cost_profile["identity"] == costs.identity
    assert set(scheduler.cost_profile["also_priced_under"]) == others
    assert scheduler.decides == "step" and scheduler.feature_set == "extended" and options.min_margin == 0.0
    assert TreeGraftMethod.policy_spec(options) == "step"
    learned = dataclasses.replace(options, **TreeGraftMethod.options_from_argument(LEARNED))  # treegraft:learned
    assert isinstance(make_policy(TreeGraftMethod.policy_spec(learned), learned), LearnedStepRule)


def test_step_history_by_hand():
    """Accepted lengths by strong calls, acceptance by origin (nodes whose parent was accepted), the rate in root
    verifications per step."""
    tree = DraftTree.from_root(0)
    a = tree.add_children(torch.tensor([0, 0]), torch.tensor([5, 6]), torch.tensor([-0.1, -0.2]), ORIGIN_MODEL)
    tree.add_children(a[:1], torch.tensor([7]), torch.tensor([-0.3]), ORIGIN_NGRAM)  # node 3 under node 1
    tree.add_children(a[1:], torch.tensor([8]), torch.tensor([-0.4]), ORIGIN_NGRAM)  # node 4 under node 2
    history = StepHistory(decay=0.5, prior_steps=1.0)
    assert history.values() == (1.0, 1.0, 1.0, 0.5, 0.5, 1.0)  # the priors
    costs = CostModel(verify_ms=30.0, strong_ms=5.0, verify_root_ms=10.0)
    history.observe(tree, torch.tensor([0, 1, 3]), calls=1, costs=costs, budget=4)  # accepted 1 then 3
    values = history.values()
    assert values[1] == pytest.approx((3 + 1) / 2)  # τ = 3 with one call, against a prior worth one step
    assert values[0] == values[2] == 1.0  # the other kinds keep their prior
    # n-gram: node 3 judged (parent 1 accepted) and accepted; node 4's parent was rejected: not judged
    assert values[3] == pytest.approx((1.0 + 0.5) / 2)
    # model: nodes 1 and 2 judged (parent: the root), one of two accepted
    assert values[4] == pytest.approx((2 * 0.5 + 0.5) / 3)
    # rate: τ · verify_root / (verify of 4 nodes + one call) = 3 · 10 / (30 + 5)
    assert values[5] == pytest.approx((3 * 10 / 35 + 1.0) / 2)


def test_extended_features_are_collected_distilled_and_decided_with(rollouts, tmp_path, tiny_self_pair):
    out, _, _ = rollouts
    _, table = read_rollouts(out)
    assert all(len(r["history"]) == len(HISTORY_FEATURE_NAMES) for r in table)
    assert all(len(r["preview"]) == len(PREVIEW_FEATURE_NAMES) for r in table)
    # the strong drafter has forwarded nothing before a generation's first step: it lags by all of the context
    assert all(r["strong_lag"] == r["context_length"] for r in table if r["step"] == 0)
    # and it catches up only when the real policy calls (the probes' calls are rewound)
    for generation in {(r["key"], r["turn"]) for r in table}:
        steps = {r["step"]: r for r in table if (r["key"], r["turn"]) == generation}  # a step's rows share both
        called = False
        for step in sorted(steps):
            assert (steps[step]["strong_lag"] < steps[step]["context_length"]) == called
            called = called or steps[step]["calls_real"] > 0
    artifact = tmp_path / "extended.json"
    line = invoke(["distill", "--rollouts", str(out), "--out", str(artifact), "--epochs", "20", "--features", "extended"])
    assert line["held_out"]["rows"] > 0
    scheduler = load_scheduler(artifact)
    assert scheduler.feature_set == "extended"
    assert json.loads(artifact.read_text())["feature_names"] == list(FEATURE_SETS["extended"])
    drafter, target = tiny_self_pair
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=12,
                          method_options={"scheduler": str(artifact), "verify_ms": 5.0, "strong_ms": 1.0})
    decoder = Pipeline(target=target, drafter=drafter).decoder(config)
    assert decoder.method.policy.feature_set == "extended" and decoder.method.measure_history
    prompt = Pipeline(target=target, drafter=drafter).encode_chat([{"role": "user", "content": "one two one two"}])
    assert decoder.generate(prompt).output_ids == reference_greedy(target, prompt, 12)
    assert decoder.method.history is not None and decoder.method.history.values() != StepHistory().values()


def test_per_step_rollouts_distill_into_a_learned_step_rule(cost_file, tmp_path, tiny_self_pair):
    """collect --decide step prices every step kind; distill fits kind-vs-weak margins; the artifact decides per
    step through the step rule and stays lossless; replay estimates per-step policies."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [q]}) + "\n" for i, q in enumerate(QUESTIONS)))
    out = tmp_path / "steps"
    line = invoke(["collect", "--pair", PAIR, "--dtype", "fp32", "--prompts", str(prompts), "-n", "10", *TREE,
                   "--cost", str(cost_file[0]), "--out", str(out), "--decide", "step", "--policy", "step"])
    assert line["rows"] > 0
    settings, table = read_rollouts(out)
    assert settings["decide"] == "step"
    row = table[0]
    for kind in ("weak", "short", "full"):
        assert row[f"tau_kind_{kind}"] >= 1
        # float32 values near zero by design (R·T ≈ τ): to the precision of the terms, as in the per-layer test
        assert row[f"value_kind_{kind}"] == pytest.approx(row[f"tau_kind_{kind}"] - row["rate"] * row[f"ms_kind_{kind}"],
                                                          abs=1e-5 * row[f"tau_kind_{kind}"])
    assert row["calls_kind_weak"] == 0 and row["calls_kind_short"] <= 1 <= row["calls_kind_full"] + 1
    for kind in ("weak", "short", "full"):  # one count per call; a call from the root forwards no tree node
        forwarded = row[f"forwarded_kind_{kind}"]
        assert len(forwarded) == row[f"calls_kind_{kind}"] and forwarded[:1] in ([], [0])
    assert all(0 < nodes <= 2 * 3 + 12 for nodes in row["forwarded_kind_full"][1:])  # K, 2·K with chains, + parents
    costs = load_cost_profile(cost_file[0])
    for kind in ("weak", "short", "full"):  # each label's time prices every call at what it forwarded
        assert row[f"ms_kind_{kind}"] == pytest.approx(costs.step_ms(
            row[f"nodes_kind_{kind}"] + 1, row[f"calls_kind_{kind}"], row[f"weak_kind_{kind}"], 3, row["context_length"],
            row[LAG_COLUMN], row[f"forwarded_kind_{kind}"]))
    artifact = tmp_path / "steps.json"
    distilled = invoke(["distill", "--rollouts", str(out), "--out", str(artifact), "--epochs", "20"])
    assert distilled["decides"] == "step"
    held = distilled["held_out_by_iteration"][0]["policies"]
    assert held["oracle"]["regret"] == 0.0 and all(p["regret"] >= 0 for p in held.values())
    # cross-validated: every step is judged by the fold's model that never saw its prompt
    folded = invoke(["distill", "--rollouts", str(out), "--out", str(tmp_path / "folded.json"), "--epochs", "20",
                     "--folds", "2"])
    assert folded["held_out_scope"].startswith("2-fold") and folded["held_out_by_iteration"][0]["steps"] == len(table)
    scheduler = load_scheduler(artifact)
    assert scheduler.decides == "step" and scheduler.feature_names[-2:] == ("kind_short", "kind_full")
    drafter, target = tiny_self_pair
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=12,
                          method_options={"scheduler": str(artifact), "verify_ms": 5.0, "strong_ms": 1.0})
    decoder = Pipeline(target=target, drafter=drafter).decoder(config)
    assert isinstance(decoder.method.policy, LearnedStepRule)
    prompt = Pipeline(target=target, drafter=drafter).encode_chat([{"role": "user", "content": "one two one two"}])
    assert decoder.generate(prompt).output_ids == reference_greedy(target, prompt, 12)
    replayed = invoke(["replay", "--rollouts", str(out), "--scheduler", str(artifact)])
    names = [r["policy"] for r in replayed["results"]]
    assert sorted(names) == sorted(["always-weak", "always-full", "always-short", "oracle", "collected", "rule", "learned"])
    assert all(math.isfinite(r["speedup"]) and r["speedup"] > 0 for r in replayed["results"])
    # the driving rule's weighing is stored with the step: what it took had the largest margin, unless it explored
    margins = [{k: row[f"rule_tau_{k}"] - row["rule_rate"] * row[f"rule_ms_{k}"] for k in ("weak", "short", "full")}
               for row in table]
    largest = [max(m, key=m.get) for m in margins]
    taken = [next(k for k in ("weak", "short", "full") if row[f"calls_kind_{k}"] == row["calls_real"]) for row in table]
    assert sum(a == b for a, b in zip(largest, taken, strict=True)) >= len(table) // 2
    # under the collection's profile the stored weighing is the rule's margin as it decided, whatever the labels charge
    for share in (CATCH_UP_SHARE, 1.0):
        priced = price_steps(table, costs, settings["tree"], "extended", share)
        for kind in ("short", "full"):
            assert priced.rule_margins[kind].tolist() == pytest.approx([m[kind] - m["weak"] for m in margins], abs=1e-4)
    residual = invoke(["distill", "--rollouts", str(out), "--out", str(tmp_path / "residual.json"), "--epochs", "20",
                       "--residual", "--cost", str(cost_file[0]), "--catch-up-share", "1", "--folds", "2"])
    policies = residual["held_out_by_iteration"][0]["policies"]
    corrector = load_scheduler(tmp_path / "residual.json")
    assert corrector.residual and corrector.feature_names[-3:] == ("kind_short", "kind_full", "rule_margin")
    # the shipped share of the correction is the one of least out-of-fold regret; share 0 decides as the rule
    share_regret = corrector.report["correction_scale_regret"]
    assert residual["correction_scale"] == corrector.correction_scale
    assert share_regret[str(corrector.correction_scale)] == min(share_regret.values())
    assert share_regret["0.0"] == pytest.approx(policies["rule"]["regret"])
    assert policies["mlp"]["regret"] == pytest.approx(min(share_regret.values()))
    config = dataclasses.replace(config, method_options={**config.method_options, "scheduler": str(tmp_path / "residual.json")})
    decoder = Pipeline(target=target, drafter=drafter).decoder(config)
    assert decoder.method.policy.residual
    assert decoder.generate(prompt).output_ids == reference_greedy(target, prompt, 12)


def test_distill_ships_the_share_of_a_correction_that_the_held_out_steps_bear_out():
    """Share 0 of a residual scheduler's correction is the rule itself: kept when the correction makes worse choices
    on the held-out steps, the whole correction kept when it mends the rule's."""
    kinds = ("weak", "full")
    values = {"weak": torch.tensor([1.0, 2.0, 1.0]), "full": torch.tensor([2.0, 1.0, 2.0])}  # full best at steps 0, 2
    right = {"weak": torch.zeros(3), "full": torch.tensor([1.0, -1.0, 1.0])}  # margins that pick the best kind

    def steps(rule: dict[str, torch.Tensor]) -> PricedSteps:
        return PricedSteps(values, torch.zeros(3, 1), ["weak"] * 3, values, values, torch.ones(3), rule)

    flipped = torch.stack([torch.zeros(3), -right["full"]])  # [kinds, n] a correction that turns every choice round
    scale, regret = choose_correction_scale([flipped], [steps(right)])
    assert scale == 0.0 and regret[0.0] == 0.0 and regret[1.0] == 1.0
    wrong = {"weak": torch.zeros(3), "full": -right["full"]}
    scale, regret = choose_correction_scale([torch.stack([right[k] for k in kinds])], [steps(wrong)])
    assert scale == 1.0 and regret[1.0] == 0.0 and regret[0.0] == 1.0


def test_a_residual_scheduler_adds_its_share_of_the_correction_and_keeps_it_in_the_artifact(tmp_path):
    """margin = rule's + share · correction; the share survives a save and load, and one outside [0, 1] is refused."""
    inputs = len(FEATURE_NAMES) + 3  # the paper's features, the kind one-hot, the rule's margin
    with torch.random.fork_rng():
        torch.manual_seed(0)
        mlp, features = build_mlp(inputs), torch.randn(4, inputs)
    normaliser = Normaliser(torch.zeros(inputs), torch.ones(inputs), 0.3, 2.0)
    scheduler = DistilledScheduler(mlp, normaliser, decides="step", residual=True)
    assert scheduler.feature_names[-1] == "rule_margin"
    whole = scheduler.predict(features)
    scheduler.correction_scale = 0.25
    assert torch.allclose(scheduler.predict(features), features[:, -1] + 0.25 * (whole - features[:, -1]), atol=1e-6)
    scheduler.correction_scale = 0.0
    assert torch.equal(scheduler.predict(features), features[:, -1])
    scheduler.save(tmp_path / "share.json")
    assert load_scheduler(tmp_path / "share.json").correction_scale == 0.0
    document = json.loads((tmp_path / "share.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**document, "correction_scale": 2.0}))
    with pytest.raises(ConfigError, match="malformed"):
        load_scheduler(tmp_path / "bad.json")


def test_a_residual_scheduler_without_a_correction_decides_as_the_step_rule():
    """A residual per-step scheduler's margin is the rule's own plus its correction: with none it takes the rule's
    kinds step for step, explorations included."""
    state = SchedulerState(tree=DraftTree.from_root(0), frontier=torch.zeros(1, dtype=torch.long), window=(0,),
                           layer=1, num_layers=4, called=(), prompt_length=10, costs=CostModel(40.0, 10.0, 20.0),
                           width=2, budget=8)
    uncorrected = LearnedStepRule(5, 0.8, lambda x: float(x[-1]), layers=(1, 2, 3), residual=True)
    uncorrected.explores_weak = False  # as the rule: the weak kind is measured at every step
    rule = StepRule(5, 0.8, layers=(1, 2, 3))
    taken = {id(rule): [], id(uncorrected): []}
    accepted = iter([3, 1, 1, 2, 4, 1, 1, 1, 2, 1, 3, 1] * 2)
    for policy in (rule, uncorrected):
        ticks = iter(range(100))
        policy.clock = lambda ticks=ticks: 0.05 * next(ticks)
        for tau in itertools.islice(accepted, 12):
            policy.decide(state)
            taken[id(policy)].append(policy.choice.name)
            policy.observe(state.tree, torch.zeros(tau, dtype=torch.long), torch.zeros(tau, dtype=torch.long))
    assert taken[id(rule)] == taken[id(uncorrected)] and len(set(taken[id(rule)])) > 1


def test_learned_layer_rule_decides_each_layer_and_measures_the_step_it_made():
    """Each layer calls iff its predicted margin clears ``min_margin``; the step's kind is the layers it called, whose
    time the rule measures, and only the step's first call is a catch-up."""
    tree = DraftTree.from_root(0)

    def state(layer: int, called: tuple[int, ...], lag: int = 0) -> SchedulerState:
        return SchedulerState(tree=tree, frontier=torch.zeros(1, dtype=torch.long), window=(0,),
                              layer=layer, num_layers=4, called=called, prompt_length=10,
                              costs=CostModel(40.0, 10.0), width=2, budget=8, strong_lag=lag)

    ticks = iter(range(100))
    # feature 4 is the layer fraction: layers 2 and 3 of 4 (0.4, 0.6) clear a margin of 0.3, layer 1 (0.2) does not
    rule = LearnedLayerRule(5, 0.8, lambda f: float(f[4]), min_margin=0.3)
    rule.clock = lambda: float(next(ticks))  # a second per step
    assert [rule.decide(state(1, ())), rule.decide(state(2, ())), rule.decide(state(3, (2,)))] == [False, True, True]
    assert rule.choice.layers == (2, 3) and not rule.weak_step and not rule.catching_up
    rule.observe(tree, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert rule.kinds["2,3"].tau == 3.0 and rule.kinds["2,3"].weight == 1.0 and rule.rate > 0
    # a step that calls nowhere is weak (the trim weighs it at ρ); a first call past MAX_LAG is a catch-up
    assert not rule.decide(state(1, ())) and rule.weak_step
    lagging = LearnedLayerRule(5, 0.8, lambda f: 1.0)
    assert lagging.decide(state(1, (), lag=MAX_LAG + 1)) and lagging.catching_up and lagging.choice.layers == (1,)
    assert lagging.decide(state(2, (1,), lag=MAX_LAG + 1)) and lagging.choice.layers == (1, 2)
    assert lagging.planned_calls(4) == 0  # no device run: every layer asks the scheduler


def test_learned_step_rule_takes_the_kind_of_largest_positive_margin():
    tree = DraftTree.from_root(0)
    state = SchedulerState(tree=tree, frontier=torch.zeros(1, dtype=torch.long), window=(0,),
                           layer=1, num_layers=4, called=(), prompt_length=10, costs=CostModel(40.0, 10.0), width=2, budget=8)

    def rule(short: float, full: float, min_margin: float = 0.0) -> LearnedStepRule:
        # the last two inputs are the kind one-hot (short, full)
        return LearnedStepRule(5, 0.8, lambda x: float(x[-2] * short + x[-1] * full), layers=(1, 2, 3),
                               min_margin=min_margin)

    assert rule(0.5, 1.0).choose(state).name == "full"
    assert rule(0.5, -1.0).choose(state).name == "short"
    assert rule(-0.5, -1.0).choose(state).name == "weak"
    assert rule(0.5, 1.0, min_margin=0.7).choose(state).name == "full"  # only full clears the margin
    assert rule(0.5, 0.6, min_margin=0.7).choose(state).name == "weak"  # neither gain beats the model's error


def explored_kinds(margin: float, steps: int) -> tuple[LearnedStepRule, list[str]]:
    """The kinds a per-step scheduler predicting ``margin`` for every strong kind takes over ``steps`` steps that each
    accept one token, exploring after 2 steps, and the scheduler."""
    state = SchedulerState(tree=DraftTree.from_root(0), frontier=torch.zeros(1, dtype=torch.long), window=(0,),
                           layer=1, num_layers=4, called=(), prompt_length=10, costs=CostModel(40.0, 10.0), width=2,
                           budget=8)
    rule = LearnedStepRule(5, 0.8, lambda x: margin, layers=(1, 2, 3))
    rule.explore = 2
    ticks = iter(range(100))
    rule.clock = lambda: float(next(ticks))  # a second per step: every kind's value is far below its upside
    taken = []
    for _ in range(steps):
        rule.decide(state)
        taken.append(rule.choice.name)
        rule.observe(state.tree, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return rule, taken


def test_learned_step_rule_explores_the_strong_kinds_it_stopped_taking():
    """A scheduler that always predicts a weak step still re-measures strong steps, as the rule does: each kind when
    its wait is over, and, having lost, after twice the wait."""
    rule, taken = explored_kinds(-1.0, 8)
    assert taken == ["weak", "weak", "full", "short", "weak", "weak", "weak", "full"]
    assert rule.kinds["short"].backoff == 2 and rule.kinds["full"].backoff == 2  # full's second one is not judged yet


def test_learned_step_rule_explores_the_weak_kind_it_stopped_taking():
    """A scheduler that always predicts a strong step still takes a weak one when its wait is over, so its history
    features learn what weak steps reach on this text; having lost, the weak kind waits twice as long."""
    rule, taken = explored_kinds(1.0, 9)
    assert taken == ["short", "short", "weak", "full", "short", "short", "short", "weak", "full"]
    assert rule.kinds["weak"].backoff == 4  # both weak explorations lost to the scheduler's next choice


def test_treegraft_on_a_modelled_clock_takes_the_same_steps_in_every_run(cost_file, tiny_self_pair):
    """``-o clock=PROFILE``: the step rule times each step at its modelled time under the profile instead of the
    wall clock, so two runs take the same steps and verify the same trees; the output stays plain greedy's, and a
    profile measured on another pair is refused."""
    drafter, target = tiny_self_pair
    profile = load_cost_profile(cost_file[0])
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=24,
                          method_options={"clock": str(cost_file[0])})
    pipeline = Pipeline(target=target, drafter=drafter)
    prompt = pipeline.encode_chat([{"role": "user", "content": "one two three one two three one two"}])
    runs = []
    for _ in range(2):
        decoder = pipeline.decoder(config)
        generation = decoder.generate(prompt)
        assert generation.output_ids == reference_greedy(target, prompt, 24)
        method = decoder.method
        assert method.policy.clock is method.clock and method.clock() > 0
        runs.append([(s.accepted_length, s.nodes_verified, s.drafter_calls) for s in generation.steps])
        strong_calls = sum(s.drafter_calls.get("model", 0) for s in generation.steps)
    assert runs[0] == runs[1]
    assert strong_calls > 0 and any(not s.drafter_calls.get("model") for s in generation.steps)
    with pytest.raises(ConfigError, match="measured on the pair"):
        check_profile_pair(profile, "qwen2.5-coder-0.5b:qwen2.5-coder-1.5b", "costs.yaml")
