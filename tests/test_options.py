"""Method options and settings: every value is checked against its field's type in one place (from_mapping)."""

from __future__ import annotations

import pytest

from treegraft_cli.config import DecodeConfig, TreeConfig, from_mapping, parse_options
from treegraft_cli.errors import ConfigError
from treegraft_cli.methods import METHODS


def options(method: str, *pairs: str):
    return METHODS[method].parse_options(parse_options(pairs))


@pytest.mark.parametrize(
    "method, pair, needles",
    [
        ("graft", "thresholds=notalist", ["graft.thresholds must be a list of numbers", 'the string "notalist"']),
        ("graft", "thresholds=[0.3,x,0.1]", ["graft.thresholds must be a list of numbers"]),
        ("graft", "templates=[3,[x]]", ["graft.templates must be a list of lists of integers"]),
        ("graft", "table_k=true", ["graft.table_k must be an integer", "the boolean true"]),
        ("treegraft", "call_budget=2.5", ["treegraft.call_budget must be an integer", "the number 2.5"]),
        ("treegraft", "hit_rate=high", ["treegraft.hit_rate must be a number"]),
        ("fixed", "layers=[1.5]", ["fixed.layers must be a list of integers"]),
        ("treegraft", "policy=", ["treegraft.policy must be a string, not null"]),
    ],
)
def test_wrong_type_names_the_field_and_the_expected_type(method, pair, needles):
    with pytest.raises(ConfigError) as error:
        options(method, pair)
    for needle in needles:
        assert needle in error.value.message
    assert "give" in error.value.hint and "the default is" in error.value.hint


def test_short_forms_are_read_as_lists():
    graft = options("graft", "checkpoints=0,2", "thresholds=0.3,0.1", "draft_nodes=[8,16]")
    assert graft.checkpoints == (0, 2) and graft.thresholds == (0.3, 0.1) and graft.draft_nodes == (8, 16)
    assert options("fixed", "layers=3").layers == (3,)
    assert options("treegraft", "hit_rate=1").hit_rate == 1.0 and isinstance(options("treegraft", "hit_rate=1").hit_rate, float)


def test_nested_settings_are_checked_with_their_path():
    config = from_mapping(DecodeConfig, {"tree": {"budget": 7}, "sampling": {"temperature": 1}})
    assert config.tree == TreeConfig(budget=7) and config.sampling.temperature == 1.0
    with pytest.raises(ConfigError, match=r"run\.tree\.depth must be an integer, not the string \"deep\""):
        from_mapping(DecodeConfig, {"tree": {"depth": "deep"}}, "run")
    with pytest.raises(ConfigError, match=r"run\.method_options must be a mapping"):
        from_mapping(DecodeConfig, {"method_options": [1]}, "run")
    with pytest.raises(ConfigError, match=r"^run\.tree: tree budget 0 < 1"):
        from_mapping(DecodeConfig, {"tree": {"budget": 0}}, "run")


def test_a_negative_fallback_penalty_is_refused():
    """A chain token outside the target's top-W would score above its parent: the cut to the budget keeps parents
    ahead of their children only while no score rises down a path."""
    with pytest.raises(ConfigError, match="fallback_penalty must be >= 0"):
        options("treegraft", "fallback_penalty=-1")
    assert options("treegraft", "fallback_penalty=0").fallback_penalty == 0.0
