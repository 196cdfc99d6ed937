"""Host-device synchronisations: the hot path's own count, and an auditor that checks it.

A synchronisation is any point where the host waits for the device: reading a tensor's value into Python
(``.item()``, ``.tolist()``, ``int()``, ``bool()``, ``float()``, an index), ops whose output size depends
on the data (``nonzero``, ``unique``, boolean-mask indexing, ...), and a Python number assigned to one element or
through an index tensor (``x[0] = True`` copies a host scalar over and waits on CUDA; ``x[0].fill_(True)`` does
not). On a GPU each one stalls the host until the queue drains, so the host cannot prepare the next kernels while
the device runs.

Two counters, used together:

- ``HostReads``: every value a decoding step needs on the host is read through ``read`` (one tensor) or
  ``fetch`` (several, one wait), which count on the step's ``HostReads``. Always on and free: this is the
  number ``StepStats.syncs`` and bench report.
- ``SyncAuditor``: a ``TorchFunctionMode`` that counts every synchronising call in its scope, wherever it
  comes from (a stray ``int(tensor)`` included). It costs about 2 µs per torch call, so it runs in tests and
  in ``benchmarks/host_overhead.py``, never in timed runs. ``uncounted()`` leaves model forwards out (the
  model's own code is not the hot path this counts); ``host_only()`` marks code working on host tensors
  (a host tree, a host table, ``fetch`` copies), whose conversions wait for no device. On CUDA,
  ``cuda_sync_debug`` adds the driver's own count.

The auditor is what keeps ``HostReads`` honest: on a CPU run the two must agree (tests/test_syncs.py).
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class HostReads:
    """The decoding step's reads of device values; ``count`` is what a step's ``syncs`` reports.

    Code on the hot path reads through the module functions ``read`` and ``fetch``, which count on the
    ``HostReads`` the engine put in place for the step (``counting``).
    """

    def __init__(self) -> None:
        self.count = 0


def read(tensor: torch.Tensor) -> Any:
    """``tensor.tolist()`` as one counted synchronisation: pack what is needed into one tensor, read it once."""
    with uncounted():
        value = tensor.tolist()
    _note()
    return value


def fetch(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host copies of ``tensors`` for one counted synchronisation (non-blocking copies, then one wait).

    Host-side code works on the copies under ``host_only()``; on a CPU device they are the tensors themselves.
    """
    with uncounted():
        devices = {t.device for t in tensors if t.device.type != "cpu"}
        copies = tuple(t.to("cpu", non_blocking=True) for t in tensors) if devices else tensors
        for device in devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
    _note()
    return copies


def _note() -> None:
    reads = _READS.get()
    if reads is not None:
        reads.count += 1
    auditor = _RUNNING.get()
    if auditor is not None and not auditor._paused:
        auditor.count += 1
        auditor.calls["read"] = auditor.calls.get("read", 0) + 1


@contextmanager
def counting(reads: HostReads) -> Iterator[HostReads]:
    """Count the reads of the code in this block (one decoding step) on ``reads``."""
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


def _is_bool_index(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, (tuple, list)):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


def _copies_a_host_scalar(tensor: Any, index: Any, value: Any = None, *_: Any) -> bool:
    """``tensor[index] = number`` waits on CUDA where the number goes over as a host tensor: through an index tensor
    (``index_put_``), or into one element, every dimension indexed by an integer (a ``copy_`` of a 0-dim host tensor).
    An index that leaves a dimension is a ``fill_``, and so is ``view.fill_(number)``: no wait."""
    if isinstance(value, torch.Tensor) or not isinstance(tensor, torch.Tensor):
        return False
    indices = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (torch.Tensor, list)) for i in indices):
        return True
    return all(isinstance(i, int) for i in indices) and len(indices) == tensor.dim()


