"""LogProbRows: the strong drafter's rows equal a log-softmax of what was appended, through growth, kept rows and
overwrites, and their cached top-k equals ``torch.topk`` of the rows."""

from __future__ import annotations

import pytest
import torch

from treegraft_cli.drafters.logp_rows import LogProbRows, log_softmax_float32


def reference(chunks: list[torch.Tensor]) -> torch.Tensor:  # -> [rows, vocab]
    return torch.cat([torch.log_softmax(c.float(), dim=-1) for c in chunks])


def test_rows_are_the_log_softmax_of_every_append_through_growth():
    generator = torch.Generator().manual_seed(0)
    rows = LogProbRows()
    chunks = [torch.randn(n, 50, generator=generator).to(torch.bfloat16) for n in (1, 9, 12, 7)]  # past 16 rows
    firsts = [rows.append(c) for c in chunks]
    assert firsts == [0, 1, 10, 22]
    assert torch.equal(rows.view, reference(chunks))
    values, tokens = rows.top(torch.tensor([0, 5, 28]), 4)
    expected = torch.topk(reference(chunks)[[0, 5, 28]], 4, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(tokens, expected.indices)


def test_kept_rows_survive_and_overwritten_rows_get_a_fresh_top_k():
    generator = torch.Generator().manual_seed(1)
    rows = LogProbRows()
    first, second, third = (torch.randn(n, 30, generator=generator) for n in (3, 4, 5))
    rows.append(first)
    rows.append(second)
    rows.top(torch.arange(7), 3)  # every row's top-3 taken
    rows.keep(3)
    assert rows.append(third) == 3
    assert torch.equal(rows.view, reference([first, third]))
    values, tokens = rows.top(torch.arange(8), 3)
    expected = torch.topk(reference([first, third]), 3, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(tokens, expected.indices)
    values, _ = rows.top(torch.tensor([1]), 5)  # another k: every row ranked again
    assert torch.equal(values, torch.topk(reference([first]), 5, dim=-1).values[1:2])


def test_floor_clamps_tokens_outside_a_draft_vocabulary():
    rows = LogProbRows(floor=-100.0)
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    rows.append(logits)
    assert rows.view[0, 1] == -100.0 and torch.equal(rows.view[0, [0, 2]], torch.log_softmax(logits, -1)[0, [0, 2]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float32_log_softmax_is_the_fused_conversions_bit_for_bit(dtype):
    logits = (torch.randn(5, 3000, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    expected = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    out = torch.empty(8, 3000)
    assert torch.equal(log_softmax_float32(logits), expected)
    assert log_softmax_float32(logits, out=out[:5]).data_ptr() == out.data_ptr()
    assert torch.equal(out[:5], expected)
