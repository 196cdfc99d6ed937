"""EAGLE-3 heads as tree drafters: exactness, the draft-vocabulary map, the checkpoint layout, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompt, reference_greedy, speculative
from transformers import DynamicCache, LlamaConfig

from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.drafters import Eagle3Drafter, Eagle3TreeDrafter, make_model_drafter, make_strong_drafter
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.errors import ModelError
from treegraft_cli.lm import CausalLM, additive_mask
from treegraft_cli.methods import Prefill
from treegraft_cli.models import LoadedModel, load_model, load_pair, parse_pair, resolve
from treegraft_cli.models.eagle3 import aux_hidden_indices, save_eagle3_head
from treegraft_cli.models.eagle3_head import Eagle3Head
from treegraft_cli.pipeline import Pipeline
from treegraft_cli.scheduling.costs import measure_costs
from treegraft_cli.scheduling.policies import CallPolicy
from treegraft_cli.scheduling.profiler import ProfileSettings, measure_profile
from treegraft_cli.scheduling.rollouts import CollectSettings, probing_decoder
from treegraft_cli.tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree

DRAFT_VOCAB = 64
GRAFT_TREE = TreeConfig(budget=20, depth=4, top_k=4)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return load_model("tiny-random", dtype="fp32")


def head_config(target: LoadedModel, **overrides) -> LlamaConfig:
    """An EAGLE-3-shaped config (as in published checkpoints) sized for the tiny target."""
    text = target.model.config
    values = dict(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=text.hidden_size,
        intermediate_size=2 * text.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        vocab_size=text.vocab_size,
        draft_vocab_size=DRAFT_VOCAB,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def random_head(target: LoadedModel, seed: int = 0, **overrides) -> Eagle3Head:
    """Random weights and a random reduced draft vocabulary; embeddings borrowed from the target."""
    config = head_config(target, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = Eagle3Head(config, target.model.get_input_embeddings())
        draft = config.draft_vocab_size
        ids = torch.randperm(config.vocab_size)[:draft].sort().values
    head.d2t.copy_(ids - torch.arange(draft))
    head.t2d[ids] = True
    return head.eval()


def as_pair(head: Eagle3Head, target: LoadedModel) -> tuple[LoadedModel, LoadedModel]:
    return LoadedModel("eagle3:random", head, target.tokenizer), target


def reference_root_logits(head: Eagle3Head, target: LoadedModel, committed: torch.Tensor) -> torch.Tensor:
    """Root logits recomputed from scratch: target states from ``output_hidden_states``, one causal head pass."""
    with torch.no_grad():
        out = target.model(committed[None, :-1], output_hidden_states=True)
        indices = aux_hidden_indices(head.config, target.model.config.num_hidden_layers)
        states = torch.cat([out.hidden_states[i][0] for i in indices], dim=-1)
        n = committed.numel() - 1
        visible = torch.ones(n, n, dtype=torch.bool).tril()
        logits, _ = head(committed[1:], head.fuse(states), torch.arange(n), additive_mask(visible, head.dtype), DynamicCache(config=head.config))
    full = torch.full((head.config.vocab_size,), float("-inf"))
    full[head.draft_to_target] = logits[-1]
    return full


@pytest.mark.parametrize("method", ["chain", "dense", "graft"])
@pytest.mark.parametrize("draft_vocab", [DRAFT_VOCAB, None])  # reduced, and the full target vocabulary
def test_greedy_output_equals_plain_greedy(target, method, draft_vocab):
    overrides = {} if draft_vocab else {"draft_vocab_size": target.model.config.vocab_size}
    pair = as_pair(random_head(target, seed=1, **overrides), target)
    prompt = random_prompt(seed=11)
    config = DecodeConfig(method=method, tree=TreeConfig(budget=24, depth=4, top_k=4), max_new_tokens=40)
    result = speculative(pair, config, prompt)
    assert result.output_ids == reference_greedy(target, prompt, 40)
    # chain and dense call the head once per layer; graft may stop drafting early at a checkpoint
    calls = [step.drafter_calls["eagle3"] for step in result.steps]
    assert all(c == 4 for c in calls) if method != "graft" else all(1 <= c <= 4 for c in calls)


def test_factory_gives_eagle3_drafter_and_turns_on_capture(target):
    target_lm = CausalLM(target.model)
    drafter = make_model_drafter(CausalLM(random_head(target)), target_lm)
    assert isinstance(drafter, Eagle3Drafter)
    assert target_lm.capture_indices == (2, 2, 1)  # L=4: inputs of layers 2, L//2, L-3


def test_aux_layer_ids_from_config(target):
    config = head_config(target, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    assert aux_hidden_indices(config, 4) == (1, 2, 3)
    with pytest.raises(ModelError, match="layers"):
        aux_hidden_indices(head_config(target, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}), 4)


def test_draft_ids_map_to_target_ids(target):
    head = random_head(target, seed=2)
    chosen = 17
    head.lm_head = torch.nn.Linear(head.config.hidden_size, DRAFT_VOCAB)  # draft id 17 wins everywhere
    with torch.no_grad():
        head.lm_head.weight.zero_()
        head.lm_head.bias.copy_(torch.nn.functional.one_hot(torch.tensor(chosen), DRAFT_VOCAB).float())
    drafter = Eagle3Drafter(CausalLM(head), CausalLM(target.model))
    drafter.target.forward(random_prompt(3, length=10))
    drafter.reset()
    logits = drafter.begin_step(torch.cat([random_prompt(3, length=10), torch.tensor([5])]))
    mapped = torch.nonzero(head.t2d).flatten()
    assert logits.shape == (target.model.config.vocab_size,)
    assert int(logits.argmax()) == chosen + int(head.d2t[chosen]) == int(mapped[chosen])
    assert torch.isinf(logits[~head.t2d]).all() and torch.isfinite(logits[head.t2d]).all()


def test_accepted_path_states_feed_the_next_root(target):
    """After a commit of a 2-node path, the root logits equal a from-scratch recompute (states and positions right)."""
    head = random_head(target, seed=3, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    target_lm = CausalLM(target.model)
    drafter = Eagle3Drafter(CausalLM(head), target_lm)
    prompt = random_prompt(4, length=12)
    target_lm.forward(prompt)
    drafter.reset()
    committed = torch.cat([prompt, torch.tensor([7])])
    root_logits = drafter.begin_step(committed)
    assert torch.allclose(root_logits, reference_root_logits(head, target, committed), atol=1e-4)
    tree = DraftTree.from_root(7)
    children = tree.add_children(torch.zeros(3, dtype=torch.long), root_logits.topk(3).indices, torch.zeros(3), ORIGIN_MODEL)
    grandchildren_logits = drafter.forward_nodes(tree, children)
    tree.add_children(children, grandchildren_logits.argmax(dim=-1), torch.zeros(3), ORIGIN_MODEL)
    prefix = target_lm.cache_length
    target_lm.forward_tree(tree.tokens, tree.depths, tree.ancestor_mask())
    path = torch.tensor([2, 5])  # second child and its child: accepted as if the target agreed
    target_lm.commit(prefix + torch.cat([torch.zeros(1, dtype=torch.long), path]), prefix)
    drafter.commit(tree, path)
    committed = torch.cat([committed, tree.tokens[path], torch.tensor([9])])
    assert torch.allclose(drafter.begin_step(committed), reference_root_logits(head, target, committed), atol=1e-4)


def test_nodes_whose_parents_were_not_forwarded_are_forwarded_depth_first(target):
    head = random_head(target, seed=4)
    prompt = random_prompt(5, length=9)
    results = []
    for stepwise in (True, False):
        target_lm = CausalLM(target.model)
        drafter = Eagle3Drafter(CausalLM(head), target_lm)
        target_lm.forward(prompt)
        drafter.reset()
        drafter.begin_step(torch.cat([prompt, torch.tensor([3])]))
        tree = DraftTree.from_root(3)
        child = tree.add_children(torch.tensor([0]), torch.tensor([40]), torch.zeros(1), ORIGIN_MODEL)
        leaf = tree.add_children(child, torch.tensor([41]), torch.zeros(1), ORIGIN_MODEL)
        if stepwise:
            drafter.forward_nodes(tree, child)
        results.append(drafter.forward_nodes(tree, leaf))
        assert drafter.calls == 3 and int(tree.kv_slot[leaf]) == prompt.numel() + 1
    assert torch.allclose(results[0], results[1], atol=1e-5)


# -- the head as TreeGraft's strong drafter ---------------------------------------------------------------


def repetitive_prompt(seed: int) -> torch.Tensor:
    """A prompt that repeats itself, so the weak n-gram drafter hangs chains the head must rescore."""
    base = random_prompt(seed, length=10)
    return torch.cat([base, base, base[:5]])


def graft_decoder(pair, method: str, max_new_tokens: int = 32, **options) -> SpeculativeDecoder:
    drafter, target = pair
    config = DecodeConfig(method=method, tree=GRAFT_TREE, max_new_tokens=max_new_tokens, method_options=options)
    return SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model))


def test_strong_factory_gives_eagle3_tree_drafter(target, tiny_self_pair):
    target_lm = CausalLM(target.model)
    assert isinstance(make_strong_drafter(CausalLM(random_head(target)), target_lm), Eagle3TreeDrafter)
    assert target_lm.capture_indices == (2, 2, 1)
    assert not isinstance(make_strong_drafter(CausalLM(tiny_self_pair[0].model), target_lm), Eagle3Drafter)


@pytest.mark.parametrize("method", ["all-mid", "fixed:1,3", "fixed:3", "treegraft"])
@pytest.mark.parametrize(("seed", "reduced"), [(1, True), (2, False)])
def test_treegraft_with_head_equals_plain_greedy(target, method, seed, reduced):
    """With a reduced draft vocabulary n-gram tokens outside it get the floor log-prob, not -inf."""
    overrides = {} if reduced else {"draft_vocab_size": target.model.config.vocab_size}
    pair = as_pair(random_head(target, seed=seed, **overrides), target)
    prompt = repetitive_prompt(seed)
    result = graft_decoder(pair, method).generate(prompt)
    assert result.output_ids == reference_greedy(target, prompt, 32)
    assert all(step.nodes_verified <= GRAFT_TREE.budget for step in result.steps)
    calls = [step.drafter_calls["eagle3"] for step in result.steps]
    if method == "all-mid":  # the root row, then at least one head forward per later layer
        assert all(c >= GRAFT_TREE.depth for c in calls)
    elif method.startswith("fixed"):
        assert all(c >= 1 for c in calls)


def test_all_mid_with_head_equals_dense(target):
    """Calling at every layer grows EAGLE-2's dense tree from the same head: same steps, same τ."""
    pair = as_pair(random_head(target, seed=1, draft_vocab_size=target.model.config.vocab_size), target)
    prompt = random_prompt(3)
    dense = speculative(pair, DecodeConfig(method="dense", tree=GRAFT_TREE, max_new_tokens=32), prompt)
    result = graft_decoder(pair, "all-mid").generate(prompt)
    assert result.output_ids == dense.output_ids
    assert [s.accepted_length for s in result.steps] == [s.accepted_length for s in dense.steps]


