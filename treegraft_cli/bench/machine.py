"""What else the machine is doing while bench times: torch threads, usable cores, load, busy processes.

A CPU benchmark shares the cores with everything else: another process that keeps a core busy, or more
torch threads than there are free cores, makes timings noisy and ratios drift. ``sample_load`` watches
every process's CPU use for a moment (psutil); a process using at least ``BUSY_CORES`` of a core is
*busy*, unless it is pinned to cores this process may not use (``taskset``: one benchmark per core does
not disturb another). Free cores = usable cores (this process's CPU affinity) − cores the other processes use. Bench
samples before it loads the models and after the timed run, records both in ``results.json``
(``environment.machine_load``) and warns when it sees busy processes or more torch threads than free cores.

It also warns when the run's dtype has no native matrix instructions on this CPU (``emulated_dtype_warning``):
torch then converts every operand, and a forward over many rows, such as a tree's verification, costs several
times what it costs in fp32, which changes which method wins.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import psutil
import torch

# CPU feature flags (/proc/cpuinfo: x86 ``flags``, Arm ``Features``) with which a dtype's matrix products run on
# native instructions: AVX512-BF16 or AMX on x86, the BF16 / half-precision extensions on Arm
NATIVE_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}
CPUINFO = "/proc/cpuinfo"
BUSY_CORES = 0.5  # a process using at least half a core is busy
SAMPLE_S = 0.5  # how long CPU use is watched
SHOWN = 5  # busy processes named in a warning


@dataclass(frozen=True)
class BusyProcess:
    pid: int
    name: str
    cores: float  # CPU time per wall second over the sample: 1.0 is one core fully used


@dataclass(frozen=True)
class MachineLoad:
    torch_threads: int
    cpus: int  # cores this process may run on
    load_average: tuple[float, float, float] | None  # 1, 5, 15 minutes (None where the OS has none)
    busy: tuple[BusyProcess, ...]  # other processes, busiest first

    @property
    def other_cores(self) -> float:
        return sum(p.cores for p in self.busy)

    @property
    def free_cores(self) -> float:
        return max(0.0, self.cpus - self.other_cores)

    def warnings(self, device: str = "cpu") -> list[str]:
        """What a user should know before trusting timings taken now."""
        found = []
        if self.busy:
            names = ", ".join(f"{p.name} (pid {p.pid}, {p.cores:.1f} cores)" for p in self.busy[:SHOWN])
            more = f" and {len(self.busy) - SHOWN} more" if len(self.busy) > SHOWN else ""
            found.append(f"other processes are using the CPU: {names}{more}; timings will be noisy")
        if device == "cpu" and self.torch_threads > self.free_cores + 0.5:
            found.append(f"torch uses {self.torch_threads} threads but only {self.free_cores:.1f} of {self.cpus} cores "
                         f"are free; set OMP_NUM_THREADS={max(1, int(self.free_cores))} or stop the other processes")
        return found

    def to_json(self) -> dict:
        values = asdict(self)
        values["free_cores"] = round(self.free_cores, 2)
        return values


def usable_cpus() -> int:
    cores = usable_cpu_set()
    return len(cores) if cores is not None else os.cpu_count() or 1


def usable_cpu_set() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None


def shares_cores(process: psutil.Process, cores: set[int] | None) -> bool:
    """Whether ``process`` may run on any of ``cores`` (True when affinities cannot be read)."""
    if cores is None:
        return True
    try:
        return bool(set(process.cpu_affinity()) & cores)
    except (psutil.Error, AttributeError):
        return True


def sample_load(seconds: float = SAMPLE_S) -> MachineLoad:
    """Every other process's CPU use over ``seconds``, with the thread count and the load average."""
    me = os.getpid()
    mine = usable_cpu_set()
    processes = [p for p in psutil.process_iter(["name"]) if p.pid != me and shares_cores(p, mine)]
    for process in processes:
        try:
            process.cpu_percent(None)  # the first call starts the process's measurement
        except psutil.Error:
            pass
    time.sleep(seconds)
    busy = []
    for process in processes:
        try:
            cores = process.cpu_percent(None) / 100
        except psutil.Error:
            continue  # it ended, or it is not ours to read
        if cores >= BUSY_CORES:
            busy.append(BusyProcess(process.pid, process.info.get("name") or "?", round(cores, 2)))
    busy.sort(key=lambda p: -p.cores)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return MachineLoad(torch.get_num_threads(), usable_cpus(), tuple(round(x, 2) for x in load) if load else None, tuple(busy))


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """This CPU's feature flags (the first processor's ``flags`` or ``Features`` line of ``/proc/cpuinfo``, or of
    ``cpuinfo`` when given); None where they cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            with open(CPUINFO) as file:
                cpuinfo = file.read()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def native_dtypes(flags: frozenset[str] | None) -> list[str] | None:
    """The low-precision dtypes this CPU multiplies natively (fp32 always is); None when its flags are unknown."""
    if flags is None:
        return None
    return [dtype for dtype, names in NATIVE_FLAGS.items() if flags & set(names)]


def emulated_dtype_warning(dtype: str, device: str, flags: frozenset[str] | None) -> str | None:
    """A warning when ``dtype`` runs on a CPU without native instructions for it (None: native, not a CPU
    run, fp32, or flags unknown)."""
    native = native_dtypes(flags)
    if device != "cpu" or dtype not in NATIVE_FLAGS or native is None or dtype in native:
        return None
    flags_named = ", ".join(NATIVE_FLAGS[dtype])
    return (f"this CPU has no native {dtype} matrix instructions (none of the flags {flags_named}), so torch emulates "
            f"{dtype}: a forward over a tree costs several times what it costs in fp32, and speedups measured now do "
            f"not carry over to a CPU that has them; pass --dtype fp32, and try --linear packed for cheaper trees "
            f"(`treegraft profile --dtype {dtype}` and `--dtype fp32 [--linear packed]` show the difference here)")


def precision_warnings(dtype: str, device: str) -> list[str]:
    """``emulated_dtype_warning`` for this machine, as a list for ``console.machine_warnings``."""
    warning = emulated_dtype_warning(dtype, device, cpu_flags())
    return [warning] if warning else []
