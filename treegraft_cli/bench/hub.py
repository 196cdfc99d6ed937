"""Questions from a dataset, loaded through ``datasets``: ``--suite hf:NAME[@CONFIG][:SPLIT]``.

NAME is a hub id (``openai/gsm8k@main:test``), a directory written by ``Dataset.save_to_disk``, a directory
of data files, or one data file (``.jsonl``/``.json``, ``.parquet``, ``.csv``). The split defaults to
``test`` on the hub and ``train`` for local files (what ``datasets`` names a single file's rows).

Each row becomes one question:

* turns: the ``turns`` column (a list of strings, FastChat / Spec-Bench format), else the first non-empty
  of ``prompt``, ``question``, ``instruction``, ``problem``, ``input``, ``text`` as a single turn;
* id: ``question_id``, else ``id`` / ``task_id``, else the row number;
* category: ``category``, else the benchmark name, which is NAME's last path component (no extension).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .suites import Question

TEXT_COLUMNS = ("prompt", "question", "instruction", "problem", "input", "text")
ID_COLUMNS = ("question_id", "id", "task_id")
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def parse_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``NAME[@CONFIG][:SPLIT]`` → (name, config, split)."""
    name, split = spec, None
    head, colon, tail = spec.rpartition(":")
    if colon and head and "/" not in tail and not Path(spec).exists():
        name, split = head, tail or None
    name, _, config = name.partition("@")
    if not name:
        raise ConfigError(f"--suite hf:{spec} names no dataset", "write --suite hf:NAME, hf:NAME:SPLIT or hf:NAME@CONFIG:SPLIT, e.g. hf:openai/gsm8k@main:test")
    return name, config or None, split


def load_rows(name: str, config: str | None, split: str | None) -> Any:
    """The dataset's rows (a ``datasets.Dataset``), or a ConfigError naming the fix."""
    import datasets

    path = Path(name).expanduser()
    try:
        if path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split or next(iter(loaded))] if isinstance(loaded, datasets.DatasetDict) else loaded
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ConfigError(f"dataset file {path} is not {', '.join(FILE_BUILDERS)}", "convert it, or pass --prompts FILE.jsonl")
            return datasets.load_dataset(builder, data_files=str(path), split=split or "train")
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split or "train")
        return datasets.load_dataset(name, config, split=split or "test")
    except ConfigError:
        raise
    except (ConnectionError, OSError) as error:
        raise ConfigError(
            f"could not load dataset {name!r}: {_first_line(error)}",
            "the Hugging Face hub is unreachable from here: load the dataset where it is reachable, "
            "`save_to_disk` it and pass --suite hf:/path/to/that/dir, or pass --prompts FILE.jsonl",
        ) from None
    except Exception as error:  # datasets raises many kinds (bad split, unknown config, unreadable file)
        raise ConfigError(f"could not load dataset {name!r}: {_first_line(error)}",
                          "check the dataset name, config and split (hf:NAME@CONFIG:SPLIT)") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def row_question(row: dict[str, Any], number: int, benchmark: str, where: str) -> Question:
    turns = row.get("turns")
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
        text = next((row[c] for c in TEXT_COLUMNS if isinstance(row.get(c), str) and row[c].strip()), None)
        if text is None:
            raise ConfigError(f"{where}: row {number} has no prompt",
                              f"the dataset needs a 'turns' list or one of the columns {', '.join(TEXT_COLUMNS)}")
        turns = [text]
    question_id = next((row[c] for c in ID_COLUMNS if row.get(c) is not None), number)
    category = row.get("category") if isinstance(row.get("category"), str) and row.get("category") else benchmark
    return Question(benchmark, question_id if isinstance(question_id, (int, str)) else str(question_id), category,
                    tuple(turns))


def dataset_questions(spec: str, limit: int | None = None, skip: int = 0) -> list[Question]:
    """The questions of ``hf:SPEC``: at most ``limit`` after the first ``skip`` rows."""
    name, config, split = parse_spec(spec)
    rows = load_rows(name, config, split)
    benchmark = Path(name.rstrip("/")).stem or name
    if not len(rows):
        raise ConfigError(f"dataset hf:{spec} holds no rows", "check the split (hf:NAME:SPLIT)")
    end = len(rows) if limit is None else min(skip + limit, len(rows))
    questions = [row_question(rows[i], i, benchmark, f"hf:{spec}") for i in range(skip, end)]
    return questions
