"""LogProbRows: a strong drafter's float32 log-prob rows of one step, written once and read by index.

A strong call appends the rows of what it forwarded (the root's at a step's first call, then the nodes');
later calls of the same step read any row again: a node is rescored from its parent's row, a grafting
candidate's top-K children come from its own. The rows live in one buffer that doubles when full and is
reused from step to step, so a call writes its new rows once, with the log-softmax writing into the buffer:
no concatenation that copies every earlier row again (at a 152k vocabulary a row is 0.6 MB, and a step of
four calls holds a few dozen rows). Each row's top-K is taken once, at the first ``top`` after the row was
written; later calls gather it from a ``[rows, K]`` table instead of copying candidate rows out to rank them.
"""

from __future__ import annotations

import torch


def log_softmax_float32(
    logits: torch.Tensor,  # [m, vocab] any float dtype
    out: torch.Tensor | None = None,  # [m, vocab] float32, written in place when given
) -> torch.Tensor:  # [m, vocab] float32
    """The float32 log-softmax of each row. On a CPU a reduced-precision input is converted to float32 first and
    normalised in place: bit-identical to the fused conversion and about 1.7x faster there (at a 152k vocabulary
    the fused one costs a strong call about a millisecond per row set)."""
    if logits.dtype == torch.float32 or logits.device.type != "cpu":
        if out is None:
            return torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=out)
    rows = logits.float() if out is None else out.copy_(logits)
    return torch.log_softmax(rows, dim=-1, out=rows)


class LogProbRows:
    def __init__(self, floor: float | None = None):
        self.floor = floor  # log-probs are clamped from below to it (None: not clamped)
        self.buffer = torch.empty(0)  # [capacity, vocab] float32
        self.count = 0  # rows in use
        self.top_values = torch.empty(0)  # [capacity, k] float32: each row's k largest log-probs, descending
        self.top_tokens = torch.empty(0, dtype=torch.long)  # [capacity, k]
        self.top_count = 0  # rows whose top-k is taken
        self.top_k = 0

    @property
    def view(self) -> torch.Tensor:  # [count, vocab]
        return self.buffer[: self.count]

    def keep(self, count: int) -> None:
        """Keep the first ``count`` rows, as written; later appends overwrite the rest."""
        self.count = count
        self.top_count = min(self.top_count, count)

    def append(self, logits: torch.Tensor) -> int:  # logits: [n, vocab], any float dtype
        """Write the rows' float32 log-softmax after the kept rows; return the first new row's index."""
        first = self.count
        self.append_rows(logits)
        return first

    def append_rows(self, logits: torch.Tensor) -> torch.Tensor:  # logits: [n, vocab] -> [n, vocab] float32
        """``append``, returning the rows it wrote (a view of the buffer)."""
        n, vocab = logits.shape
        first, self.count = self.count, self.count + n
        if self.buffer.shape[0] < self.count or self.buffer.shape[1:] != (vocab,) or self.buffer.device != logits.device:
            grown = torch.empty(max(2 * self.count, 16), vocab, device=logits.device)
            if first:  # kept rows move along (a new vocabulary or device comes with nothing kept)
                grown[:first] = self.buffer[:first]
            self.buffer = grown
        rows = self.buffer[first : self.count]
        log_softmax_float32(logits, out=rows)
        if self.floor is not None:
            rows.clamp_min_(self.floor)
        return rows

    def top(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # rows: [c] -> [c, k] twice
        """The ``k`` largest log-probs of each of ``rows`` and their tokens, largest first (``torch.topk``'s)."""
        if k != self.top_k:
            self.top_k, self.top_count = k, 0
        if self.top_count < self.count:
            if self.top_values.shape[0] < self.count or self.top_values.shape[1:] != (k,) or self.top_values.device != self.buffer.device:
                capacity = self.buffer.shape[0]
                values = torch.empty(capacity, k, device=self.buffer.device)
                tokens = torch.empty(capacity, k, dtype=torch.long, device=self.buffer.device)
                if self.top_count:
                    values[: self.top_count] = self.top_values[: self.top_count]
                    tokens[: self.top_count] = self.top_tokens[: self.top_count]
                self.top_values, self.top_tokens = values, tokens
            fresh = slice(self.top_count, self.count)
            torch.topk(self.buffer[fresh], k, dim=-1, out=(self.top_values[fresh], self.top_tokens[fresh]))
            self.top_count = self.count
        return self.top_values.index_select(0, rows), self.top_tokens.index_select(0, rows)
