"""Crash-safe file output: write beside the target, then rename over it, so readers never see half a file."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from .errors import ConfigError


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary, handle = open_beside(path)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def open_beside(path: Path, suffix: str = "") -> tuple[Path, int]:
    """A new hidden file beside ``path`` open for writing: (its path, its descriptor).

    Created with mode 0666 less the umask, like any ``open()`` (``mkstemp`` would make every result 0600).
    """
    for _ in range(100):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}{suffix}")
        try:
            return temporary, os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def ensure_writable_dir(path: Path, option: str = "--out") -> None:
    """Fail now, not after an hour's run, when files cannot be written in the directory ``path``.

    ``path`` need not exist yet (it is created when the first result is written); its nearest existing
    ancestor must be a directory that accepts new files. Nothing is left behind.
    """
    path = Path(path).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"cannot write to {path}: {existing} is a file, not a directory",
                          f"pass {option} a directory path, or move {existing} away")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(f"cannot write to {path}: {existing} does not accept new files ({error.strerror or error})",
                          f"pass {option} a directory you can write to") from None


def save_figure(figure: Any, path: Path, dpi: int = 110) -> Path:
    """Save a matplotlib figure atomically and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        figure.savefig(temporary, dpi=dpi)
        os.replace(temporary, path)
    finally:
        plt.close(figure)
        temporary.unlink(missing_ok=True)
    return path
