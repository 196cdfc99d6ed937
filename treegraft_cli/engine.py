"""The decoding loop: prefill → (draft → verify → commit → observe) until max new tokens or EOS."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .backends import VerifyBackend, select_backend
from .config import DecodeConfig
from .lm import CausalLM
from .methods import Method, Models, Observation, Prefill, create_method
from .syncs import HostReads, audited_count
from .verify import Verdict


@dataclass(frozen=True)
class StepStats:
    """What one step did and what it cost."""

    accepted_length: int  # τ: accepted draft nodes + the bonus
    nodes_verified: int  # non-root nodes in the tree
    drafter_calls: dict[str, int]
    draft_s: float  # building the tree, drafter forwards included
    verify_s: float  # the target's verification forward
    host_s: float  # tree buffers, acceptance, KV commit, observation
    drafter_forward_s: float = 0.0  # the part of draft_s spent inside drafter model forwards
    syncs: int = 0  # host-device synchronisations of the step outside model forwards (``HostReads``)
    audited_syncs: int | None = None  # the same counted by a running ``SyncAuditor``; None without one

    @property
    def host_overhead_s(self) -> float:
        """Step time outside any model forward: what the Python and tensor bookkeeping costs."""
        return self.draft_s - self.drafter_forward_s + self.host_s


@dataclass
class Generation:
    """The result of one request."""

    prompt_length: int
    output_ids: list[int]
    prefill_s: float = 0.0
    wall_s: float = 0.0
    steps: list[StepStats] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def mean_accepted_length(self) -> float:
        if not self.steps:
            return 0.0
        return sum(s.accepted_length for s in self.steps) / len(self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        return {
            "prefill_s": self.prefill_s,
            "draft_s": sum(s.draft_s for s in self.steps),
            "verify_s": sum(s.verify_s for s in self.steps),
            "host_s": sum(s.host_s for s in self.steps),
            "host_overhead_s": sum(s.host_overhead_s for s in self.steps),
        }


class SpeculativeDecoder:
    """Runs one method against one target. Build once, call ``generate`` per request."""

    def __init__(
        self,
        target: CausalLM,
        config: DecodeConfig,
        drafter: CausalLM | None = None,
        eos_token_ids: Sequence[int] = (),
        backend: VerifyBackend | None = None,
        measurements: dict[Any, Any] | None = None,  # shared by decoders on the same models (``Models``)
    ):
        self.target = target
        self.drafter = drafter
        if drafter is not None:
            drafter.synchronize_timing = True
        self.config = config
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        vocab_size = target.model.config.vocab_size
        shared = {} if measurements is None else measurements
        self.method: Method = create_method(config, Models(target, drafter, vocab_size, shared))
        self.backend = backend or select_backend(config.kernels, target.device)
        self.generator = torch.Generator(device=target.device)
        self.generator.manual_seed(config.seed)
        self.reads = HostReads()  # every device value a step reads into Python goes through it

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def _uniforms(self, n: int) -> torch.Tensor:
        return torch.rand(1, n, generator=self.generator, device=self.target.device)

    def _verify(self, logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> Verdict:
        sampling = self.config.sampling
        if sampling.greedy:
            return self.backend.verify_greedy(logits, tokens, parents)
        uniforms = self._uniforms(tokens.shape[-1])
        return self.backend.verify_sampling(
            logits, tokens, parents, uniforms, sampling.temperature, sampling.top_k, sampling.top_p
        )

    def generate(
        self,
        prompt_ids: torch.Tensor,  # [prompt_length]
        on_step: Callable[[Generation], None] | None = None,
    ) -> Generation:
        device = self.target.device
        prompt_ids = prompt_ids.to(device)
        self.target.reset()
        started = time.perf_counter()
        prefill_logits = self.target.forward(prompt_ids)
        root_parent = torch.full((1, 1), -1, dtype=torch.long, device=device)
        first = self._verify(prefill_logits[-1:][None], prompt_ids[-1:][None], root_parent).bonus
        self.method.start(Prefill(prompt_ids, prefill_logits))
        committed = torch.cat([prompt_ids, first])
        self._sync()
        result = Generation(prompt_length=prompt_ids.numel(), output_ids=[int(first)])
        result.prefill_s = time.perf_counter() - started
        while not self._finished(result):
            stats, committed = self._step(committed, result)
            result.steps.append(stats)
            if on_step is not None:
                on_step(result)
        self._truncate(result)
        result.wall_s = time.perf_counter() - started
        return result

    def _step(self, committed: torch.Tensor, result: Generation) -> tuple[StepStats, torch.Tensor]:
        reads_before, audited_before = self.reads.count, audited_count()
        t0 = time.perf_counter()
        drafter_before = self.drafter.forward_s if self.drafter is not None else 0.0
        tree = self.method.draft(committed)
        drafter_forward_s = (self.drafter.forward_s if self.drafter is not None else 0.0) - drafter_before
        self._sync()
        t1 = time.perf_counter()
        ancestor_mask, _ = self.backend.tree_buffers(tree.parents[None])
        prefix = self.target.cache_length
        logits = self.target.forward_tree(tree.tokens, tree.depths, ancestor_mask[0])
        self._sync()
        t2 = time.perf_counter()
        verdict = self._verify(logits[None], tree.tokens[None], tree.parents[None])
        num_accepted = int(verdict.num_accepted[0])
        path = verdict.path[0, : num_accepted + 1]
        if tree.num_nodes > 1:
            self.backend.commit(self.target, prefix + path, prefix)
        new_tokens = torch.cat([tree.tokens[path[1:]], verdict.bonus])
        result.output_ids.extend(new_tokens.tolist())
        grown = torch.cat([committed, new_tokens])
        self.method.observe(Observation(tree, verdict, logits, grown))
        self._sync()
        t3 = time.perf_counter()
        audited_after = audited_count()
        stats = StepStats(
            accepted_length=num_accepted + 1,
            nodes_verified=tree.size,
            drafter_calls=self.method.drafter_calls(),
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            host_s=t3 - t2,
            drafter_forward_s=drafter_forward_s,
            syncs=self.reads.count - reads_before,
            audited_syncs=None if audited_before is None else audited_after - audited_before,
        )
        return stats, grown

    def _finished(self, result: Generation) -> bool:
        if len(result.output_ids) >= self.config.max_new_tokens:
            return True
        return any(t in self.eos_token_ids for t in result.output_ids[-self._last_step_span(result):])

    def _last_step_span(self, result: Generation) -> int:
        return result.steps[-1].accepted_length if result.steps else 1

    def _truncate(self, result: Generation) -> None:
        """Cut at the first EOS (kept) and at max new tokens, as transformers' generate does."""
        ids = result.output_ids[: self.config.max_new_tokens]
        for i, token in enumerate(ids):
            if token in self.eos_token_ids:
                ids = ids[: i + 1]
                break
        result.output_ids = ids
