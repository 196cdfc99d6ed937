"""What else the machine is doing while bench times: torch threads, usable cores, load, busy processes.

A CPU benchmark shares the cores with everything else: another process that keeps a core busy, or more
torch threads than there are free cores, makes timings noisy and ratios drift. ``sample_load`` watches
every process's CPU use for a moment (psutil); a process using at least ``BUSY_CORES`` of a core is
*busy*, unless it is pinned to cores this process may not use (``taskset``: one benchmark per core does
not disturb another). Free cores = usable cores (this process's CPU affinity) − cores the other processes use. Bench
samples before it loads the models and after the timed run, records both in ``results.json``
(``environment.machine_load``) and warns when it sees busy processes or more torch threads than free cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import psutil
import torch

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
