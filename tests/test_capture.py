"""--compile: the verify forward with static shapes (bucketed, padded trees over a StaticCache) is exact."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, reference_greedy, speculative
from typer.testing import CliRunner

from treegraft_cli.capture import StaticForwards, bucket, check_mode
from treegraft_cli.cli import app
from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.errors import ConfigError
from treegraft_cli.lm import CausalLM

TREE = TreeConfig(budget=20, depth=4, top_k=4)  # trees of 1..21 nodes: buckets 1, 2, 4, 8, 16 and 32


def repetitive_prompt(seed: int) -> torch.Tensor:
    base = random_prompt(seed, length=12)
    return torch.cat([base, base, base[:6]])


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("method", ["ar", "chain", "dense", "adjacency", "graft", "all-small", "all-mid", "fixed:1,3", "treegraft"])
def test_static_shapes_match_greedy(tiny_self_pair, method):
    prompt = repetitive_prompt(5)
    expected = reference_greedy(tiny_self_pair[1], prompt, 40)
    config = DecodeConfig(method=method, tree=TREE, max_new_tokens=40, compile="static")
    result = speculative(tiny_self_pair, config, prompt)
    assert result.output_ids == expected
    assert all(step.nodes_verified <= TREE.budget for step in result.steps)


def test_a_static_cache_serves_later_requests_exactly(tiny_self_pair):
    """The static cache (and what a mode captured) is kept across requests: a second prompt decodes exactly."""
    drafter, target = tiny_self_pair
    config = DecodeConfig(method="dense", tree=TREE, max_new_tokens=30, compile="static")
    decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model))
    kept = []
    for seed in (1, 2, 1):
        prompt = random_prompt(seed, length=10 + 7 * seed)
        assert decoder.generate(prompt).output_ids == reference_greedy(target, prompt, 30)
        kept.append((decoder.target.static, decoder.drafter.static))
    assert kept[0][0] is not None and kept[0][1] is not None and all(k == kept[0] for k in kept)


def test_padding_sees_only_the_root_and_itself():
    static = StaticForwards(torch.nn.Identity(), "static", capacity=16, dtype=torch.float32, device=torch.device("cpu"))
    chain = torch.ones(3, 3, dtype=torch.bool).tril()  # root, child, grandchild
    buffers = static.tree_inputs(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), chain, prefix=3)
    visible = buffers["mask"][0, 0] == 0  # [4, 16]: three nodes and one padding node
    assert torch.nonzero(visible[2]).flatten().tolist() == [0, 1, 2, 3, 4, 5]  # committed rows, its ancestors, itself
    assert torch.nonzero(visible[3]).flatten().tolist() == [0, 1, 2, 3, 6]  # committed rows, the root, itself


def test_padding_rows_see_only_themselves():
    static = StaticForwards(torch.nn.Identity(), "static", capacity=16, dtype=torch.float32, device=torch.device("cpu"))
    shown = torch.full((3, 5), torch.finfo(torch.float32).min)
    shown[:, :2] = 0  # every row sees the two committed rows
    buffers = static.rows_inputs(torch.tensor([5, 6, 7]), torch.tensor([2, 3, 4]), shown, prefix=2)
    visible = buffers["mask"][0, 0] == 0  # [4, 16]
    assert [torch.nonzero(row).flatten().tolist() for row in visible] == [[0, 1], [0, 1], [0, 1], [5]]
    causal = static.rows_inputs(torch.tensor([5, 6, 7]), torch.tensor([2, 3, 4]), None, prefix=2)["mask"][0, 0] == 0
    assert [int(row.sum()) for row in causal] == [3, 4, 5, 6]  # row j: every cache row up to its own, 2 + j


@pytest.mark.parametrize("method", ["chain", "dense", "treegraft"])
def test_the_drafter_forwards_with_static_shapes_too(tiny_self_pair, method):
    drafter, target = tiny_self_pair
    config = DecodeConfig(method=method, tree=TREE, max_new_tokens=30, compile="static",
                          method_options={"policy": "all-mid"} if method == "treegraft" else {})
    decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model))
    prompt = repetitive_prompt(7)
    assert decoder.generate(prompt).output_ids == reference_greedy(target, prompt, 30)
    static = decoder.drafter.static
    assert static is not None and static is not decoder.target.static
    assert static.runners  # the drafter's forwards ran padded, through the same runners a capture replays


def test_padded_rows_leave_the_cache_as_unpadded_forwards_do(tiny_self_pair):
    """Rows padded to a bucket: the cache holds the real rows only, and the next forward writes over the padding."""
    target = tiny_self_pair[1].model
    dynamic, static = CausalLM(target), CausalLM(target)
    static.use_static("static", 128)
    static.reset()
    prompt = random_prompt(4, length=13)  # padded to 16 rows
    steps = [(prompt, None), (prompt[:3], "mask"), (prompt[5:6], None)]
    for tokens, kind in steps:
        length = dynamic.cache_length
        mask = None
        if kind == "mask":  # every row sees the cache, and row j the earlier rows of this forward up to itself
            mask = torch.zeros(3, length + 3)
            mask[:, length:] = torch.full((3, 3), torch.finfo(torch.float32).min).triu(1)
        want = dynamic.forward(tokens, mask=mask)
        got = static.forward(tokens, mask=mask)
        assert static.cache_length == dynamic.cache_length
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class ReplayedOnCPU:
    """Stands in for ``CudaGraphs`` on CPU: a replay reruns the forward and writes its logits into the tensor the
    capture returned, as a graph replay does; the capture runs the forward once (a real one launches nothing: the
    write position it moves is restored after it)."""

    def __init__(self):
        self.captures = 0

    def warm_up(self, run, restore):
        run()
        restore()

    def capture(self, run):
        self.captures += 1
        output = run()

        def replay():
            return output.copy_(run())

        return replay


def test_replayed_forwards_match_the_dynamic_path(tiny_self_pair):
    """The ``cudagraphs`` bookkeeping on CPU: captures restore the cache's write position, replays write one output
    buffer (rows a drafter keeps are copies), trees and rows share a bucket, and a commit keeps the right rows."""
    target = tiny_self_pair[1].model
    dynamic, replayed = CausalLM(target), CausalLM(target)
    replayed.use_static("cudagraphs", 128)
    graphs = replayed.static.graphs = ReplayedOnCPU()
    replayed.reset()
    prompt = random_prompt(8, length=13)
    want, got = dynamic.forward(prompt), replayed.forward(prompt)  # padded to 16 rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    chain = torch.ones(3, 3, dtype=torch.bool).tril()
    tokens, depths = prompt[:3], torch.arange(3)
    torch.testing.assert_close(replayed.forward_tree(tokens, depths, chain), dynamic.forward_tree(tokens, depths, chain),
                               rtol=1e-5, atol=1e-5)  # bucket 4
    for lm in (dynamic, replayed):
        lm.commit(torch.tensor([13, 15]), 13)  # the root and the grandchild's row, as a commit of a path would
    kept, kept_want = replayed.forward(prompt[4:5]), dynamic.forward(prompt[4:5])  # bucket 1
    later, later_want = replayed.forward(prompt[6:7]), dynamic.forward(prompt[6:7])  # bucket 1 again: a replay
    for a, b in ((kept, kept_want), (later, later_want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert replayed.cache_length == dynamic.cache_length == 17
    assert graphs.captures == 3  # buckets 16, 4 and 1, each captured once


def test_cudagraphs_need_cuda_and_heads_need_compile_off(tiny_self_pair):
    drafter, target = tiny_self_pair
    with pytest.raises(ConfigError, match="CUDA"):
        SpeculativeDecoder(CausalLM(target.model), DecodeConfig(method="dense", compile="cudagraphs"),
                           drafter=CausalLM(drafter.model))
    with pytest.raises(ConfigError, match="--compile"):
        DecodeConfig(compile="graphs")


def test_cudagraphs_refuse_models_spread_over_devices():
    """A graph is captured on one device's stream: a target or drafter with weights on two devices is refused with
    the fix, before anything runs (``meta`` stands in for a second GPU)."""
    near, far = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")
    gpu = torch.device("cuda")
    with pytest.raises(ConfigError, match="spread over cpu, meta") as refused:
        check_mode("cudagraphs", gpu, [torch.nn.Sequential(near, far)])
    assert "one GPU" in refused.value.hint
    check_mode("cudagraphs", gpu, [near])  # one device: taken
    check_mode("static", gpu, [near, far])  # the device rule is cudagraphs' alone


def test_generate_takes_compile(tiny_self_pair):
    args = ["generate", "--pair", "tiny-random@layers=2:tiny-random", "-p", "hi", "-n", "6", "--dtype", "fp32",
            "--compile", "static", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_torch_compile_matches_greedy(tiny_self_pair):
    """torch.compile of the static verify and drafter forwards (minutes on CPU: it compiles once per model and bucket)."""
    prompt = repetitive_prompt(6)
    config = DecodeConfig(method="dense", tree=TreeConfig(budget=6, depth=3, top_k=2), max_new_tokens=24, compile="compile")
    assert speculative(tiny_self_pair, config, prompt).output_ids == reference_greedy(tiny_self_pair[1], prompt, 24)
