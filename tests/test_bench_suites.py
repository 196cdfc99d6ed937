"""Bench suites: the shipped data, Spec-Bench categories and ids, datasets through `hf:`, checks before loading."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from typer.testing import CliRunner

from treegraft_cli.bench import BENCHMARKS, data_dir, suite_questions
from treegraft_cli.bench.answers import answer_lines
from treegraft_cli.bench.hub import parse_spec
from treegraft_cli.bench.machine import (
    BusyProcess,
    MachineLoad,
    cpu_flags,
    emulated_dtype_warning,
    native_dtypes,
    shares_cores,
)
from treegraft_cli.bench.plots import series_colours
from treegraft_cli.bench.records import ContenderRecord, QuestionRecord, TurnRecord
from treegraft_cli.cli import app, console
from treegraft_cli.config import DecodeConfig
from treegraft_cli.engine import Generation
from treegraft_cli.errors import ConfigError
from treegraft_cli.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def spec_bench_selects(answer: dict, task: str) -> bool:
    """The selection rule of Spec-Bench's evaluation/speed.py: MT-Bench's eight categories form task
    'mt_bench', every other task is the category of the same name."""
    if task == "mt_bench":
        return answer["category"] in MT_BENCH_CATEGORIES
    return answer["category"] == task


def test_shipped_suites_are_package_data():
    assert data_dir() == Path(__file__).resolve().parents[1] / "treegraft_cli" / "bench" / "data"
    assert (data_dir() / "README.md").read_text().count("|") > 20  # the licence table travels with the files
    full = suite_questions("full")
    assert len(full) == 480 and {q.benchmark for q in full} == set(BENCHMARKS)
    assert [q.benchmark for q in suite_questions("quick")] == list(BENCHMARKS)  # the first question of each


def test_answers_keep_the_six_benchmarks_apart_under_spec_bench():
    questions = suite_questions("full")
    record = ContenderRecord("ar", "method", DecodeConfig())
    for q in questions:
        turns = [TurnRecord(None, Generation(prompt_length=1, output_ids=[1], wall_s=1.0), "x") for _ in q.turns]
        record.questions.append(QuestionRecord(q, turns))
    answers = answer_lines(record)
    ids = [a["question_id"] for a in answers]
    assert len(set(ids)) == len(ids) == 480  # unique across the six files
    tasks = {"mt_bench": "mt_bench", "gsm8k": "math_reasoning", "cnn_dm": "summarization", "qa": "qa",
             "humaneval": "humaneval", "alpaca": "alpaca"}
    for benchmark, task in tasks.items():
        chosen = {a["benchmark"] for a in answers if spec_bench_selects(a, task)}
        assert chosen == {benchmark}, (task, chosen)
    gsm8k = next(a for a in answers if a["benchmark"] == "gsm8k")
    assert gsm8k["source_category"] == "math" and gsm8k["source_question_id"] == 0 and gsm8k["question_id"] == "gsm8k/0"


def test_hf_suite_loads_a_saved_dataset_and_a_data_file(tmp_path):
    import datasets

    rows = {"question_id": [5, 6], "turns": [["What is 2+2?"], ["Hi.", "Again."]], "category": ["math_reasoning", "chat"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    saved = suite_questions(f"hf:{tmp_path / 'saved'}")
    assert [(q.benchmark, q.question_id, q.category, q.turns) for q in saved] == [
        ("saved", 5, "math_reasoning", ("What is 2+2?",)), ("saved", 6, "chat", ("Hi.", "Again."))]
    plain = tmp_path / "gsm.jsonl"
    plain.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(3)))
    loaded = suite_questions(f"hf:{plain}", num_prompts=2)
    assert [(q.benchmark, q.question_id, q.category, q.turns) for q in loaded] == [
        ("gsm", 0, "gsm", ("q0",)), ("gsm", 1, "gsm", ("q1",))]
    assert len(suite_questions(f"hf:{plain}:train")) == 3
    empty = tmp_path / "noprompt.jsonl"
    empty.write_text(json.dumps({"answer": "a"}) + "\n")
    with pytest.raises(ConfigError, match="no prompt"):
        suite_questions(f"hf:{empty}")


def test_hf_suite_names_the_fix_when_the_hub_is_unreachable(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what an unreachable hub looks like, at once
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as error:
        suite_questions("hf:nosuch-org/nosuch-dataset:test")
    assert "nosuch-org/nosuch-dataset" in error.value.message and "save_to_disk" in error.value.hint
    assert parse_spec("openai/gsm8k@main:test") == ("openai/gsm8k", "main", "test")
    assert parse_spec("openai/gsm8k") == ("openai/gsm8k", None, None)


def _no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(Pipeline, "load", classmethod(refuse))


@pytest.mark.parametrize("extra, needle", [
    (["--out", "{file}/sub"], "is a file, not a directory"),
    (["--methods", "graft", "-o", "graft.nosuch=1"], "nosuch"),
    (["--methods", "graft", "-o", "dense.table_k=4"], "does not include"),
    (["--methods", "graft", "-o", "thresholds=[0.1]"], "METHOD.KEY=VALUE"),
    (["--methods", "fixed:x"], "must be a list of integers"),
    (["--repeats", "0"], "--repeats"),
    (["--tolerance", "1.5"], "--tolerance"),
])
def test_bad_bench_input_fails_before_any_model_loads(extra, needle, tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = ["bench", "--pair", "tiny-random@layers=2:tiny-random", "--suite", "qa", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args + [a.format(file=blocker) for a in extra])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError) and needle in str(result.exception), result.exception


def test_peer_without_a_drafter_fails_before_any_model_loads(monkeypatch):
    _no_model_load(monkeypatch)
    result = CliRunner().invoke(app, ["bench", "--pair", "tiny-random", "--methods", "hf-assisted,graft"])
    assert isinstance(result.exception, ConfigError) and "hf-assisted" in result.exception.message


def test_machine_load_warnings():
    quiet = MachineLoad(torch_threads=2, cpus=2, load_average=(0.1, 0.1, 0.1), busy=())
    assert quiet.warnings() == []
    busy = MachineLoad(torch_threads=2, cpus=2, load_average=(2.0, 2.0, 2.0), busy=(BusyProcess(7, "python", 1.0),))
    found = busy.warnings()
    assert len(found) == 2 and "python (pid 7" in found[0] and "OMP_NUM_THREADS=1" in found[1]
    assert len(busy.warnings(device="cuda")) == 1  # thread contention is a CPU concern
    assert busy.to_json()["free_cores"] == 1.0


ZEN3_CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
SAPPHIRE_RAPIDS_CPUINFO = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16\n"
GRAVITON3_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd asimdhp sve bf16 i8mm\n"


def test_a_dtype_the_cpu_only_emulates_is_warned_about():
    zen3, spr, graviton = (cpu_flags(text) for text in (ZEN3_CPUINFO, SAPPHIRE_RAPIDS_CPUINFO, GRAVITON3_CPUINFO))
    assert native_dtypes(zen3) == [] and native_dtypes(spr) == ["bf16", "fp16"] and native_dtypes(graviton) == ["bf16", "fp16"]
    warning = emulated_dtype_warning("bf16", "cpu", zen3)
    assert warning is not None and "--dtype fp32" in warning and "avx512_bf16" in warning
    assert emulated_dtype_warning("fp16", "cpu", zen3) is not None
    for quiet in (("bf16", "cpu", spr), ("bf16", "cpu", graviton), ("fp32", "cpu", zen3), ("bf16", "cuda", zen3),
                  ("bf16", "cpu", None)):  # native, fp32, not a CPU run, flags unknown
        assert emulated_dtype_warning(*quiet) is None, quiet
    assert cpu_flags("processor\t: 0\n") is None and native_dtypes(None) is None


def test_a_process_pinned_to_other_cores_does_not_count_as_busy():
    class Pinned:
        def __init__(self, cores):
            self.cores = cores

        def cpu_affinity(self):
            return self.cores

    assert not shares_cores(Pinned([1]), {0})  # one benchmark per core: taskset -c 0 and taskset -c 1
    assert shares_cores(Pinned([0, 1]), {0})
    assert shares_cores(Pinned([1]), None)  # affinity unknown: assume it competes


def test_every_plot_series_gets_its_own_colour():
    for count in (3, 12, 25, 40):
        names = ["ar", *(f"m{i}" for i in range(count - 1))]
        colours = series_colours(names)
        assert len({tuple(c) if not isinstance(c, str) else c for c in colours.values()}) == count


def test_plain_progress_lines_when_stderr_is_not_a_terminal(tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 3, "turns": ["Hello there."]}) + "\n")
    result = CliRunner().invoke(app, ["bench", "--pair", "tiny-random@layers=2:tiny-random", "--methods", "ngram",
                                      "--prompts", str(prompts), "-n", "4", "--dtype", "fp32", "--out",
                                      str(tmp_path / "out"), "--no-plots"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert any(line.startswith("[0/2] ar · q #3") for line in lines)
    assert any(line.startswith("[1/2] ngram · q #3") for line in lines)
    assert any(line.startswith("estimated time: about") for line in lines)
    environment = json.loads((tmp_path / "out" / "results.json").read_text())["environment"]
    assert environment["torch_threads"] >= 1 and set(environment["machine_load"]) == {"start", "end"}


def test_time_left_is_judged_per_phase(monkeypatch, capsys):
    """A second phase (tune's validation after its trials) counts from 0 again: its estimate must not use
    the first phase's time."""
    clock = iter([0.0, 0.0, 600.0, 1200.0, 1210.0])
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(console.sys.stderr, "isatty", lambda: False)
    with console.counter_progress() as update:
        update("trial 0", 0, 2)  # t=0
        update("trial 1", 1, 2)  # t=600: 600 s a trial, 600 s left
        update("validating", 0, 4)  # t=1200: a new phase
        update("validating", 1, 4)  # t=1210: 10 s an item, 30 s left
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].endswith("(10m00s elapsed, about 10m00s left)")
    assert lines[3].endswith("(20m10s elapsed, about 30s left)")


