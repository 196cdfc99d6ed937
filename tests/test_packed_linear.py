"""``--linear packed``: oneDNN-packed weights for multi-row forwards on CPU, exact like every other path."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompt
from typer.testing import CliRunner

from treegraft_cli.cli import app
from treegraft_cli.cli.resolve import resolve_run
from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.errors import ConfigError
from treegraft_cli.models import packed_linear
from treegraft_cli.models.load import load_pair
from treegraft_cli.models.packed_linear import PackedForward, check_linear, is_packed, pack_linears, resolve_linear
from treegraft_cli.pipeline import Pipeline
from treegraft_cli.profiles import load_profile, profile_document, profile_from_mapping

PAIR = "tiny-random@layers=2:tiny-random"


@pytest.fixture(scope="module")
def packed_pipeline() -> Pipeline:
    return Pipeline.load(PAIR, "fp32", "cpu", linear="packed")


def test_packed_layers_compute_what_the_default_ones_do():
    _, target = load_pair(PAIR, dtype="fp32")  # a fresh copy: packing changes the modules in place
    model = target.model
    tokens = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.inference_mode():
        default_rows, default_one = model(tokens).logits, model(tokens[:, :1]).logits
        assert not is_packed(model)
        packed = pack_linears(model)
        assert packed == sum(type(m) is torch.nn.Linear for m in model.modules()) and is_packed(model)
        assert pack_linears(model) == 0  # a second call (a drafter sharing these layers) packs nothing again
        packed_rows, packed_one = model(tokens).logits, model(tokens[:, :1]).logits
    torch.testing.assert_close(packed_rows, default_rows, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed_one, default_one)  # one row keeps the default kernel
    assert all(isinstance(m.forward, PackedForward) for m in model.modules() if type(m) is torch.nn.Linear)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernel on this CPU")
def test_packed_bf16_layers_compute_bit_for_bit_what_the_default_ones_do():
    _, target = load_pair(PAIR, dtype="bf16")
    model = target.model
    tokens = torch.randint(0, model.config.vocab_size, (1, 9))
    calls = []
    with torch.inference_mode():
        default_rows, default_one = model(tokens).logits, model(tokens[:, :1]).logits
        pack_linears(model)
        original = torch.ops.mkldnn._linear_pointwise
        try:  # count the packed products: in bf16 one row takes the packed weight too
            torch.ops.mkldnn._linear_pointwise = lambda *args: calls.append(args[0].shape[-2]) or original(*args)
            packed_rows, packed_one = model(tokens).logits, model(tokens[:, :1]).logits
        finally:
            torch.ops.mkldnn._linear_pointwise = original
    assert torch.equal(packed_rows, default_rows) and torch.equal(packed_one, default_one)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert sorted(set(calls)) == [1, 9] and len(calls) == 2 * linears


@pytest.mark.parametrize("method, compile", [("dense", "off"), ("graft", "off"), ("treegraft", "off"), ("chain", "off"),
                                             ("dense", "static")])
def test_greedy_output_with_packed_linears_equals_plain_greedy(packed_pipeline, method, compile):
    prompt = random_prompt(5)
    config = DecodeConfig(tree=TreeConfig(budget=12, depth=4, top_k=3), max_new_tokens=40, compile=compile)
    plain = packed_pipeline.decoder(DecodeConfig(method="ar", max_new_tokens=40)).generate(prompt).output_ids
    speculative = packed_pipeline.decoder(DecodeConfig(**{**config.__dict__, "method": method})).generate(prompt)
    assert speculative.output_ids == plain
    assert max(step.nodes_verified for step in speculative.steps) > 1  # multi-row forwards ran (the packed kernel)


@pytest.mark.parametrize("linear, dtype, device, needle", [
    ("packed", "fp16", "cpu", "fp32 or bf16 only"),
    ("packed", "fp32", "cuda", "CPU kernel"),
    ("fast", "fp32", "cpu", "unknown --linear"),
])
def test_packed_linears_are_refused_where_they_cannot_run(linear, dtype, device, needle):
    with pytest.raises(ConfigError) as error:
        check_linear(linear, dtype, device)
    assert needle in error.value.message
    assert ("--dtype fp32" in error.value.hint) or ("default" in error.value.hint)
    check_linear("default", dtype, device)  # the default runs everywhere


def test_packed_linears_are_refused_with_inductor_but_run_with_static_shapes():
    with pytest.raises(ConfigError, match="--compile compile") as error:
        check_linear("packed", "fp32", "cpu", "compile")
    assert "--compile static" in error.value.hint
    check_linear("packed", "fp32", "cpu", "static")


def test_bench_refuses_packed_fp16_before_loading_a_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(Pipeline, "load", classmethod(refuse))
    result = CliRunner().invoke(app, ["bench", "--pair", PAIR, "--linear", "packed", "--dtype", "fp16"])
    assert isinstance(result.exception, ConfigError) and "fp32 or bf16 only" in result.exception.message


def test_bf16_packing_is_refused_where_onednn_has_no_bf16_kernel(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(ConfigError, match="no bf16 kernel") as error:
        check_linear("packed", "bf16", "cpu")
    assert "--dtype fp32" in error.value.hint


def test_bench_records_the_linear_kernels(tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["Count to five."]}) + "\n")
    result = CliRunner().invoke(app, ["bench", "--pair", PAIR, "--methods", "dense", "--prompts", str(prompts), "-n", "8",
                                      "--dtype", "fp32", "--linear", "packed", "--out", str(tmp_path / "out"), "--no-plots"])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["linear"] == "packed" and results["lossless"] is True


def test_a_profile_may_ask_for_packed_linears():
    profile = profile_from_mapping({"pair": PAIR, "dtype": "fp32", "linear": "packed"}, "p.yaml")
    assert profile.linear == "packed" and profile_document(profile)["linear"] == "packed"
    assert "linear" not in profile_document(profile_from_mapping({"pair": PAIR}, "q.yaml"))
    with pytest.raises(ConfigError, match="linear 'fast'"):
        profile_from_mapping({"pair": PAIR, "linear": "fast"}, "r.yaml")


@pytest.mark.parametrize("dtype, device, compile, native, expected", [
    ("bf16", "cpu", "off", True, "packed"),
    ("bf16", "cpu", "static", True, "packed"),
    ("bf16", "cpu", "compile", True, "default"),  # Inductor packs weights itself
    ("bf16", "cpu", "off", False, "default"),  # emulated bf16: not measured to pay
    ("fp32", "cpu", "off", False, "packed"),  # several fp32 rows are faster packed on every CPU measured
    ("bf16", "cuda", "off", True, "default"),
])
def test_auto_linears_are_packed_where_they_were_measured_to_pay(monkeypatch, dtype, device, compile, native, expected):
    monkeypatch.setattr(packed_linear, "native_bf16", lambda: native)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert resolve_linear("auto", dtype, device, compile) == expected
    assert resolve_linear("default", dtype, device, compile) == "default"


def test_the_qwen_pairs_profile_packs_its_linears_where_that_pays():
    def run(dtype=None, linear=None):
        return resolve_run("qwen2.5-coder-0.5b:qwen2.5-coder-1.5b", None, dtype, None, None, None, None, None, None,
                           linear=linear)

    assert load_profile("qwen2.5-coder-0.5b--1.5b").linear == "auto"
    assert run().dtype == "bf16" and run().linear == resolve_linear("auto", "bf16", "cpu")  # what this machine gets
    assert run(dtype="fp32").linear == resolve_linear("auto", "fp32", "cpu") and run(linear="default").linear == "default"
