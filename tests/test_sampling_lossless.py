"""Statistical losslessness of tree rejection sampling (after vLLM's rejection-sampler tests).

On a small hand-built tree the exact law of each step's outcome (accepted tokens + bonus) follows from
the target alone: every committed token is a draw from the target at the node it extends, and the walk
continues while that draw is a child. Many samples (the batch dimension holds them) must approach that
law in total variation, more closely as samples grow; deliberately wrong variants must fail the test.
Seeded, so the outcome is fixed: no flakes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from treegraft_cli import verify
from treegraft_cli.kernels import triton_status

VOCAB = 6
# node:    0   1   2   3   4   5   6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TOKENS = [0, 2, 4, 1, 5, 0, 3]
SAMPLE_SIZES = (500, 4000, 32000)
SETTINGS = [(1.0, 0, 1.0), (0.8, 5, 0.9)]  # (temperature, top_k, top_p): plain and fully processed
TOLERANCE = 0.03  # about 3x the expected distance at 32000 samples over this tree's ~25 outcomes

Sampler = Callable[..., verify.Verdict]


def target_logits() -> torch.Tensor:  # [nodes, vocab]
    """Random logits with each node's children raised, so walks go deep and rejections are common."""
    logits = torch.randn(len(PARENTS), VOCAB, generator=torch.Generator().manual_seed(11))
    for child, parent in enumerate(PARENTS):
        if parent >= 0:
            logits[parent, TOKENS[child]] += 1.0
    return logits


def exact_law(probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(outcome) for outcome = accepted tokens then the bonus, from the processed target ``probs`` [nodes, vocab]."""
    law: dict[tuple[int, ...], float] = {}

    def visit(node: int, prefix: tuple[int, ...], mass: float) -> None:
        children = {TOKENS[c]: c for c in range(1, len(PARENTS)) if PARENTS[c] == node}
        for token in range(VOCAB):
            p = mass * float(probs[node, token])
            if token in children:
                visit(children[token], prefix + (token,), p)
            elif p > 0:
                law[prefix + (token,)] = p

    visit(0, (), 1.0)
    return law


def outcomes(verdict: verify.Verdict, tokens: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's accepted tokens and bonus, as tuples (vectorised up to the final conversion)."""
    accepted = torch.where(verdict.path > 0, torch.gather(tokens, 1, verdict.path.clamp(min=0)), -1)
    rows = torch.cat([accepted[:, 1:], torch.full_like(accepted[:, :1], -1)], dim=1)
    rows = torch.where(torch.arange(rows.shape[1]) == verdict.num_accepted[:, None], verdict.bonus[:, None], rows)
    return [tuple(t for t in row if t >= 0) for row in rows.tolist()]


def total_variation(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for outcome in samples:
        counts[outcome] = counts.get(outcome, 0) + 1
    keys = set(counts) | set(law)
    return 0.5 * sum(abs(counts.get(k, 0) / len(samples) - law.get(k, 0.0)) for k in keys)


def distances(sampler: Sampler, temperature: float, top_k: int, top_p: float) -> list[float]:
    """Total variation to the exact law after each of SAMPLE_SIZES samples."""
    logits = target_logits()
    law = exact_law(verify.process_logits(logits.double(), temperature, top_k, top_p))
    batch = SAMPLE_SIZES[-1]
    tokens = torch.tensor(TOKENS).expand(batch, -1).contiguous()
    parents = torch.tensor(PARENTS).expand(batch, -1).contiguous()
    uniforms = torch.rand(batch, len(PARENTS), generator=torch.Generator().manual_seed(5))
    batched = logits.expand(batch, -1, -1).contiguous()
    samples = outcomes(sampler(batched, tokens, parents, uniforms, temperature, top_k, top_p), tokens)
    return [total_variation(samples[:size], law) for size in SAMPLE_SIZES]


def greedy_when_confident(logits, tokens, parents, uniforms, temperature, top_k, top_p) -> verify.Verdict:
    """Wrong: take the argmax wherever the target is confident (p > 0.3) instead of sampling."""
    probs = verify.process_logits(logits, temperature, top_k, top_p)
    sampled = verify.sample_from_probs(probs, uniforms)
    choices = torch.where(probs.max(-1).values > 0.3, probs.argmax(-1), sampled)
    return verify.accept(tokens, parents, choices)


def bonus_without_residual(logits, tokens, parents, uniforms, temperature, top_k, top_p) -> verify.Verdict:
    """Wrong: draw the bonus afresh from the full target, not from the residual the rejections left."""
    verdict = verify.verify_sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p)
    deepest = torch.gather(verdict.path, 1, verdict.num_accepted[:, None])
    probs = verify.process_logits(torch.gather(logits, 1, deepest[..., None].expand(-1, -1, logits.shape[-1])), temperature, top_k, top_p)
    fresh = torch.rand(logits.shape[0], 1, generator=torch.Generator().manual_seed(9))
    bonus = verify.sample_from_probs(probs, fresh).squeeze(1)
    return verify.Verdict(path=verdict.path, num_accepted=verdict.num_accepted, bonus=bonus)


def kernel_sampler() -> Sampler:
    if not triton_status(torch.device("cpu"))[0]:
        pytest.skip("triton cannot run here (not installed, or TRITON_INTERPRET unset)")
    from treegraft_cli.kernels.sampling import verify_sampling

    return verify_sampling


@pytest.mark.parametrize("setting", SETTINGS, ids=["plain", "processed"])
@pytest.mark.parametrize("implementation", ["torch", "triton"])
def test_matches_target_distribution(implementation, setting):
    sampler = verify.verify_sampling if implementation == "torch" else kernel_sampler()
    tv = distances(sampler, *setting)
    assert tv[0] > tv[1] > tv[2], f"distance does not shrink with samples: {tv}"
    assert tv[-1] < TOLERANCE, tv


@pytest.mark.parametrize("setting", SETTINGS, ids=["plain", "processed"])
@pytest.mark.parametrize("wrong", [greedy_when_confident, bonus_without_residual])
def test_wrong_variants_fail(wrong, setting):
    tv = distances(wrong, *setting)
    assert tv[-1] > 3 * TOLERANCE, f"{wrong.__name__} passed as lossless: {tv}"


def test_exact_law_is_a_distribution():
    law = exact_law(verify.process_logits(target_logits().double(), 1.0))
    assert abs(sum(law.values()) - 1.0) < 1e-6  # the reference processes in fp32
