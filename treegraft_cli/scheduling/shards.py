"""Rollout storage: one shard per prompt (Parquet or JSONL via ``datasets``), each sealed by a receipt.

Layout of a rollout directory::

    collect.json            settings every worker shares (pair, tree shape, policies, cost profile)
    shards/KEY.parquet      the rows of one prompt (all its turns); or KEY.jsonl
    shards/KEY.done.json    the receipt: row count, sha256 of the shard file and its worker, written after it
    shards/.KEY.lock        the claim: a worker holds an exclusive lock on it while it collects KEY

Both files are written to a temporary name and renamed, so a crash leaves either no shard, or a shard
without a receipt, never a half file under the real name. A claimed key without a receipt whose lock
nobody holds is torn (its worker died mid-prompt): ``collect`` redoes it, readers refuse it. A shard
whose bytes do not match its receipt is corrupt: ``collect`` redoes it, readers refuse it.

Many processes may share one directory. ``collect.json`` is created once (hard link of a complete
file: the first worker's settings win, the others must match). Workers with different ``--shard i/n``
take disjoint keys; workers given the same shard by mistake never collect one key at once: the key's
lock (``flock``, released by the kernel when its holder dies, even by SIGKILL) admits one, and the
other takes the key only if it is still unsealed when the lock frees. Locks need a local file system or
NFS with locking.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
from datasets.table import InMemoryTable

from ..atomic import atomic_write_text
from ..errors import ConfigError

FORMATS = ("parquet", "jsonl")
SETTINGS_FILE = "collect.json"
REDO = "rerun `treegraft collect` with the same --out: it redoes torn and corrupt shards"


@dataclass(frozen=True)
class ShardState:
    key: str
    status: str  # done | missing | torn | corrupt


def shard_key(benchmark: str, question_id: Any) -> str:
    """A file-safe key for one prompt."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{benchmark}-{question_id}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _shard_dir(root: Path) -> Path:
    return Path(root) / "shards"


def _data_path(root: Path, key: str, fmt: str) -> Path:
    return _shard_dir(root) / f"{key}.{fmt}"


def _receipt_path(root: Path, key: str) -> Path:
    return _shard_dir(root) / f"{key}.done.json"


def _lock_path(root: Path, key: str) -> Path:
    return _shard_dir(root) / f".{key}.lock"  # hidden: never taken for a shard


