"""Every method samples exactly as the target at T > 0, end to end, and a wrong acceptance rule is caught.

What is compared: the first ``NEW`` generated tokens of ``SpeculativeDecoder.generate`` (the first from
the prefill, the rest from verified trees, over one or two steps, so a faulty KV commit shows too),
drawn ``DRAWS`` times with different seeds, against their exact law computed from the target's own
logits (temperature, top-k and top-p applied as the verifier applies them).

The distance is total variation between the empirical and the exact law; it passes when it is below
the 99.9% quantile of the total variation of ``n`` independent exact draws (simulated, seeded), a bound
that shrinks like 1/sqrt(n). It is checked after a quarter of the draws and after all of them.

Set-up that gives the test power (a wrong rule changes the law only where drafts are accepted):
* the tiny target decodes greedily into a loop; that loop is the prompt, so n-gram and retrieval
  drafters find matches, and the target's law of the next tokens spreads over a few cells;
* the drafter is the target itself (``tiny-random:tiny-random``), so model-drafted trees hold the
  tokens the target samples; the EAGLE-3 head is random but drafts from a reduced vocabulary that holds
  the target's likely tokens (a real EAGLE-3 feature), so its drafts are accepted too;
* a deliberately wrong rule (``UnnormalisedRule``: accept each drafted child with probability p(x) as if
  it were alone, and draw the bonus from the full p instead of the residual) must exceed the bound.
Methods never see the sampling settings (drafts are built before the uniforms are drawn, only the
verifier reads them), so the two settings, top-k and top-k with top-p, alternate over the methods.
Draws are seeded. TreeGraft's call policies decide from measured times; here they run on given costs
(``verify_ms``, ``strong_ms``) and a clock that advances one millisecond per read, so their trees, and
the test's power, are the same on every machine (a slow CI runner once measured its way to root-only
steps).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from conftest import random_prompt
from test_eagle3 import head_config

from treegraft_cli.backends import VerifyBackend
from treegraft_cli.config import DecodeConfig, SamplingConfig, TreeConfig
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.lm import CausalLM
from treegraft_cli.models import LoadedModel, load_pair
from treegraft_cli.models.eagle3_head import Eagle3Head
from treegraft_cli.scheduling.artifact import DistilledScheduler, Normaliser, build_mlp
from treegraft_cli.scheduling.policies import FEATURE_NAMES
from treegraft_cli.verify import Verdict, process_logits

NEW = 3  # tokens compared per draw
DRAWS = 300
TREE = TreeConfig(budget=12, depth=3, top_k=3)
TOP_K = SamplingConfig(temperature=1.0, top_k=2)
TOP_K_TOP_P = SamplingConfig(temperature=0.6, top_k=4, top_p=0.5)  # top-p drops 2 of the 4 tokens top-k keeps
LEVEL = 0.999  # quantile of the null distance used as the bound
GIVEN_COSTS = {"verify_ms": 1.0, "strong_ms": 0.2}  # TreeGraft's costs, given so that no warm-up times them
pytestmark = pytest.mark.usefixtures("one_thread")
# (id, method, method options, drafter, sampling)
CASES = [
    ("chain", "chain", {}, "self", TOP_K),
    ("dense", "dense", {}, "self", TOP_K_TOP_P),
    ("adjacency", "adjacency", {}, None, TOP_K),
    ("graft", "graft", {}, "self", TOP_K_TOP_P),
    ("ngram", "ngram", {}, None, TOP_K),
    # three tokens after a short prompt: matches of the last token alone are what the n-gram drafter finds there
    ("all-small", "all-small", {"min_n": 1}, "self", TOP_K_TOP_P),
    ("all-mid", "all-mid", {}, "self", TOP_K),
    ("fixed:1,3", "fixed:1,3", {}, "self", TOP_K_TOP_P),
    ("treegraft", "treegraft", {}, "self", TOP_K),
    ("treegraft-learned", "treegraft", {"scheduler": "LEARNED"}, "self", TOP_K_TOP_P),
    ("eagle3-dense", "dense", {}, "eagle3", TOP_K),
    ("eagle3-treegraft", "treegraft", {}, "eagle3", TOP_K_TOP_P),
]


class UnnormalisedRule(VerifyBackend):
    """Wrong on purpose: each drafted child x is accepted with probability p(x) in turn (not p(x) over the mass
    left after the earlier siblings), and after rejecting every child the bonus is drawn from the full p (not
    from the residual). Correct for a single child with p ≤ 1; biased wherever a node has two or more."""

    def verify_sampling(self, logits, tokens, parents, uniforms, temperature, top_k, top_p) -> Verdict:
        probs = process_logits(logits[0], temperature, top_k, top_p)  # [nodes, vocab]
        generator = torch.Generator().manual_seed(int(uniforms[0, 0] * 2**31))  # seeded by the engine's draw
        node, path = 0, [0]
        while True:
            children = (parents[0] == node).nonzero().flatten().tolist()
            taken = [c for c in children if torch.rand((), generator=generator) < probs[node, tokens[0, c]]][:1]
            if not taken:
                break
            node = taken[0]
            path.append(node)
        bonus = torch.multinomial(probs[node], 1, generator=generator)
        padded = torch.full_like(tokens, -1)
        padded[0, : len(path)] = torch.tensor(path)
        return Verdict(path=padded, num_accepted=torch.tensor([len(path) - 1]), bonus=bonus)


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    return load_pair("tiny-random:tiny-random", dtype="fp32")


@pytest.fixture(scope="module")
def prompt(pair) -> torch.Tensor:  # [48]
    """The target's own greedy continuation of a random prompt: it has fallen into a loop by its end."""
    start = random_prompt(5, length=8)
    target = pair[1].model
    return target.generate(start[None], attention_mask=torch.ones_like(start)[None], max_new_tokens=40, do_sample=False)[0]