class EveryThirdStep(CallPolicy):
    """Calls at every layer of every third step only: the head sees no tree for two steps in three."""

    def __init__(self):
        super().__init__(call_budget=10)
        self.builds = 0

    def wants_call(self, state) -> bool:
        self.builds += state.layer == 1
        return self.builds % 3 == 0


def test_steps_without_a_strong_call_keep_the_target_states(target):
    """Commits of uncalled steps pile up; the next call's root row equals a from-scratch recompute."""
    head = random_head(target, seed=3)
    decoder = graft_decoder(as_pair(head, target), "treegraft", max_new_tokens=30)
    decoder.method.policy = EveryThirdStep()
    prompt = repetitive_prompt(4)
    method, build = decoder.method, decoder.method.build
    roots = []

    def checked_build(committed, *args, **kwargs):
        tree, records = build(committed, *args, **kwargs)
        if any(r.called for r in records):  # the root row (row 0) is the one a from-scratch head pass gives
            reference = torch.log_softmax(reference_root_logits(head, target, committed), dim=-1).clamp_min(-1e4)
            roots.append(torch.allclose(method.strong.logp[0], reference, atol=1e-4))
        return tree, records

    method.build = checked_build
    result = decoder.generate(prompt)
    assert result.output_ids == reference_greedy(target, prompt, 30)
    calls = [step.drafter_calls["eagle3"] for step in result.steps]
    assert 0 in calls and any(c > 0 for c in calls)
    assert roots and all(roots)