def _leaves_device(tensor: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """``tensor.to(...)`` copies a device tensor to the host."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "cpu":
        return False
    targets = [*args, kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


_T = torch.Tensor
# calls that read values into Python or size their output from the data: a sync on any accelerator
_ALWAYS = frozenset({
    _T.item, _T.tolist, _T.__int__, _T.__float__, _T.__bool__, _T.__index__, _T.numpy, _T.cpu,
    _T.nonzero, torch.nonzero, torch.argwhere, _T.argwhere, torch.unique, _T.unique, torch.unique_consecutive,
    _T.unique_consecutive, torch.masked_select, _T.masked_select, torch.equal, _T.equal,
})
_INDEXING = frozenset({_T.__getitem__, _T.__setitem__, _T.index_put_, _T.index_put, torch.index_put})


def _is_attribute(func) -> bool:
    """``tensor.shape``, ``.device``, ``.dtype``: attribute reads, not calls worth counting."""
    return getattr(func, "__name__", "") == "__get__"


class SyncAuditor(TorchFunctionMode):
    """Counts synchronising torch calls in its scope (see the module docstring); ``calls`` by name."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.calls: dict[str, int] = {}
        self.torch_calls = 0  # every torch call outside model forwards: a noise-free proxy of host overhead
        self._paused = 0  # inside a model forward: nothing counts
        self._host = 0  # inside host-side code: calls count, synchronisations do not

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.torch_calls += not self._paused and not _is_attribute(func)
        if not self._paused and not self._host and self._synchronises(func, args, kwargs):
            self.count += 1
            name = getattr(func, "__name__", str(func))
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **kwargs)

    @staticmethod
    def _synchronises(func, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        if func in _ALWAYS:
            return True
        if func in _INDEXING:
            return len(args) > 1 and (_is_bool_index(args[1]) or (func is _T.__setitem__ and _copies_a_host_scalar(*args)))
        if func is _T.to:
            return _leaves_device(args[0] if args else None, args[1:], kwargs)
        if func in (torch.repeat_interleave, _T.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        return False

    def __enter__(self) -> SyncAuditor:
        self._token = _RUNNING.set(self)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        _RUNNING.reset(self._token)


# the auditor whose scope the current code runs in, if any: model forwards leave themselves out of its count
_RUNNING: ContextVar[SyncAuditor | None] = ContextVar("treegraft_sync_auditor", default=None)
# the step's own counter, set by the engine around each step
_READS: ContextVar[HostReads | None] = ContextVar("treegraft_host_reads", default=None)


def audited_count() -> int | None:
    """The running auditor's count so far, or None outside an auditor's scope."""
    auditor = _RUNNING.get()
    return None if auditor is None else auditor.count


class _AuditorScope:
    """``uncounted()`` and ``host_only()`` while an auditor runs: one of its counters raised for the block. A plain
    class, not a generator-based context manager: the hot path enters a few dozen of them per step."""

    __slots__ = ("_field", "_auditor")

    def __init__(self, field: str, auditor: SyncAuditor):
        self._field = field
        self._auditor = auditor

    def __enter__(self) -> None:
        setattr(self._auditor, self._field, getattr(self._auditor, self._field) + 1)

    def __exit__(self, *exc) -> None:
        setattr(self._auditor, self._field, getattr(self._auditor, self._field) - 1)


class _NoScope:
    """``uncounted()`` and ``host_only()`` without an auditor (every timed run): nothing to count."""

    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_NO_SCOPE = _NoScope()


def uncounted() -> _AuditorScope | _NoScope:
    """A model forward (its own synchronisations are the model's, not the decoding step's) or a counted ``read``."""
    auditor = _RUNNING.get()
    return _NO_SCOPE if auditor is None else _AuditorScope("_paused", auditor)


@contextmanager
def cuda_sync_debug(device: torch.device) -> Iterator[list[str]]:
    """On CUDA: the driver-level synchronisations in the block (``set_sync_debug_mode``), one entry each: where
    treegraft made the synchronising call (``sync_site``), so one the auditor cannot see on a CPU (a blocking
    host-to-device copy) can be found."""
    messages: list[str] = []
    if device.type != "cuda":
        yield messages
        return
    previous = torch.cuda.get_sync_debug_mode()
    with recorded_sync_sites(messages):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield messages
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def recorded_sync_sites(sites: list[str]) -> Iterator[list[str]]:
    """Append ``sync_site()`` to ``sites`` for each synchronisation warning raised in the block, as it is raised: the
    warning's own file and line are the innermost Python frame, which under a ``SyncAuditor`` is the auditor's."""

    def note(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            sites.append(sync_site())

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note  # restored by catch_warnings
        yield sites


def sync_site() -> str:
    """The innermost frame of the calling stack outside torch, ``warnings`` and this module, with its caller:
    ``path:line < path:line``."""
    ours = [frame for frame in traceback.extract_stack()
            if not any(part in frame.filename for part in _NOT_A_SITE)]
    return " < ".join(f"{frame.filename}:{frame.lineno}" for frame in reversed(ours[-2:]))


_NOT_A_SITE = (f"{os.sep}torch{os.sep}", f"{os.sep}warnings.py", __file__, "<frozen ")


def host_only() -> _AuditorScope | _NoScope:
    """Host-side code on host tensors (``fetch`` copies, host trees and tables): its reads wait for no device."""
    auditor = _RUNNING.get()
    return _NO_SCOPE if auditor is None else _AuditorScope("_host", auditor)


def host_value(tensor: torch.Tensor) -> Any:
    """``tolist()`` of a host tensor (a ``fetch`` copy, a host table): host work, not a synchronisation."""
    with host_only():
        return tensor.tolist()
