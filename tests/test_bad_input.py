"""Bad input a new user types: every command refuses it before loading a model, with one line naming the fix.

Each case runs the real CLI entry point with model loading replaced by a function that fails the test, so
a check that happens only after the load (or not at all) is caught. Nothing may be written to ``--out``.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from treegraft_cli import pipeline
from treegraft_cli.cli import main
from treegraft_cli.models import load

PAIR = "tiny-random@layers=2:tiny-random"
GOOD = {"question_id": 1, "category": "writing", "turns": ["Say hi."]}


LOAD_PIPELINE = pipeline.Pipeline.__dict__["load"]


class ModelLoaded(Exception):
    """Raised by the stand-in loader: the command got as far as loading a model."""


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise ModelLoaded("a model was loaded before the input was checked")

    monkeypatch.setattr(pipeline.Pipeline, "load", classmethod(refuse))
    monkeypatch.setattr(load, "_load", refuse)  # the weights, also when load_pair itself runs


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["treegraft", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


def assert_refused(args, capsys, monkeypatch, *needles: str) -> str:
    code, err = run_cli(args, capsys, monkeypatch)
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    first = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    assert lines[first + 1 :] and any(line.startswith("fix:") for line in lines[first + 1 :]), err
    message = " ".join(" ".join(lines[first:]).split())  # Rich wraps long lines
    for needle in needles:
        assert needle in message, message
    return message


def prompts_file(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def commands(prompts: Path, out: Path) -> dict[str, list[str]]:
    """One invocation per command that reads prompts, before the case's own options."""
    return {
        "bench": ["bench", "--pair", PAIR, "--prompts", prompts, "--out", out, "--no-plots"],
        "tune": ["tune", "--pair", PAIR, "--prompts", prompts, "--out", out / "p.yaml", "--trials", "1",
                 "--validation-prompts", "0"],
        "collect": ["collect", "--pair", PAIR, "--prompts", prompts, "--out", out],
    }