def test_a_step_drafted_twice_gives_the_same_tree(target):
    """As ``collect`` does: the same step built again (and probed in between) needs no second root forward."""
    head = random_head(target, seed=5, draft_vocab_size=target.model.config.vocab_size)  # n-gram nodes survive the cut
    decoder = graft_decoder(as_pair(head, target), "fixed:2,4")
    committed = repetitive_prompt(5)  # the root continues the repetition: the n-gram drafter finds chains
    decoder.target.reset()
    logits = decoder.target.forward(committed[:-1])
    method = decoder.method
    method.start(Prefill(committed[:-1], logits))
    first, _ = method.build(committed)
    first_calls, head_rows = method.strong.calls, method.strong.committed_length
    assert head_rows == committed.numel() - 1 and first_calls >= 3  # the root row, then nodes at two layers
    probe, records = method.build(committed, forced={1: True, 2: False, 3: True})
    assert [r.called for r in records][:3] == [True, False, True]
    again, _ = method.build(committed)
    assert first.size > 0 and torch.equal(first.tokens, again.tokens) and torch.equal(first.parents, again.parents)
    assert torch.allclose(first.scores, again.scores)
    assert method.strong.calls == first_calls - 1  # everything but begin_step forwarded again
    assert method.strong.committed_length == head_rows
    assert bool((first.origins == ORIGIN_MODEL).any()) and bool((first.origins == ORIGIN_NGRAM).any())


