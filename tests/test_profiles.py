"""Every bundled profile validates; malformed profiles name the field; --pair resolves through profiles."""

from __future__ import annotations

import pytest

from treegraft_cli.cli.resolve import resolve_run
from treegraft_cli.errors import ConfigError
from treegraft_cli.pipeline import DEFAULT_PAIR
from treegraft_cli.profiles import (
    dump_profile,
    load_profile,
    load_profile_file,
    profile_for_pair,
    profile_from_mapping,
    profile_names,
    profiles_dir,
)

PAPER_PAIRS = {
    *(f"{d}:{t}" for d in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b") for t in ("qwen3-8b", "qwen3-32b") if d != t),
    *(f"{d}:{t}" for d in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b") for t in ("llama-3.1-8b", "llama-3.3-70b") if d != t),
    "qwen3-8b:qwen3-235b",
}


@pytest.mark.parametrize("path", sorted(profiles_dir().glob("*.yaml")), ids=lambda p: p.stem)
def test_every_bundled_profile_validates_and_round_trips(path):
    profile = load_profile_file(path)
    assert profile.name == path.stem
    again = profile_from_mapping(__import__("yaml").safe_load(dump_profile(profile)), "round trip")
    assert again.decode == profile.decode and again.method_options == profile.method_options


def test_profiles_cover_local_and_paper_pairs():
    pairs = {load_profile(name).pair for name in profile_names()}
    assert PAPER_PAIRS <= pairs
    assert {DEFAULT_PAIR, "qwen2.5-coder-0.5b:qwen2.5-coder-1.5b"} <= pairs


@pytest.mark.parametrize(
    "document, field",
    [
        ({"decode": {}}, "pair"),
        ({"pair": "a:b", "decode": {"tree": {"budget": "many"}}}, "decode.tree.budget"),
        ({"pair": "a:b", "decode": {"tree": {"budget": 0}}}, "decode.tree"),
        ({"pair": "a:b", "decode": {"sampling": {"temprature": 0}}}, "temprature"),
        ({"pair": "a:b", "dtype": "fp8"}, "dtype"),
        ({"pair": "a:b", "method_options": {"graft": 3}}, "method_options"),
        ({"pair": "a:b", "colour": "red"}, "colour"),
    ],
)
def test_malformed_profile_names_the_field(document, field):
    with pytest.raises(ConfigError, match=field) as error:
        profile_from_mapping(document, "bad.yaml")
    assert "bad.yaml" in error.value.message and error.value.hint


def test_unknown_profile_lists_the_bundled_ones():
    with pytest.raises(ConfigError) as error:
        load_profile("nosuch")
    assert "smollm2-135m-self" in error.value.hint


def test_pair_resolves_through_its_profile_and_options_override():
    assert profile_for_pair("qwen3-8b:qwen3-235b").decode.tree.budget == 63
    run = resolve_run("qwen3-8b:qwen3-235b", None, None, None, None, None, None, 4, None)
    assert run.profile_name == "qwen3-8b--qwen3-235b" and run.device == "auto"
    assert run.config.tree.budget == 63 and run.config.tree.depth == 4 and run.config.max_new_tokens == 256
    assert run.method_options["treegraft"]["call_budget"] == 5
    default = resolve_run(None, None, None, None, 64, None, None, None, None)
    assert default.pair == DEFAULT_PAIR and default.profile_name == "smollm2-135m-self"
    assert default.config.max_new_tokens == 64
    bare = resolve_run("tiny-random", None, "fp32", None, None, None, None, None, None)
    assert bare.profile_name is None and bare.config.tree.budget == 60


def test_method_option_typo_names_the_field():
    from treegraft_cli.profiles import profile_from_mapping

    document = {"pair": "tiny-random@layers=2:tiny-random", "method_options": {"graft": {"treshold": [0.3]}}}
    with pytest.raises(ConfigError, match="method_options.graft"):
        profile_from_mapping(document, "p.yaml")
    document["method_options"] = {"warp-drive": {}}
    with pytest.raises(ConfigError, match="no such method"):
        profile_from_mapping(document, "p.yaml")
