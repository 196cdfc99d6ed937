"""Atomic writes leave files with the permissions a plain open() gives, and nothing half-written beside them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from treegraft_cli.atomic import atomic_write_text, ensure_writable_dir
from treegraft_cli.errors import ConfigError


@pytest.fixture
def umask():
    """``os.umask``, with the process's own mask restored afterwards."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_honour_the_umask(mask, mode, tmp_path, umask):
    umask(mask)
    path = tmp_path / "runs" / "results.json"
    atomic_write_text(path, "{}\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert stat.S_IMODE(path.stat().st_mode) == mode == stat.S_IMODE(plain.stat().st_mode)
    atomic_write_text(path, "{}\n")  # a rewrite too
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]


def test_writable_dir_check_creates_nothing(tmp_path):
    out = tmp_path / "a" / "b"
    ensure_writable_dir(out)
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        ensure_writable_dir(blocker / "out")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        ensure_writable_dir(blocker)


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux sysfs, which refuses new files even to root")
def test_writable_dir_check_refuses_a_read_only_place():
    with pytest.raises(ConfigError, match="does not accept new files") as error:
        ensure_writable_dir(Path("/sys/treegraft-out"), "--out")
    assert "--out" in error.value.hint
