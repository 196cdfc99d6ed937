"""On a CUDA device: the GPU check's kernels at real sizes and every method exactly against ``ar`` at Qwen3
shapes (``benchmarks/gpu_check.py``; ``benchmarks/gpu_check.sh`` runs it with the micro-benchmarks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402

CUDA = torch.device("cuda")


def test_every_kernel_equals_its_reference_at_real_sizes():
    assert gpu_check.check_kernels(CUDA, gpu_check.Sizes.for_run(small=False)) == []


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_method_is_lossless_against_ar_at_qwen3_shapes(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = gpu_check.check_methods(CUDA, gpu_check.Sizes.for_run(small=False), [dtype], gpu_check.METHODS)
    assert [r for r in rows if r.verdict == "mismatch"] == []
