"""The weak drafter: an n-gram index over the committed context, scored by the target's own log-probs.

Index. For every n in 1..max_n, a dict from the n tokens ending at position p to every such p, in
ascending order. Committing tokens appends their n-grams (no rebuild per step). A lookup is host-side
by nature (hashing token tuples); it runs once per expanded parent, never per node.

Scores. ``TargetLogProbCache`` keeps the target's top-W log-probs at every committed position. A
continuation whose first token follows a match ending at position p is scored with the log-prob of that
token at p (the W-th best minus ``fallback_penalty`` when outside the top-W); chain token j likewise
with the log-prob at p + j (``grafting.builder.LayerLoop.chain_logp``), summed along the chain.

Rule for generated text: the prompt's positions are filled from the prefill, and each generated
position from the verification forward in which it was the root or an accepted node. That forward ran
on the exact committed prefix, so those rows are the target's true log-probs at the position, the same
quantity the prefill gives for prompt positions. Only the current root (whose logits arrive with the
next verification) has no row yet; no continuation can start after it anyway.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..hostlists import longs
from ..syncs import fetch, host_only, read
from ..tree import float32
from .logp_rows import log_softmax_float32


class TargetLogProbCache:
    """Top-W target log-probs at committed positions: ``values``/``tokens`` ``[positions, W]``.

    The rows live in buffers that double when full: a step writes its few new rows in place, not a concatenation
    that copies every earlier position again."""

    def __init__(self, width: int, fallback_penalty: float):
        self.width = width
        self.fallback_penalty = fallback_penalty
        self.reset()

    def reset(self) -> None:
        self._values = torch.empty(0, self.width)  # [capacity, W] float32
        self._tokens = torch.empty(0, self.width, dtype=torch.long)  # [capacity, W]
        self.length = 0  # positions recorded

    @property
    def values(self) -> torch.Tensor:  # [positions, W]
        return self._values[: self.length]

    @property
    def tokens(self) -> torch.Tensor:  # [positions, W]
        return self._tokens[: self.length]

    def append(self, start: int, logits: torch.Tensor) -> None:  # logits: [m, vocab] at positions start..start+m
        """Record positions ``start..start+m``; rows already recorded there are overwritten."""
        self.append_top(start, *fetch(*self.top(logits)))  # both read with one wait

    def top(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [m, vocab] -> 2 x [m, W]
        """The top-W log-probs and their tokens of each row, where the logits are (on the device)."""
        logp = log_softmax_float32(logits)
        return torch.topk(logp, min(self.width, logp.shape[-1]), dim=-1)

    def append_top(self, start: int, values: torch.Tensor, tokens: torch.Tensor, count: int | None = None) -> None:
        """``append`` from rows already reduced by ``top`` and read to the host (``[m, W]`` each): positions
        ``start..start+count`` (``count`` defaults to m; rows past it are written but not recorded), the ones after
        forgotten. ``start`` is a recorded position or the first unrecorded one."""
        if start > self.length:
            raise ValueError(f"position {start} would leave a gap after the {self.length} recorded")
        end = start + values.shape[0]
        if end > self._values.shape[0] or self._values.shape[1:] != values.shape[1:]:
            grown_values = values.new_empty(max(2 * end, 64), values.shape[1])
            grown_tokens = tokens.new_empty(max(2 * end, 64), tokens.shape[1])
            if self._values.shape[1:] == values.shape[1:]:  # a new width (a smaller vocabulary) keeps nothing
                grown_values[:start], grown_tokens[:start] = self._values[:start], self._tokens[:start]
            self._values, self._tokens = grown_values, grown_tokens
        self._values[start:end], self._tokens[start:end] = values, tokens
        self.length = end if count is None else start + count

    def score(self, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [m], [m] -> [m]
        """Log-prob of ``tokens`` after ``positions``; outside the top-W: W-th best minus the penalty."""
        known = positions < self.values.shape[0]
        safe = positions.clamp(max=max(self.values.shape[0] - 1, 0))
        if self.values.shape[0] == 0:
            return torch.full(tokens.shape, -self.fallback_penalty)
        hit = self.tokens[safe] == tokens[:, None]  # [m, W]
        in_top = hit.any(dim=-1)
        value = torch.where(hit, self.values[safe], 0.0).sum(dim=-1)
        fallback = self.values[safe, -1] - self.fallback_penalty
        scored = torch.where(in_top, value, fallback)
        return torch.where(known, scored, -self.fallback_penalty)

    def score_on_host(self, positions: list[int], tokens: list[int]) -> list[float]:
        """``score`` for host lists: two row gathers and one read of them, then Python (a weak layer scores a few
        dozen chain tokens; per-token tensor ops would cost more). The same float32 values: a hit's own value,
        else the W-th best minus the penalty rounded as a float32 subtraction."""
        if not positions:
            return []
        length = self.length
        if length == 0:
            return [float32(-self.fallback_penalty)] * len(positions)
        rows = longs([min(p, length - 1) for p in positions])
        with host_only():
            values, top = self._values.index_select(0, rows).tolist(), self._tokens.index_select(0, rows).tolist()
        penalty = float32(self.fallback_penalty)
        out = []
        for position, token, row, row_tokens in zip(positions, tokens, values, top, strict=True):
            if position >= length:
                out.append(float32(-self.fallback_penalty))
            elif token in row_tokens:
                out.append(row[row_tokens.index(token)])
            else:
                out.append(float32(row[-1] - penalty))
        return out


@dataclass(frozen=True)
class Continuation:
    """One proposed chain: ``tokens`` follow the match ending at committed position ``position``."""

    position: int
    tokens: tuple[int, ...]


class NgramIndex:
    """Positions of every n-gram (n ≤ max_n) of the committed context, grown on commit."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.context: list[int] = []
        self.table: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]

    def reset(self) -> None:
        self.context = []
        self.table = [{} for _ in range(self.max_n + 1)]

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens and index the n-grams that end at each of them."""
        for token in tokens:
            self.context.append(int(token))
            end = len(self.context) - 1
            for n in range(1, min(self.max_n, end + 1) + 1):
                key = tuple(self.context[end - n + 1 : end + 1])
                self.table[n].setdefault(key, []).append(end)

    def sync(self, committed: torch.Tensor) -> None:  # committed: [L]
        """Index whatever ``committed`` adds beyond the indexed context (committed only ever grows); a read
        only when the index lags (decoding keeps it in step from the host's copy of each step's tokens)."""
        if committed.shape[0] > len(self.context):
            self.extend(read(committed[len(self.context) :]))

    def continuations(
        self,
        suffix: list[int],  # the query: context + path tokens, only the last max_n matter
        max_n: int,
        count: int,
        length: int,
        scan_limit: int = 64,
        min_n: int = 1,
    ) -> list[Continuation]:
        """Up to ``count`` continuations with distinct first tokens, longest match first, most recent first.

        Matches of shorter n, down to ``min_n``, fill what longer n leave; each continuation is at most ``length``
        tokens of the context after the match. ``scan_limit`` bounds the occurrences read per n (frequent unigrams).
        """
        found: list[Continuation] = []
        first_tokens: set[int] = set()
        last = len(self.context) - 1
        for n in range(min(max_n, self.max_n, len(suffix)), min_n - 1, -1):
            ends = self.table[n].get(tuple(suffix[-n:]), ())
            for end in itertools.islice(reversed(ends), scan_limit):  # most recent first, no copy of them all
                if end >= last or self.context[end + 1] in first_tokens:
                    continue
                first_tokens.add(self.context[end + 1])
                found.append(Continuation(end, tuple(self.context[end + 1 : end + 1 + length])))
                if len(found) == count:
                    return found
        return found
