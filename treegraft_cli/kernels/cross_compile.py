"""Compile the Triton kernels for a GPU this machine does not have: ahead of time, no driver, no launch.

The launchers run as they would on a GPU (GPU tile sizes, the same argument handling) on CPU tensors,
while a stand-in driver names the target architecture and triton's compile hook records each launch's
specialisation (argument types, constexprs, alignment) instead of compiling and launching it. Each
recorded launch is then compiled for the target with the ``ptxas`` that ships inside triton's wheel, and
the cubin's resource usage is read with the bundled ``cuobjdump``.

What a pass proves: every kernel lowers, assembles and fits the architecture's shared memory at the
launch sizes given: what a first GPU run would otherwise spend its minutes finding out. What it cannot:
that a kernel computes the right thing (the interpreted tests against the torch references do that) or
how fast it runs (``benchmarks/verify_kernels.py`` on a GPU).

Triton decides at import whether ``@triton.jit`` kernels are interpreted, so this runs in a process
started without ``TRITON_INTERPRET`` (``benchmarks/compile_kernels.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from . import interpreting

# dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin) by compute capability
SHARED_LIMITS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448}


@dataclass(frozen=True, eq=False)
class Launch:
    """One kernel launch as triton specialised it: what compiling it again for any target needs."""

    kernel: str
    jit_function: Any  # triton.runtime.JITFunction
    signature: dict[str, str]  # argument name -> triton type ('*bf16', 'i32', 'constexpr', ...)
    constants: dict[tuple[int, ...], Any]  # constexpr (and value-specialised) arguments by position
    attrs: dict[tuple[int, ...], Any]  # alignment specialisations by position
    options: dict[str, Any]  # num_warps, num_stages, num_ctas

    @property
    def key(self) -> tuple:
        return self.kernel, tuple(self.signature.values()), repr(sorted(self.constants.items())), repr(sorted(self.attrs.items()))

    def describe(self) -> str:
        """The launch's specialisation in words: constexpr values and pointer types, by argument name."""
        names = list(self.signature)
        values = [f"{names[path[0]]}={_plain(value)}" for path, value in sorted(self.constants.items())]
        pointers = [f"{name}:{kind[1:]}" for name, kind in self.signature.items() if kind.startswith("*")]
        return " ".join(values + pointers)


@dataclass(frozen=True)
class Compiled:
    """One launch compiled for one architecture."""

    launch: Launch
    capability: int  # e.g. 90 for sm_90 (H100, H200)
    seconds: float
    error: str | None = None  # why compiling failed
    registers: int | None = None  # per thread
    local_bytes: int | None = None  # per thread: spilled registers and stack arrays
    shared_bytes: int | None = None  # dynamic shared memory the launch requests

    @property
    def over_shared_limit(self) -> bool:
        limit = SHARED_LIMITS.get(self.capability)
        return limit is not None and self.shared_bytes is not None and self.shared_bytes > limit

    @property
    def ok(self) -> bool:
        return self.error is None and not self.over_shared_limit


