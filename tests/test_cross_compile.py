"""The Triton kernels compile for a GPU this machine does not have (``kernels/cross_compile.py``).

The interpreted kernel tests prove what the kernels compute; these prove they lower and assemble for a
real architecture, which the interpreter never checks. Both run in subprocesses started without
TRITON_INTERPRET, because triton decides at import whether kernels are interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from treegraft_cli.errors import ConfigError
from treegraft_cli.kernels import interpreting, triton_installed

pytestmark = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("_tree_buffers_kernel", "_argmax_kernel", "_sample_kernel", "_accept_kernel", "_gather_rows_kernel",
           "_graft_candidates_kernel", "_appended_nodes_kernel")


def _compiled_python(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=600)


def test_every_kernel_compiles_for_hopper():
    run = _compiled_python("benchmarks/compile_kernels.py", "--arch", "90", "--small")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for kernel in KERNELS:
        assert any(line.startswith(kernel) and " sm_90 " in line for line in lines), f"{kernel} missing:\n{run.stdout}"
    # sampling compiles once per filter combination: each one is a different program
    assert sum(line.startswith("_sample_kernel") for line in lines) == 4 * 3  # x (bf16, fp16, fp32)
    assert "FAILED" not in run.stdout


BROKEN = '''
import torch, triton, triton.language as tl

def _double(x):  # no @triton.jit: the interpreter runs it as Python, a GPU compiler cannot
    return x * 2

@triton.jit
def _double_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, _double(tl.load(x_ptr + offsets)))

def double(x):
    y = torch.empty_like(x)
    _double_kernel[(1,)](x, y, BLOCK=x.shape[0])
    return y
'''


def test_a_kernel_only_the_interpreter_runs_is_caught(tmp_path):
    (tmp_path / "broken_kernel.py").write_text(BROKEN)
    if interpreting():  # the premise: interpreted, the kernel works
        sys.path.insert(0, str(tmp_path))
        try:
            import broken_kernel

            x = torch.arange(16.0)
            assert torch.equal(broken_kernel.double(x), 2 * x)
        finally:
            sys.path.remove(str(tmp_path))
    script = textwrap.dedent("""
        import json, torch, broken_kernel
        from treegraft_cli.kernels.cross_compile import cross_compile
        results = cross_compile((90,), lambda: broken_kernel.double(torch.empty(16)))
        # the kernel forgets the stand-in's target: a real launch afterwards compiles for the GPU at hand
        print(len(broken_kernel._double_kernel.device_caches))
        print(json.dumps([dict(kernel=r.launch.kernel, ok=r.ok, error=r.error) for r in results]))
    """)
    run = _compiled_python("-c", script, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    *_, caches, listed = run.stdout.splitlines()
    assert caches == "0"
    [result] = json.loads(listed)
    assert result["kernel"] == "_double_kernel" and not result["ok"]
    assert "_double" in result["error"]


def test_recording_refuses_interpreted_kernels(monkeypatch):
    from treegraft_cli.kernels.cross_compile import recording

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"), recording(90):
        pass