@pytest.mark.parametrize("command", ["bench", "tune", "collect"])
@pytest.mark.parametrize(
    "lines, needles",
    [
        ([json.dumps(GOOD), json.dumps(GOOD), "{not json"], [":3: not JSON", "one JSON object a line"]),
        ([json.dumps(GOOD), json.dumps({"question_id": 2, "category": "x"})], [":2: field 'turns'", '"turns": ["user message"']),
        ([json.dumps(GOOD), json.dumps({"question_id": 2, "turns": []})], [":2: field 'turns' must be a non-empty list"]),
        ([], ["holds no questions"]),
    ],
    ids=["later-line-not-json", "no-turns", "empty-turns", "empty-file"],
)
def test_bad_prompts_file_is_refused_whole(command, lines, needles, tmp_path, capsys, monkeypatch):
    prompts = prompts_file(tmp_path / "q.jsonl", *lines)
    out = tmp_path / "out"
    args = commands(prompts, out)[command] + ["--num-prompts", "1"]
    assert_refused(args, capsys, monkeypatch, *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["generate", "-p", "hi", "--budget", "0"], ["tree budget 0 < 1", "--budget 1 or more"]),
        (["bench", "--budget", "0"], ["tree budget 0 < 1", "--budget 1 or more"]),
        (["collect", "--budget", "0"], ["tree budget 0 < 1", "--budget 1 or more"]),
        (["generate", "-p", "hi", "--depth", "-2"], ["tree depth -2 < 1", "--depth 1 or more"]),
        (["bench", "--depth", "-2"], ["tree depth -2 < 1"]),
        (["collect", "--depth", "-2"], ["tree depth -2 < 1"]),
        (["generate", "-p", "hi", "--max-new-tokens", "-5"], ["max new tokens -5 < 1", "--max-new-tokens 1 or more"]),
        (["bench", "--max-new-tokens", "0"], ["max new tokens 0 < 1"]),
        (["tune", "--max-new-tokens", "-1"], ["max new tokens -1 < 1"]),
        (["collect", "--max-new-tokens", "-1"], ["max new tokens -1 < 1"]),
        (["generate", "-p", "hi", "--temperature", "-0.5"], ["temperature -0.5 < 0", "--temperature 0"]),
        (["bench", "--temperature", "-1"], ["temperature -1.0 < 0"]),
        (["generate", "-p", "hi", "-m", "graft", "-o", "treshold=[0.3]"], ["graft: unknown setting(s) treshold", "thresholds"]),
        (["collect", "-o", "lookbak=3"], ["treegraft: unknown setting(s) lookbak", "lookback"]),
        (["generate", "-p", "hi", "-m", "dense", "-o", "depth=3"], ["method 'dense' takes no options"]),
        (["generate", "-p", "hi", "-m", "graft", "-o", "thresholds=notalist"],
         ["graft.thresholds must be a list of numbers, not the string \"notalist\""]),
        (["generate", "-p", "hi", "-m", "fixed"], ["'fixed' needs the tree layers", "fixed:1,3"]),
        (["generate", "-p", "hi", "-m", "treegraft:fixed"], ["'fixed' needs the tree layers", "fixed:1,3"]),
        (["bench", "--methods", "dense,fixed"], ["'fixed' needs the tree layers"]),
        (["generate", "-p", "hi", "-m", "treegraft:warp"], ["unknown call policy 'warp'", "cost-aware"]),
        (["collect", "--policy", "warp"], ["unknown call policy 'warp'"]),
        (["collect", "--continuation", "warp"], ["unknown call policy 'warp'"]),
        (["bench", "--scheduler", "/no/such/scheduler.json"], ["scheduler /no/such/scheduler.json does not exist", "treegraft distill"]),
        (["bench", "--tolerance", "2"], ["tolerance 2.0 outside [0, 1)"]),
        (["bench", "--methods", "dense", "--pair", "tiny-random"], ["method 'dense' needs a model drafter", "--pair DRAFTER:TARGET"]),
        (["generate", "-p", "hi", "-m", "dense", "--pair", "tiny-random"], ["method 'dense' needs a model drafter"]),
        (["bench", "--methods", "hf-assisted", "--pair", "tiny-random"], ["peer 'hf-assisted' needs a drafter"]),
        (["bench", "--methods", "hf-lookup", "--temperature", "0.7"], ["peer 'hf-lookup' is benchmarked greedy only"]),
    ],
)
def test_bad_setting_is_refused_before_loading(args, needles, tmp_path, capsys, monkeypatch):
    prompts = prompts_file(tmp_path / "q.jsonl", json.dumps(GOOD))
    out = tmp_path / "out"
    command = args[0]
    full = list(args)
    if "--pair" not in full:
        full += ["--pair", PAIR]
    if command in ("bench", "tune", "collect"):
        full += ["--prompts", prompts, "--out", out / "p.yaml" if command == "tune" else out]
    assert_refused(full, capsys, monkeypatch, *needles)
    assert not out.exists()


def test_unknown_method_option_in_a_profile_fails_bench_and_tune(tmp_path, capsys, monkeypatch):
    profile = tmp_path / "p.yaml"
    profile.write_text(f"pair: {PAIR}\nmethod_options:\n  graft: {{thresholds: notalist}}\n", encoding="utf-8")
    assert_refused(["bench", "--profile", profile], capsys, monkeypatch, "method_options.graft.thresholds must be a list of numbers")