class _StandInDriver:
    """What ``JITFunction.run`` asks of the active driver before it compiles, for a GPU that is not here."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextmanager
def recording(capability: int = 90) -> Iterator[list[Launch]]:
    """Launchers called in this block record their launches (into the yielded list) and launch nothing.

    Their outputs stay uninitialised: only the launches matter here.
    """
    if interpreting():
        raise ConfigError("cross-compiling needs compiled kernels, and TRITON_INTERPRET is set",
                          "run it in a process started without TRITON_INTERPRET (benchmarks/compile_kernels.py)")
    from triton import knobs
    from triton.runtime.driver import driver

    if not hasattr(knobs.runtime, "jit_cache_hook"):
        raise ConfigError("this triton has no compile hook to record launches with", "pip install 'triton>=3.4'")
    launches: list[Launch] = []
    seen: set[tuple] = set()

    def record(*, fn, compile, **_) -> bool:
        launch = Launch(fn.name, fn.jit_function, dict(compile["signature"]), dict(compile["constants"]),
                        dict(compile["configs"][0]), {k: compile[k] for k in ("num_warps", "num_stages", "num_ctas")})
        if launch.key not in seen:
            seen.add(launch.key)
            launches.append(launch)
        return True  # handled: triton neither compiles nor launches

    previous_hook = knobs.runtime.jit_cache_hook
    previous_driver = getattr(driver, "_active", None)  # not reset_active(): without a GPU it finds no driver
    driver.set_active(_StandInDriver(capability))
    knobs.runtime.jit_cache_hook = record
    try:
        yield launches
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)
        for jit_function in {id(launch.jit_function): launch.jit_function for launch in launches}.values():
            jit_function.device_caches.clear()  # they hold the stand-in's target: a real launch must not use it


def compile_launch(launch: Launch, capability: int) -> Compiled:
    """Compile ``launch`` for ``sm_<capability>`` and read the cubin's resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    started = time.perf_counter()
    try:
        source = ASTSource(launch.jit_function, launch.signature, launch.constants, launch.attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=launch.options)
    except Exception as error:  # noqa: BLE001 - any compiler failure is the result being reported
        return Compiled(launch, capability, time.perf_counter() - started, error=_summary(error))
    usage = resource_usage(kernel.asm["cubin"])
    return Compiled(launch, capability, time.perf_counter() - started, registers=usage.get("REG"),
                    local_bytes=usage.get("LOCAL"), shared_bytes=kernel.metadata.shared)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` of one kernel's cubin: REG, STACK, SHARED (static), LOCAL, ..."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(cubin)
        dump = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True,
                              check=True).stdout
    return {key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", dump.split("Function", 1)[-1])}


@dataclass(frozen=True)
class LaunchSizes:
    """The sizes every kernel is launched at."""

    vocab: int = 151_936  # Qwen3's
    nodes: tuple[int, ...] = (16, 128)  # tree sizes (the kernels specialise on their power-of-two block)
    kv_heads: int = 8
    head_dim: int = 128
    kv_rows: int = 512
    layers: int = 4


def launch_every_kernel(sizes: LaunchSizes = LaunchSizes()) -> None:
    """Call every kernel's launcher in each configuration the engine uses: greedy and sampled verification of
    bf16, fp16 and fp32 logits (top-k and top-p each on and off), tree buffers, a graft's candidates, and the KV
    commit of 2-byte and 4-byte caches. Under ``recording`` this launches nothing."""
    from ..drafters.rank_template import BASE_TEMPLATE, build_template, scale_counts
    from . import graft_candidates, greedy, kv_commit, sampling, tree_buffers

    table_k = 8
    successors = torch.empty(sizes.vocab + 2, table_k, dtype=torch.long)
    for n in sizes.nodes:  # the largest tiles: a tree of the whole budget, a template of as many candidates
        template = build_template(scale_counts(BASE_TEMPLATE, n // 2, table_k), n, table_k)
        tree = torch.zeros(n, dtype=torch.long)
        tokens, node, scores, kept, _ = graft_candidates.graft_candidates(successors, tree, tree, torch.zeros(n), template,
                                                                         n // 2, 4)
        graft_candidates.appended_nodes(tokens, node, scores, kept, template, n // 2)
    for n in sizes.nodes:
        parents = torch.arange(-1, n - 1)[None]  # a chain: any tree has these argument types
        tokens = torch.zeros(1, n, dtype=torch.long)
        uniforms = torch.rand(1, n)
        tree_buffers.tree_buffers(parents)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            logits = torch.empty(1, n, sizes.vocab, dtype=dtype)
            greedy.verify_greedy(logits, tokens, parents)
            for top_k, top_p in ((0, 1.0), (20, 1.0), (0, 0.9), (20, 0.9)):
                sampling.verify_sampling(logits, tokens, parents, uniforms, 0.7, top_k, top_p)
    keep = torch.arange(0, sizes.kv_rows, 2)
    for dtype in (torch.bfloat16, torch.float32):
        cache = [torch.empty(1, sizes.kv_heads, sizes.kv_rows, sizes.head_dim, dtype=dtype)
                 for _ in range(2 * sizes.layers)]
        kv_commit.gather_rows(cache, keep, 0)


def cross_compile(capabilities: tuple[int, ...], exercise: Callable[[], None] = launch_every_kernel,
                  on_result: Callable[[Compiled], None] | None = None) -> list[Compiled]:
    """Record ``exercise``'s launches, then compile each for every architecture in ``capabilities``."""
    results = []
    for capability in capabilities:
        with recording(capability) as launches:
            exercise()
        for launch in launches:
            result = compile_launch(launch, capability)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def _plain(value: Any) -> str:
    return getattr(value, "name", None) or str(value)  # tl.int16 -> 'int16'


def _summary(error: Exception) -> str:
    """The error type and its last non-empty line (a compiler error ends with its message)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]
