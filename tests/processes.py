"""Run `treegraft` commands as separate processes (workers on many machines), logging to a file each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_cli(args: list[str], log: Path) -> subprocess.Popen:
    """``python -m treegraft_cli ARGS`` on this tree; one thread each, as workers share this machine's cores."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as stream:
        return subprocess.Popen([sys.executable, "-m", "treegraft_cli", *args], stdout=stream, stderr=subprocess.STDOUT,
                                env=env, cwd=log.parent)


def finish(process: subprocess.Popen, log: Path, timeout: float = 300) -> dict:
    """Wait for a successful exit; its last stdout line (the command's JSON summary)."""
    assert process.wait(timeout=timeout) == 0, log.read_text()
    return json.loads(log.read_text().strip().splitlines()[-1])


def worker_of(process: subprocess.Popen) -> str:
    """The ``host:pid`` a process records as its worker identity."""
    return f"{socket.gethostname()}:{process.pid}"
