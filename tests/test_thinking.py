"""--thinking/--no-thinking: the chat template's enable_thinking switch, from the CLI and the Qwen3 profiles."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

from treegraft_cli.cli import app
from treegraft_cli.cli.resolve import resolve_run
from treegraft_cli.models.tiny import byte_level_tokenizer
from treegraft_cli.pipeline import Pipeline
from treegraft_cli.profiles import load_profile, profile_names

# Qwen3's switch, reduced to what it renders: an empty think block when thinking is turned off
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)


def rendered(thinking: bool | None) -> str:
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    pipeline = Pipeline(target=type("Loaded", (), {"tokenizer": tokenizer})(), drafter=None, thinking=thinking)
    return tokenizer.decode(pipeline.encode_chat([{"role": "user", "content": "hi"}]).tolist())


def test_no_thinking_reaches_the_chat_template():
    assert rendered(False).endswith("assistant\n<think></think>")
    assert "<think>" not in rendered(True)
    assert "<think>" not in rendered(None)  # the template's own default


@pytest.mark.parametrize(("flag", "expected"), [("--no-thinking", False), ("--thinking", True), (None, None)])
def test_generate_passes_the_switch_to_apply_chat_template(monkeypatch, flag, expected):
    seen = []
    original = PreTrainedTokenizerFast.apply_chat_template

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("enable_thinking", "absent"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "apply_chat_template", recording)
    args = ["generate", "--pair", "tiny-random", "-p", "hi", "-n", "2", "--dtype", "fp32", "-m", "ar", "--json"]
    result = CliRunner().invoke(app, args + ([flag] if flag else []))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == ["absent" if expected is None else expected]


def test_qwen3_profiles_turn_thinking_off_and_the_flag_overrides():
    names = [name for name in profile_names() if name.startswith("qwen3-")]
    assert names
    for name in names:
        assert load_profile(name).thinking is False, name
    assert resolve_run(None, names[0], None, None, None, None, None, None, None).thinking is False
    assert resolve_run(None, names[0], None, None, None, None, None, None, None, True).thinking is True
    assert resolve_run("tiny-random", None, None, None, None, None, None, None, None).thinking is None
