"""Every Triton kernel against its torch reference on random trees (interpreted on CPU in CI).

Integer outputs must be equal exactly; the sampling cases are built so no float lands near a boundary
(see ``kernel_cases``), which makes exact equality the right test there too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    midpoint_uniforms,
    permuted_logits,
    random_graft_case,
    random_parents,
    separated_top_p,
    tokens_against,
)

from treegraft_cli import lm, verify
from treegraft_cli.drafters import adjacency
from treegraft_cli.drafters.rank_template import BASE_TEMPLATE, build_template, scale_counts
from treegraft_cli.kernels import triton_status

if not triton_status(torch.device("cpu"))[0]:
    pytest.skip("triton cannot run here (not installed, or TRITON_INTERPRET unset)", allow_module_level=True)

from treegraft_cli.kernels import graft_candidates, greedy, kv_commit, sampling, tree_buffers, walk  # noqa: E402

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True)
shapes = st.tuples(st.integers(1, 3), st.integers(1, 32), st.sampled_from([64, 200, 512]), st.integers(0, 2**31 - 1))


def assert_same_verdict(got: verify.Verdict, want: verify.Verdict) -> None:
    assert torch.equal(got.path, want.path)
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.bonus, want.bonus)


@SETTINGS
@given(batch=st.integers(1, 3), n=st.integers(1, 32), seed=st.integers(0, 2**31 - 1), shuffled=st.booleans())
def test_tree_buffers(batch, n, seed, shuffled):
    generator = torch.Generator().manual_seed(seed)
    parents = random_parents(generator, batch, n)
    if shuffled and n > 1:
        # any node order: relabel non-root nodes at random, the reference does not need parents first
        relabel = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(n - 1, generator=generator) + 1])
        parents = torch.where(parents >= 0, relabel[parents.clamp(min=0)], -1)
        parents = torch.empty_like(parents).scatter_(1, relabel.expand(batch, n), parents)
    mask, depths = tree_buffers.tree_buffers(parents)
    want_mask, want_depths = verify.tree_buffers(parents)
    assert torch.equal(mask, want_mask)
    assert torch.equal(depths, want_depths)


@SETTINGS
@given(shape=shapes)
def test_accept_walk(shape):
    batch, n, vocab, seed = shape
    generator = torch.Generator().manual_seed(seed)
    parents = random_parents(generator, batch, n)
    choices = torch.randint(0, vocab, (batch, n), generator=generator)
    tokens = tokens_against(generator, parents, choices, vocab)
    assert_same_verdict(walk.accept(tokens, parents, choices), verify.accept(tokens, parents, choices))


@SETTINGS
@given(shape=shapes, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_greedy(shape, dtype):
    batch, n, vocab, seed = shape
    generator = torch.Generator().manual_seed(seed)
    # small integers: many tied maxima, which must resolve to the first index as in torch
    logits = torch.randint(-4, 4, (batch, n, vocab), generator=generator).to(dtype)
    choices = verify.argmax_choices(logits)
    assert torch.equal(greedy.argmax_choices(logits), choices)
    parents = random_parents(generator, batch, n)
    tokens = tokens_against(generator, parents, choices, vocab)
    assert_same_verdict(greedy.verify_greedy(logits, tokens, parents), verify.verify_greedy(logits, tokens, parents))


def test_greedy_across_vocab_blocks():
    """A vocabulary wider than one block: the maximum in a later block, and a tie across blocks."""
    logits = torch.zeros(1, 2, 9000)
    logits[0, 0, 8500] = 3.0
    logits[0, 1, [100, 5000]] = 2.0
    assert greedy.argmax_choices(logits).tolist() == [[8500, 100]]


@SETTINGS
@given(
    shape=shapes,
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 5, 40]),
    top_p_at=st.sampled_from([None, 0.1, 0.5, 0.9]),
)
def test_sampling(shape, temperature, top_k, top_p_at):
    batch, n, vocab, seed = shape
    generator = torch.Generator().manual_seed(seed)
    logits = permuted_logits(generator, batch, n, vocab, scale=3.0)
    top_p = 1.0 if top_p_at is None else separated_top_p(logits[0, 0], temperature, top_k, top_p_at)
    uniforms = midpoint_uniforms(generator, verify.process_logits(logits, temperature, top_k, top_p))
    choices = verify.sample_choices(logits, uniforms, temperature, top_k, top_p)
    assert torch.equal(sampling.sample_choices(logits, uniforms, temperature, top_k, top_p), choices)
    parents = random_parents(generator, batch, n)
    tokens = tokens_against(generator, parents, choices, vocab)
    got = sampling.verify_sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p)
    assert_same_verdict(got, verify.verify_sampling(logits, tokens, parents, uniforms, temperature, top_k, top_p))


def test_sampling_across_vocab_blocks():
    """Two vocabulary blocks with top-k and top-p: the cut and the sample cross block edges."""
    generator = torch.Generator().manual_seed(0)
    logits = permuted_logits(generator, 1, 3, 6000, scale=4.0)
    top_p = separated_top_p(logits[0, 0], 0.8, 300, 0.6)
    uniforms = midpoint_uniforms(generator, verify.process_logits(logits, 0.8, 300, top_p))
    want = verify.sample_choices(logits, uniforms, 0.8, 300, top_p)
    assert torch.equal(sampling.sample_choices(logits, uniforms, 0.8, 300, top_p), want)


@SETTINGS
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([4, 16, 24]),
    prefix=st.integers(0, 12),
    n=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_kv_commit(layers, heads, head_dim, prefix, n, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    seq = prefix + n
    caches = [torch.randn(1, heads, seq, head_dim, generator=generator).to(dtype) for _ in range(2 * layers)]
    kept = torch.rand(n, generator=generator) < 0.5
    kept[0] = True  # the root row always stays
    keep = prefix + torch.nonzero(kept).flatten()
    want = [c.clone() for c in caches]
    lm.gather_rows(want, keep, prefix)
    kv_commit.gather_rows(caches, keep, prefix)
    assert all(torch.equal(c, w) for c, w in zip(caches, want, strict=True))


def test_kv_commit_mixed_shapes_fall_back():
    """Layers of different lengths (sliding-window caches) take the per-layer reference path."""
    caches = [torch.randn(1, 2, 10, 8), torch.randn(1, 2, 12, 8)]
    want = [c.clone() for c in caches]
    keep = torch.tensor([5, 7, 9])
    lm.gather_rows(want, keep, 5)
    kv_commit.gather_rows(caches, keep, 5)
    assert all(torch.equal(c, w) for c, w in zip(caches, want, strict=True))


def test_kv_commit_on_a_block_cache_equals_the_reference(tiny_pair):
    """A ``KVBlock`` buffer (every layer's keys and values along the batch, capacity past the rows in use) is one
    tensor to the kernel: a commit through it leaves the cache the torch reference leaves."""
    _, target = tiny_pair
    prompt = torch.randint(0, target.model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(3))
    caches = []
    for gather in (lm.gather_rows, kv_commit.gather_rows):
        model_lm = lm.CausalLM(target.model)
        model_lm.forward(prompt)
        model_lm.commit(torch.tensor([9, 11, 12]), 9, gather=gather)
        caches.append(model_lm)
    reference, ours = caches
    assert ours.cache_length == reference.cache_length == 12
    assert ours.cache.blocks[0].capacity > 12
    for mine, theirs in zip(ours.cache.layers, reference.cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    vocab=st.integers(4, 40),
    k=st.integers(1, 6),
    layers=st.integers(0, 5),
    written=st.integers(0, 60),
    budget=st.integers(1, 70),
    slots=st.integers(0, 70),
    depth_known=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_graft_candidates(vocab, k, layers, written, budget, slots, depth_known, seed):
    """Tokens, resolved nodes, scores (merges raised), kept and count equal the reference's exactly, with unwritten
    rows, and with the tree's depth known or not; so do the appended nodes laid out from them."""
    generator = torch.Generator().manual_seed(seed)
    tree, table = random_graft_case(generator, vocab, k, layers, written)
    template = build_template(scale_counts(BASE_TEMPLATE, max(1, min(slots, budget)), table.k), budget, table.k)
    tree_depth = tree.max_depth if depth_known else len(template.levels)
    inputs = (table._successors, tree.tokens, tree.parents, tree.scores, template, slots, tree_depth)
    got, want = graft_candidates.graft_candidates(*inputs), adjacency.graft_candidates(*inputs)
    for name, g, w in zip(("tokens", "node", "scores", "kept", "count"), got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    tokens, node, scores, kept, count = want
    laid_out = (tokens, node, scores, kept, template, int(count))
    got, want = graft_candidates.appended_nodes(*laid_out), adjacency.appended_nodes(*laid_out)
    for name, g, w in zip(("parents", "tokens", "scores", "depths", "inside"), got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), name



def test_every_launch_is_made_current_on_its_tensors_device(monkeypatch):
    """Triton launches on the current GPU; a target spread over GPUs (or a drafter on another) holds logits, caches
    and trees elsewhere, so every launcher makes its tensors' device current first (``lm.on_device``). A double
    records the device each launch asked for."""
    from contextlib import contextmanager

    asked: list[tuple[str, torch.device]] = []

    def recorder(name: str):
        @contextmanager
        def record(device):
            asked.append((name, torch.device(device)))
            yield

        return record

    for module in (graft_candidates, greedy, kv_commit, sampling, tree_buffers, walk):
        monkeypatch.setattr(module, "on_device", recorder(module.__name__.rsplit(".", 1)[1]))
    generator = torch.Generator().manual_seed(0)
    parents = random_parents(generator, 1, 6)
    logits = torch.randn(1, 6, 64, generator=generator)
    tokens = tokens_against(generator, parents, verify.argmax_choices(logits), 64)
    tree_buffers.tree_buffers(parents)
    greedy.verify_greedy(logits, tokens, parents)  # the argmax, then the walk
    sampling.verify_sampling(logits, tokens, parents, torch.rand(1, 6, generator=generator), 0.8)
    kv_commit.gather_rows([torch.randn(1, 2, 8, 4) for _ in range(2)], torch.tensor([4, 6]), 4)
    tree, table = random_graft_case(generator, 16, 4, 2, 16)
    template = build_template(scale_counts(BASE_TEMPLATE, 4, table.k), 8, table.k)
    *candidates, count = graft_candidates.graft_candidates(table._successors, tree.tokens, tree.parents, tree.scores,
                                                           template, 4, tree.max_depth)
    graft_candidates.appended_nodes(*candidates, template, int(count))
    cpu = torch.device("cpu")
    assert asked == [("tree_buffers", cpu), ("greedy", cpu), ("walk", cpu), ("sampling", cpu), ("walk", cpu),
                     ("kv_commit", cpu), ("graft_candidates", cpu), ("graft_candidates", cpu)]
