"""Compile every Triton kernel for real GPU architectures on any machine, GPU or not (no launch).

    python benchmarks/compile_kernels.py                 # sm_80 (A100) and sm_90 (H100/H200), Qwen3 sizes
    python benchmarks/compile_kernels.py --arch 90 --small

One line per kernel launch and architecture: its specialisation, registers and spilled (local) bytes per
thread, dynamic shared memory, compile time. Exits 1 when a launch fails to compile or asks for more shared
memory than the architecture gives one block. How it works and what it cannot prove:
``treegraft_cli/kernels/cross_compile.py``. Started with TRITON_INTERPRET set, it reruns itself without it.
"""

from __future__ import annotations

import argparse
import os
import sys

from treegraft_cli.kernels import interpreting
from treegraft_cli.kernels.cross_compile import Compiled, LaunchSizes, cross_compile, launch_every_kernel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities, e.g. 80 90")
    parser.add_argument("--small", action="store_true", help="vocab 512 and 16-node trees (a quick smoke run)")
    args = parser.parse_args()
    sizes = LaunchSizes(vocab=512, nodes=(16,), kv_rows=64, layers=2) if args.small else LaunchSizes()
    print(f"{'kernel':22s} {'arch':6s} {'regs':>4s} {'local B':>7s} {'shared B':>8s} {'s':>5s}  specialisation")
    results = cross_compile(tuple(args.arch), lambda: launch_every_kernel(sizes), on_result=_print)
    failed = [r for r in results if not r.ok]
    kernels = sorted({r.launch.kernel for r in results})
    print(f"compile_kernels: {len(results) - len(failed)}/{len(results)} launches of {len(kernels)} kernels "
          f"({', '.join(kernels)}) compiled for sm_{', sm_'.join(map(str, args.arch))}")
    return 1 if failed else 0


def _print(result: Compiled) -> None:
    name, arch = result.launch.kernel, f"sm_{result.capability}"
    if result.error is not None:
        print(f"{name:22s} {arch:6s} FAILED: {result.error}  [{result.launch.describe()}]")
        return
    flag = "  OVER THE SHARED-MEMORY LIMIT" if result.over_shared_limit else ""
    print(f"{name:22s} {arch:6s} {result.registers:4d} {result.local_bytes:7d} {result.shared_bytes:8d} "
          f"{result.seconds:5.1f}  {result.launch.describe()}{flag}")


if __name__ == "__main__":
    if interpreting():  # decided at triton's import: start afresh without it
        environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, *sys.argv], environment)
    sys.exit(main())
