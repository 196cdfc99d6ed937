"""Packed linear layers for forwards on CPU (``--linear packed``).

A tree's verification multiplies every weight matrix by a few rows (one per node). torch's default CPU kernels
run such few-row products far below the speed that reading the weights once allows. oneDNN, with each weight
reordered once into its blocked layout for about ``ROWS_HINT`` rows, runs them faster (bit for bit the same
results in bf16; fp32 rounds differently, greedy decoding stays exact under either kernel):

- fp32: on an AMD EPYC (Zen 3, AVX2) with torch's MKL, a 1536→8960 layer takes 3.6× as long for 4 rows as for
  one by default; packed, those products take 0.55–0.8× the default time. For one row (plain decoding, a
  drafter's single-token step) the default kernel is the faster one there, so a one-row product keeps it. On a
  Zen 4 (one thread, 300 tokens of context) Qwen2.5-Coder-1.5B's forward of 4 / 17 rows took 449 / 807 ms packed
  against 1115 / 1638 ms by default, the 0.5B's 197 / 306 against 361 / 518.
- bf16 (a CPU with AVX512-BF16 or AMX): torch's default bf16 product goes through oneDNN too, but lays the weight
  out again at every call. Packed, on a Zen 4 (AVX512-BF16, one thread), Qwen2.5-Coder-1.5B's forward after 300
  tokens took 280 / 281 / 403 ms for 1 / 4 / 17 rows against 400 / 367 / 620 ms, and the 0.5B drafter's 114 / 97 /
  145 against 184 / 182 / 238 (``benchmarks/packed_linear.py``, medians of 3), with the same logits bit for bit. One
  row is faster packed as well, so every product uses the packed weight.

Each layer keeps its weight (a tied embedding shares it) and gains a packed copy: the linear weights take twice
their memory. The layers' modules stay transformers' own: only their ``forward`` is replaced (``PackedForward``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError

LINEAR_KINDS = ("default", "packed", "auto")
ROWS_HINT = 16  # the row count oneDNN lays the weights out for (a tree's worth of nodes)
PACKED_DTYPES = ("fp32", "bf16")


def packing_problem(dtype: str, device: str) -> str | None:
    """Why packed linears cannot run with this dtype (``bf16`` | ``fp16`` | ``fp32``) and device (None: they can)."""
    if device != "cpu":
        return "packed linears are a CPU kernel; on a GPU the default kernels are already the fast ones"
    if dtype not in PACKED_DTYPES:
        return f"packed linears run in {' or '.join(PACKED_DTYPES)} only"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if dtype == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 kernel for this CPU (it needs AVX512-BF16, AVX512 or AMX)"
    return None


def native_bf16() -> bool:
    """Whether this x86 CPU has bf16 matrix instructions (AVX512-BF16 or AMX), where packed bf16 weights were
    measured to pay (see the module docstring)."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def resolve_linear(linear: str, dtype: str, device: str, compile: str = "off") -> str:
    """The kernels a run uses, ``default`` or ``packed``, after ``check_linear``. ``auto`` is ``packed`` where it
    was measured to pay and can run without Inductor: fp32 on CPU (several rows 1.7–2.5× faster on a Zen 4, 1.25–1.8×
    on a Zen 3; one row keeps the default kernel) and bf16 on a CPU with bf16 instructions; ``default`` elsewhere."""
    check_linear(linear, dtype, device, compile)
    if linear != "auto":
        return linear
    runs = packing_problem(dtype, device) is None and compile != "compile"
    return "packed" if runs and (dtype == "fp32" or native_bf16()) else "default"


def check_linear(linear: str, dtype: str, device: str, compile: str = "off") -> None:
    """Refuse an unknown ``--linear`` or packed linears where they cannot run, naming the fix (before any model loads).

    ``--compile compile`` is refused with them: Inductor cannot lower an already packed oneDNN linear (it packs
    weights itself when it freezes a model); ``static`` shapes work with them."""
    if linear not in LINEAR_KINDS:
        raise ConfigError(f"unknown --linear {linear!r}", f"use one of: {', '.join(LINEAR_KINDS)}")
    problem = packing_problem(dtype, device) if linear == "packed" else None
    if problem:
        raise ConfigError(f"--linear packed with --dtype {dtype} on {device}: {problem}",
                          "pass --dtype fp32 (or bf16 on a CPU with bf16 instructions) --device cpu with it, "
                          "or leave --linear at default")
    if linear == "packed" and compile == "compile":
        raise ConfigError("--linear packed with --compile compile: Inductor cannot compile a forward through packed "
                          "oneDNN weights", "use --compile static (or off) with packed linears, or --linear default")


class PackedForward:
    """A ``nn.Linear.forward`` that multiplies with the oneDNN-packed weight: every product in bf16, several rows in
    fp32 (one fp32 row keeps the plain weight, see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor):
        self.weight, self.bias, self.packed = weight, bias, packed
        self.one_row_plain = weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        if self.one_row_plain and x.numel() == x.shape[-1]:
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _has_packed_forward(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), PackedForward)  # the instance's own forward, not the class's


def is_packed(model: nn.Module) -> bool:
    """Whether ``pack_linears`` ran on ``model`` (its linear layers multiply several rows with packed weights)."""
    return any(_has_packed_forward(module) for module in model.modules())


@torch.inference_mode()
def pack_linears(model: nn.Module, rows_hint: int = ROWS_HINT) -> int:
    """Give every ``nn.Linear`` of ``model`` a packed copy of its weight (``PackedForward``); returns how many
    layers were packed now (layers already packed, e.g. shared with a layer-truncated drafter, are skipped)."""
    packed = 0
    for module in model.modules():
        if type(module) is nn.Linear and not _has_packed_forward(module):
            weight = module.weight.detach()
            module.forward = PackedForward(weight, None if module.bias is None else module.bias.detach(),
                                           torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint))
            packed += 1
    return packed