@pytest.mark.parametrize(
    "content, needles",
    [
        (b"<html>not json</html>", ["is not JSON", "results.json written by `treegraft bench`"]),
        (b"\xff\xfe\x00garbage", ["is not JSON (not UTF-8 text)"]),
        (b"[1, 2, 3]", ["has no 'methods' object"]),
        (b'{"methods": {"dense": 3}}', ["methods.dense is not an object"]),
        (b'{"methods": {"dense": {"speedup": "fast"}}}', ["methods.dense.speedup is not a number"]),
        (b'{"methods": {"dense": {}}}', ["holds no method with a speedup or tau"]),
        (None, ["cannot read baseline", "results.json written by `treegraft bench`"]),
    ],
    ids=["html", "binary", "list", "entry-not-object", "speedup-string", "no-metrics", "directory"],
)
def test_garbage_baseline_is_refused_before_the_run(content, needles, tmp_path, capsys, monkeypatch):
    baseline = tmp_path / "baseline.json"
    if content is None:
        baseline.mkdir()
    else:
        baseline.write_bytes(content)
    prompts = prompts_file(tmp_path / "q.jsonl", json.dumps(GOOD))
    args = ["bench", "--pair", PAIR, "--prompts", prompts, "--out", tmp_path / "out", "--check-against", baseline]
    assert_refused(args, capsys, monkeypatch, *needles)


def read_only_dirs(tmp_path: Path) -> list[tuple[Path, str]]:
    """Places ``--out`` cannot be written, as (path, what the message says): a file in the way always; a
    read-only directory when not root (root writes anyway); /sys, which refuses new files even to root."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    places = [(blocker / "out", "is a file, not a directory")]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        places.append((locked / "out", "does not accept new files"))
    if Path("/sys/kernel").is_dir():
        places.append((Path("/sys/treegraft-out"), "does not accept new files"))
    return places


@pytest.mark.parametrize("command", ["bench", "tune", "collect", "profile", "distill"])
def test_unwritable_out_is_refused_before_loading(command, tmp_path, capsys, monkeypatch):
    prompts = prompts_file(tmp_path / "q.jsonl", json.dumps(GOOD))
    for out, needle in read_only_dirs(tmp_path):
        args = {
            "bench": ["bench", "--pair", PAIR, "--prompts", prompts, "--out", out],
            "tune": ["tune", "--pair", PAIR, "--prompts", prompts, "--out", out / "p.yaml", "--validation-prompts", "0"],
            "collect": ["collect", "--pair", PAIR, "--prompts", prompts, "--out", out],
            "profile": ["profile", "--pair", PAIR, "--out", out / "cost.yaml"],
            "distill": ["distill", "--rollouts", tmp_path, "--out", out / "s.json"],
        }[command]
        assert_refused(args, capsys, monkeypatch, f"cannot write to {out}", needle, "--out")


def test_tokenizer_families_differ_refused_before_any_fetch(capsys, monkeypatch):
    def no_fetch(*args, **kwargs):
        raise ModelLoaded("a model was fetched before the pair was checked")

    monkeypatch.setattr(pipeline.Pipeline, "load", LOAD_PIPELINE)  # the real pair loader; no fetch, no weights
    monkeypatch.setattr(load, "fetch_wheel_gguf", no_fetch)
    assert_refused(["generate", "-p", "hi", "--pair", "smollm2-135m:qwen2.5-coder-1.5b"], capsys, monkeypatch,
                   "tokenizer mismatch", "smollm2 tokenizer", "qwen2.5 tokenizer", "drafter of the target's family")


def test_tokenizer_mismatch_refused_before_weights_load(tmp_path, capsys, monkeypatch, tiny_pair):
    _, target = tiny_pair
    other = tmp_path / "other-vocab"
    target.model.save_pretrained(other)
    changed = target.tokenizer.__class__.from_pretrained(str(_saved_tokenizer(target, tmp_path)))
    changed.add_tokens(["<extra-token>"])
    changed.save_pretrained(other)
    monkeypatch.setattr(pipeline.Pipeline, "load", LOAD_PIPELINE)  # the real pair loader, tokenizers only
    monkeypatch.setattr(load.AutoModelForCausalLM, "from_pretrained", _fail_weights)
    assert_refused(["generate", "-p", "hi", "--pair", f"{other}:tiny-random", "-n", "2"], capsys, monkeypatch,
                   "tokenizer mismatch", "different vocabularies")


def _saved_tokenizer(target, tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer"
    target.tokenizer.save_pretrained(path)
    return path


def _fail_weights(*args, **kwargs):
    raise ModelLoaded("weights were loaded before the tokenizers were compared")