def test_costs_and_collect_with_a_head(target):
    """The warm-up measurement and ``treegraft profile`` time a head forward; collect with a head stays lossless."""
    head = random_head(target, seed=6)
    costs = measure_costs(target.model, head, random_prompt(7, length=16), budget=12, width=3)
    assert costs.verify_ms > 0 and costs.strong_ms > 0
    settings = ProfileSettings(tree_tokens=(1, 6, 13), contexts=(16, 64), repeats=1, width=3)
    profile = measure_profile("eagle3:random:tiny-random", "fp32", target.model, head, settings)
    assert profile.drafter_ms and all(v > 0 for row in profile.drafter_ms for v in row)
    drafter, _ = as_pair(head, target)
    pipeline = Pipeline(target=target, drafter=drafter)
    config = DecodeConfig(method="treegraft", tree=TreeConfig(budget=12, depth=3, top_k=3), max_new_tokens=16)
    decoder, probe = probing_decoder(pipeline, CollectSettings("eagle3:random:tiny-random", "fp32", config), profile)
    prompt = repetitive_prompt(8)
    assert decoder.generate(prompt).output_ids == reference_greedy(target, prompt, 16)
    assert probe.rows and all(r["tau_call"] >= 1 and r["tau_skip"] >= 1 for r in probe.rows)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_checkpoint_directory_loads_back_identically(target, tmp_path, weights):
    head = random_head(target, seed=5)
    save_eagle3_head(head, tmp_path)
    if weights == "pytorch_model.bin":
        from safetensors.torch import load_file

        torch.save(load_file(str(tmp_path / "model.safetensors")), tmp_path / weights)
        (tmp_path / "model.safetensors").unlink()
    drafter, loaded_target = load_pair(f"eagle3:{tmp_path}:tiny-random", dtype="fp32")
    assert isinstance(drafter.model, Eagle3Head) and drafter.tokenizer is loaded_target.tokenizer
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    original, loaded = head.checkpoint_state(), drafter.model.checkpoint_state()
    assert original.keys() == loaded.keys() and "embed_tokens.weight" not in loaded
    assert all(torch.equal(original[k], loaded[k]) for k in original)
    prompt = random_prompt(6)
    config = DecodeConfig(method="dense", max_new_tokens=24)
    expected = speculative(as_pair(head, target), config, prompt)
    result = speculative((drafter, loaded_target), config, prompt)
    assert result.output_ids == expected.output_ids
    assert [s.accepted_length for s in result.steps] == [s.accepted_length for s in expected.steps]


def _write_head(target, directory, mutate=None, **overrides):
    head = random_head(target, **overrides)
    if mutate:
        mutate(head)
    save_eagle3_head(head, directory)
    return f"eagle3:{directory}:tiny-random"


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"target_hidden_size": 32}, "hidden size is 64"),
        ({"vocab_size": 300}, "300 tokens, the target has 259"),
        ({"hidden_size": 32, "target_hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}, "no embeddings"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, "4 layers"),
    ],
)
def test_head_that_does_not_fit_the_target_is_refused(target, tmp_path, overrides, match):
    if "vocab_size" in overrides or "hidden_size" in overrides:
        head = Eagle3Head(head_config(target, **overrides))  # own embeddings of the wrong shape
        save_eagle3_head(head, tmp_path)
        if "hidden_size" in overrides:  # a head that relies on the target's embeddings
            state = head.checkpoint_state()
            state.pop("embed_tokens.weight")
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
        pair = f"eagle3:{tmp_path}:tiny-random"
    else:
        pair = _write_head(target, tmp_path, **overrides)
    with pytest.raises(ModelError, match=match) as caught:
        load_pair(pair, dtype="fp32")
    assert caught.value.hint


def test_draft_ids_outside_the_target_vocabulary_are_refused(target, tmp_path):
    def corrupt(head):
        head.d2t[-1] = 10_000

    with pytest.raises(ModelError, match="d2t maps draft id 63") as caught:
        load_pair(_write_head(target, tmp_path, mutate=corrupt), dtype="fp32")
    assert "trained for this target" in caught.value.hint


def test_pair_syntax():
    assert parse_pair("eagle3:/heads/llama:llama-3.1-8b") == ("eagle3:/heads/llama", "llama-3.1-8b")
    assert parse_pair("eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B:llama-3.1-8b") == (
        "eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "llama-3.1-8b",
    )
    assert parse_pair("tiny-random-drafter:tiny-random") == ("tiny-random-drafter", "tiny-random")
    with pytest.raises(ModelError, match="no target"):
        parse_pair("eagle3:/heads/llama")
    ref = resolve("eagle3:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert ref.eagle3 and ref.hub_id == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    with pytest.raises(ModelError, match="not a directory or a hub id"):
        resolve("eagle3:./no/such/dir")
    with pytest.raises(ModelError, match="draft head"):
        load_model("eagle3:org/head")
