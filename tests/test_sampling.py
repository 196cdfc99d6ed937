"""Sampling at T>0 is exact: the committed tokens are distributed as the target's, and a wrong sampler is caught.

Two levels, as in vLLM's rejection-sampler tests: the acceptance rule alone on a hand-built tree with
known target distributions (many vectorised draws), and the whole engine on a tiny model.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import random_prompt

from treegraft_cli.backends import VerifyBackend
from treegraft_cli.config import DecodeConfig, SamplingConfig, TreeConfig
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.lm import CausalLM
from treegraft_cli.verify import Verdict, accept_choices, process_logits, tree_buffers, verify_sampling

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 6
# root(0) → tokens 1, 2 (nodes 1, 2); node 1 → tokens 3, 4 (nodes 3, 4); node 2 → token 1 (node 5)
PARENTS = [-1, 0, 0, 1, 1, 2]
TOKENS = [0, 1, 2, 3, 4, 1]


def wrong_verify_sampling(logits, tokens, parents, uniforms, temperature, top_k=0, top_p=1.0) -> Verdict:
    """A plausible bug: when the draw misses every child, take the first child anyway (over-accepts drafts)."""
    probs = process_logits(logits, temperature, top_k, top_p)
    cdf = probs.cumsum(-1)
    choices = torch.searchsorted(cdf, (uniforms * cdf[..., -1])[..., None], right=True).squeeze(-1)
    batch, n = tokens.shape
    for node in range(n):
        children = [i for i in range(n) if int(parents[0, i]) == node]
        if children:
            hit = (tokens[:, children] == choices[:, node : node + 1]).any(dim=1)
            choices[:, node] = torch.where(hit, choices[:, node], tokens[:, children[0]])
    mask, depths = tree_buffers(parents)
    return accept_choices(tokens, parents, depths, mask, choices)


def exact_outcome_distribution(probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(committed tokens) for the walk: follow the tree while the sampled token is a child; the miss is the bonus."""
    children = {node: {TOKENS[i]: i for i in range(len(PARENTS)) if PARENTS[i] == node} for node in range(len(PARENTS))}
    outcomes: dict[tuple[int, ...], float] = {}

    def walk(node: int, prefix: tuple[int, ...], mass: float) -> None:
        for token in range(VOCAB):
            p = mass * float(probs[node, token])
            if token in children[node]:
                walk(children[node][token], prefix + (token,), p)
            else:
                outcomes[prefix + (token,)] = outcomes.get(prefix + (token,), 0.0) + p

    walk(0, (), 1.0)
    return outcomes


def empirical_outcomes(verify, logits: torch.Tensor, samples: int, seed: int) -> dict[tuple[int, ...], float]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([TOKENS]).expand(samples, -1)
    parents = torch.tensor([PARENTS]).expand(samples, -1)
    uniforms = torch.rand(samples, len(PARENTS), generator=generator)
    verdict = verify(logits.expand(samples, -1, -1), tokens, parents, uniforms, 0.8, 0, 0.95)
    counts: dict[tuple[int, ...], float] = {}
    paths, lengths, bonus = verdict.path.tolist(), verdict.num_accepted.tolist(), verdict.bonus.tolist()
    for path, length, extra in zip(paths, lengths, bonus, strict=False):
        key = tuple(TOKENS[i] for i in path[1 : length + 1]) + (extra,)
        counts[key] = counts.get(key, 0.0) + 1.0 / samples
    return counts


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


@pytest.fixture(scope="module")
def node_logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(1, len(PARENTS), VOCAB, generator=generator) * 1.5)


def test_sampling_acceptance_matches_target_distribution(node_logits):
    exact = exact_outcome_distribution(process_logits(node_logits[0], 0.8, 0, 0.95))
    distances = [total_variation(exact, empirical_outcomes(verify_sampling, node_logits, n, seed=n)) for n in (2_000, 200_000)]
    assert distances[1] < 0.01
    assert distances[1] < distances[0]


def test_wrong_sampler_fails_the_same_test(node_logits):
    exact = exact_outcome_distribution(process_logits(node_logits[0], 0.8, 0, 0.95))
    distance = total_variation(exact, empirical_outcomes(wrong_verify_sampling, node_logits, 200_000, seed=1))
    assert distance > 0.05


def test_top_k_top_p_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert (process_logits(logits, 1.0, top_k=2)[0, 2:] == 0).all()
    probs = process_logits(logits, 1.0, top_p=0.5)
    assert probs[0, 0] == 1.0  # the top token alone already holds over half the mass


class WrongBackend(VerifyBackend):
    def verify_sampling(self, logits, tokens, parents, uniforms, temperature, top_k, top_p):
        return wrong_verify_sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p)


# The tiny random model is nearly uniform at T=1 (max prob 1.6%); a low temperature concentrates the
# joint law of two tokens on a handful of cells so a few hundred draws measure it.
TEMPERATURE = 0.05


def engine_pair_distribution(pair, backend, samples: int) -> dict[tuple[int, int], float]:
    drafter, target = pair
    config = DecodeConfig(
        method="chain", tree=TreeConfig(budget=3, depth=3), sampling=SamplingConfig(temperature=TEMPERATURE), max_new_tokens=2
    )
    prompt = random_prompt(21, length=10)
    counts: dict[tuple[int, int], float] = {}
    decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model), backend=backend)
    for seed in range(samples):
        decoder.generator.manual_seed(seed)
        ids = tuple(decoder.generate(prompt).output_ids[:2])
        counts[ids] = counts.get(ids, 0.0) + 1.0 / samples
    return counts


def exact_pair_distribution(target, prompt: torch.Tensor) -> dict[tuple[int, int], float]:
    with torch.no_grad():
        first = process_logits(target.model(prompt[None]).logits[0, -1], TEMPERATURE)
        vocab = first.numel()
        batch = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = process_logits(target.model(batch).logits[:, -1], TEMPERATURE)
    joint = first[:, None] * second
    return {(a, b): float(joint[a, b]) for a, b in itertools.product(range(vocab), range(vocab)) if joint[a, b] > 1e-7}


def test_engine_samples_match_target(tiny_self_pair):
    """T>0 on a tiny model: the joint law of the first two tokens (the second one from a verified tree)."""
    exact = exact_pair_distribution(tiny_self_pair[1], random_prompt(21, length=10))
    good = total_variation(exact, engine_pair_distribution(tiny_self_pair, VerifyBackend(), 600))
    bad = total_variation(exact, engine_pair_distribution(tiny_self_pair, WrongBackend(), 600))
    assert good < 0.1, good
    assert bad > good + 0.1, (good, bad)