def exact_law(target, prompt: torch.Tensor, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(first NEW tokens) under the target's processed distribution, one batched forward per position."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NEW):
        prefixes = list(law)
        batch = torch.stack([torch.cat([prompt, torch.tensor(p, dtype=torch.long)]) for p in prefixes])
        with torch.no_grad():
            probs = process_logits(target(batch).logits[:, -1], sampling.temperature, sampling.top_k, sampling.top_p)
        law = {p + (t,): law[p] * float(row[t]) for p, row in zip(prefixes, probs, strict=True)
               for t in row.nonzero().flatten().tolist()}
    return law


def total_variation(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for outcome in samples:
        counts[outcome] = counts.get(outcome, 0) + 1
    return 0.5 * sum(abs(counts.get(k, 0) / len(samples) - law.get(k, 0.0)) for k in set(counts) | set(law))


def bound(law: dict[tuple[int, ...], float], draws: int) -> float:
    """The LEVEL quantile of the distance of ``draws`` exact draws from the law (simulated, seeded)."""
    probs = torch.tensor(list(law.values()), dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    counts = torch.stack([torch.bincount(torch.multinomial(probs, draws, replacement=True, generator=generator),
                                         minlength=len(probs)) for _ in range(4000)])
    distances = 0.5 * (counts / draws - probs).abs().sum(-1)
    return float(torch.quantile(distances, LEVEL))


def learned_artifact(directory, early: bool = True) -> str:
    """A scheduler artifact in distill's format, weights set by hand: margin = relu(0.5 − layer_fraction) − 0.01,
    so the learned policy calls in the first half of the tree's layers and skips after (``early=False``: margin =
    relu(layer_fraction − 0.5) − 0.01, skips in the first half and calls after)."""
    layer = FEATURE_NAMES.index("layer_fraction")
    mlp = build_mlp()
    with torch.no_grad():
        first, second, last = (m for m in mlp if isinstance(m, torch.nn.Linear))
        for parameter in mlp.parameters():
            parameter.zero_()
        first.weight[0, layer], first.bias[0] = (-1.0, 0.5) if early else (1.0, -0.5)
        second.weight[0, 0] = 1.0
        last.weight[0, 0], last.bias[0] = 1.0, -0.01
    scale = torch.zeros(len(FEATURE_NAMES)).index_fill_(0, torch.tensor([layer]), 1.0)
    path = directory / ("scheduler.json" if early else "late_scheduler.json")
    DistilledScheduler(mlp, Normaliser(torch.zeros(len(FEATURE_NAMES)), scale, 0.0, 1.0)).save(path)
    return str(path)


def counting_clock() -> Callable[[], float]:
    """A clock for the call policies that advances one millisecond per read (seconds, like ``time.perf_counter``)."""
    reads = itertools.count()
    return lambda: next(reads) / 1000.0


def eagle3_head(target: LoadedModel, prompt: torch.Tensor) -> Eagle3Head:
    """A random head drafting from 8 tokens: the ones the target may sample after the prompt, then random ones."""
    likely = [t for cell in exact_law(target.model, prompt, TOP_K) for t in cell]
    vocab = target.model.config.vocab_size
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = list(dict.fromkeys(likely + torch.randperm(vocab).tolist()))[:8]
        head = Eagle3Head(head_config(target, draft_vocab_size=8), target.model.get_input_embeddings())
    ids = torch.tensor(sorted(ids))
    head.d2t.copy_(ids - torch.arange(len(ids)))
    head.t2d[ids] = True
    return head.eval()


def sample(decoder: SpeculativeDecoder, prompt: torch.Tensor, draws: int) -> tuple[list[tuple[int, ...]], float, set[int]]:
    """``draws`` outcomes (seeds 0..draws-1), the mean number of drafted tokens accepted per step, and the
    numbers of model-drafter calls the steps made."""
    outcomes, accepted, steps, calls = [], 0, 0, set()
    for seed in range(draws):
        decoder.generator.manual_seed(seed)
        generation = decoder.generate(prompt)
        outcomes.append(tuple(generation.output_ids[:NEW]))
        accepted += sum(s.accepted_length - 1 for s in generation.steps)
        steps += len(generation.steps)
        calls |= {s.drafter_calls.get("model", 0) for s in generation.steps}
    return outcomes, accepted / max(steps, 1), calls


@pytest.mark.parametrize(("method", "options", "drafter", "sampling"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_method_samples_like_the_target(method, options, drafter, sampling, pair, prompt, tmp_path, request):
    draft_model, target = pair
    if drafter == "eagle3":
        draft_model = LoadedModel("eagle3:random", eagle3_head(target, prompt), target.tokenizer)
    options = {k: learned_artifact(tmp_path) if v == "LEARNED" else v for k, v in options.items()}
    if method == "treegraft":
        options |= GIVEN_COSTS
    config = DecodeConfig(method=method, tree=TREE, sampling=sampling, max_new_tokens=NEW, method_options=options)
    shared: dict = {}  # the treegraft warm-up measures costs once for both decoders

    def decoder(backend: VerifyBackend) -> SpeculativeDecoder:
        drafter_lm = CausalLM(draft_model.model) if drafter else None
        built = SpeculativeDecoder(CausalLM(target.model), config, drafter=drafter_lm, backend=backend, measurements=shared)
        policy = getattr(built.method, "policy", None)
        if hasattr(policy, "clock"):
            policy.clock = counting_clock()
        return built

    law = exact_law(target.model, prompt, sampling)
    outcomes, accepted, calls = sample(decoder(VerifyBackend()), prompt, DRAWS)
    wrong, _, _ = sample(decoder(UnnormalisedRule()), prompt, DRAWS)
    quarter, full = DRAWS // 4, DRAWS
    distances = {quarter: total_variation(outcomes[:quarter], law), full: total_variation(outcomes, law)}
    bounds = {quarter: bound(law, quarter), full: bound(law, full)}
    wrong_distance = total_variation(wrong, law)
    print(f"\n{request.node.callspec.id}: TV {distances[quarter]:.3f} (bound {bounds[quarter]:.3f}) "
          f"after {quarter} draws, {distances[full]:.3f} (bound {bounds[full]:.3f}) after {full}; "
          f"wrong rule {wrong_distance:.3f}; drafted tokens accepted per step {accepted:.2f}")
    assert accepted > 0.2, "drafts are rarely accepted: the test would have no power here"
    if options.get("scheduler"):  # the learned policy decided both ways
        assert min(calls) < TREE.depth and max(calls) > 0, calls
    assert all(distances[n] <= bounds[n] for n in distances), (distances, bounds)
    assert wrong_distance > bounds[full], f"the wrong rule passed as lossless: {wrong_distance:.3f} <= {bounds[full]:.3f}"