def _temporary_prefix(key: str) -> str:
    return f".{key}+"  # "+" never occurs in a key: this key's temporaries only


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@contextmanager
def claim_shard(root: Path, key: str, wait: bool = False) -> Iterator[bool]:
    """Hold ``key``'s lock while collecting it: True when held; False when another live worker holds it
    (``wait=False``). The lock file records its holder; the kernel releases the lock when the holder dies."""
    directory = _shard_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(_lock_path(root, key), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = False
        else:
            held = True
            os.ftruncate(descriptor, 0)
            claim = {"worker": worker_id(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            os.write(descriptor, json.dumps(claim).encode())
            for stale in directory.glob(f"{_temporary_prefix(key)}*"):  # a dead holder's half-written temporaries
                stale.unlink(missing_ok=True)
        yield held
    finally:
        os.close(descriptor)  # releases the lock


def shard_holder(root: Path, key: str) -> str | None:
    """The worker collecting ``key`` right now (``host:pid``), or None when nobody holds its lock."""
    path = _lock_path(root, key)
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return str(json.loads(path.read_text(encoding="utf-8"))["worker"])
            except (json.JSONDecodeError, KeyError, TypeError):
                return "another worker"
        return None
    finally:
        os.close(descriptor)


def shard_state(root: Path, key: str) -> ShardState:
    receipt = _receipt_path(root, key)
    found = [p for p in (_data_path(root, key, f) for f in FORMATS) if p.exists()]
    if not receipt.exists():  # claimed or half-written, never sealed: torn (or in progress: see shard_holder)
        return ShardState(key, "torn" if found or _lock_path(root, key).exists() else "missing")
    try:
        sealed = json.loads(receipt.read_text(encoding="utf-8"))
        data = _data_path(root, key, sealed["format"])
        ok = data.exists() and _sha256(data) == sealed["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        ok = False
    return ShardState(key, "done" if ok else "corrupt")


def write_shard(root: Path, key: str, rows: Sequence[Mapping[str, Any]], fmt: str) -> Path:
    """Write one prompt's rows, then its receipt; both atomic. The caller holds ``claim_shard(root, key)``."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown shard format {fmt!r}", f"use one of: {', '.join(FORMATS)}")
    fmt = fmt if rows else "jsonl"  # a prompt that labelled nothing: an empty JSONL (Parquet needs columns)
    directory = _shard_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    _receipt_path(root, key).unlink(missing_ok=True)  # a redone shard is unsealed until its new receipt lands
    path = _data_path(root, key, fmt)
    handle, temporary = tempfile.mkstemp(prefix=_temporary_prefix(key), suffix=f".{fmt}", dir=directory)
    os.close(handle)
    try:
        table = datasets.Dataset.from_list([dict(row) for row in rows])
        if fmt == "parquet":
            table.to_parquet(temporary)
        elif rows:
            table.to_json(temporary, lines=True)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    receipt = {"key": key, "format": fmt, "rows": len(rows), "sha256": _sha256(path), "worker": worker_id()}
    atomic_write_text(_receipt_path(root, key), json.dumps(receipt))
    return path


def read_shard(root: Path, key: str) -> datasets.Dataset:
    state = shard_state(root, key)
    if state.status != "done":
        holder = shard_holder(root, key)
        if holder is not None:
            raise ConfigError(f"rollout shard {key} in {root} is being collected by {holder}",
                              "wait for that `treegraft collect` to finish")
        why = {"torn": "its collection stopped before it was sealed", "corrupt": "its bytes do not match its receipt",
               "missing": "it has no data"}[state.status]
        raise ConfigError(f"rollout shard {key} in {root} is {state.status} ({why})", REDO)
    sealed = json.loads(_receipt_path(root, key).read_text(encoding="utf-8"))
    path = _data_path(root, key, sealed["format"])
    try:
        if sealed["format"] == "parquet":
            table = datasets.Dataset(InMemoryTable(pq.read_table(path)))  # no builder, no cache directory
        else:
            lines = path.read_text(encoding="utf-8").splitlines()
            table = datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])
    except Exception as error:  # noqa: BLE001 - any parse failure of a sealed shard means the same thing
        raise ConfigError(f"rollout shard {path} cannot be read ({type(error).__name__})", REDO) from None
    if len(table) != sealed["rows"]:
        raise ConfigError(f"rollout shard {path} holds {len(table)} rows, its receipt says {sealed['rows']}", REDO)
    return table


def shard_keys(root: Path) -> list[str]:
    """Every key with a shard file, a receipt or a claim under ``root``, sorted."""
    directory = _shard_dir(root)
    if not directory.is_dir():
        return []
    keys = set()
    for path in directory.iterdir():
        if path.name.startswith(".") and path.name.endswith(".lock"):
            keys.add(path.name[1 : -len(".lock")])
        elif path.name.startswith("."):
            continue
        for suffix in (".done.json", *(f".{f}" for f in FORMATS)):
            if path.name.endswith(suffix):
                keys.add(path.name[: -len(suffix)])
    return sorted(keys)


def read_rollouts(root: Path) -> tuple[dict[str, Any], datasets.Dataset]:
    """The shared settings and every sealed shard's rows; any torn or corrupt shard is an error."""
    root = Path(root)
    settings = read_settings(root)
    keys = shard_keys(root)
    if not keys:
        raise ConfigError(f"{root} holds no rollout shards", "run `treegraft collect --out DIR` first")
    tables = [table for table in (read_shard(root, key) for key in keys) if len(table)]  # a prompt may label nothing
    return settings, datasets.concatenate_datasets(tables) if tables else datasets.Dataset.from_dict({})


def read_iterations(roots: Sequence[Path]) -> tuple[dict[str, Any], list[datasets.Dataset]]:
    """Several rollout directories (iterations of on-policy collection): the first one's settings and every
    directory's rows. They must share the pair, dtype and tree (their policies and cost profiles may differ)."""
    first, tables = None, []
    for root in roots:
        settings, table = read_rollouts(root)
        if first is None:
            first = settings
        shared = {"pair": None, "dtype": None, "tree": None, "feature_names": None, "decide": "layer"}  # → default
        differing = [name for name, default in shared.items() if settings.get(name, default) != first.get(name, default)]
        if differing:
            raise ConfigError(f"{root} was collected with another {', '.join(differing)} than {roots[0]}",
                              "distill together only iterations of one pair and tree shape")
        tables.append(table)
    if first is None:
        raise ConfigError("no rollout directory given", "pass --rollouts DIR (repeatable)")
    return first, tables


def read_settings(root: Path) -> dict[str, Any]:
    path = Path(root) / SETTINGS_FILE
    if not path.is_file():
        raise ConfigError(f"{root} is not a rollout directory ({SETTINGS_FILE} is missing)", "pass the --out DIR of `treegraft collect`")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise ConfigError(f"{path} is not valid JSON", REDO) from None


def record_settings(root: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The directory's settings: ``settings`` if this is the first worker to record them, else the first worker's.

    A complete file is hard-linked into place, which fails when the name exists: of many workers starting
    at once exactly one records, and nobody reads half a file."""
    root = Path(root)
    path = root / SETTINGS_FILE
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{SETTINGS_FILE}+", dir=root)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(json.dumps(settings, indent=1, sort_keys=True))
            os.link(temporary, path)
        except FileExistsError:
            pass  # another worker recorded first
        finally:
            Path(temporary).unlink(missing_ok=True)
    return read_settings(root)


def differing_settings(recorded: Mapping[str, Any], settings: Mapping[str, Any]) -> list[str]:
    """Top-level fields where ``settings`` differ from the ``recorded`` ones (compared as JSON)."""
    wanted = json.loads(json.dumps(settings))
    return sorted(k for k in set(recorded) | set(wanted) if recorded.get(k) != wanted.get(k))


def other_settings_error(root: Path, differing: Sequence[str]) -> ConfigError:
    return ConfigError(f"{root} holds rollouts collected with other settings ({', '.join(differing)})",
                       "use a new --out directory, or the same settings to resume")


def table_columns(table) -> dict[str, list]:
    """A rollout ``datasets.Dataset`` as plain column lists; an empty one is an error."""
    if len(table) == 0:
        raise ConfigError("the rollouts hold no labelled decisions", "collect more prompts or tokens (or a lower --every)")
    return dict(table[: len(table)])