@pytest.mark.slow
def test_package_data_is_found_after_a_non_editable_install(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "runs", "build", "dist", "*.egg-info",
                                                                  "__pycache__", ".venv", ".pytest_cache", ".ruff_cache"))
    wheels = tmp_path / "wheels"  # built by this interpreter's setuptools: no download
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(wheels), str(source)], check=True, cwd=tmp_path)
    shutil.rmtree(source)  # nothing may be read from the source tree any more
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    wheel = next(wheels.glob("treegraft-*.whl"))
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], check=True, cwd=tmp_path)
    probe = ("import json, treegraft_cli; from treegraft_cli.bench import data_dir, suite_questions; "
             "print(json.dumps([treegraft_cli.__file__, str(data_dir()), len(suite_questions('full'))]))")
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TREEGRAFT_DATA")}
    out = subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path, env=environ)
    package, data, count = json.loads(out.stdout.strip().splitlines()[-1])
    assert package.startswith(str(env_dir)) and data.startswith(str(env_dir)) and count == 480
    assert (Path(data) / "README.md").is_file()
    assert sys.prefix != str(env_dir)


def test_a_question_window_keeps_to_questions_never_used_before():
    window = suite_questions("quick", num_prompts=4, first_prompt=5)  # questions 5-8 of every file
    full = suite_questions("full")
    for name in BENCHMARKS:
        assert [q.question_id for q in window if q.benchmark == name] == [q.question_id for q in full if q.benchmark == name][4:8]
    with pytest.raises(ConfigError, match="no questions from question 81"):
        suite_questions("mt_bench", first_prompt=81)
    with pytest.raises(ConfigError, match="counted from 1"):
        suite_questions("quick", first_prompt=0)
