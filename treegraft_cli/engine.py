"""The decoding loop: prefill → (draft → verify → commit → observe) until max new tokens or EOS."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .backends import VerifyBackend, select_backend
from .capture import CAPTURED_ROWS, bucket, check_mode
from .config import DecodeConfig
from .errors import ConfigError
from .hostlists import longs
from .lm import CausalLM, inference, on_device_of
from .methods import Method, Models, Observation, Prefill, create_method
from .syncs import HostReads, audited_count, counting, fetch, host_value
from .tree import DraftTree
from .verify import StepVerdict, Verdict


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
    # every verified node but the root, in tree order: which drafter proposed it (``tree.ORIGIN_*``), its depth
    node_origins: tuple[int, ...] = ()
    node_depths: tuple[int, ...] = ()
    accepted_nodes: tuple[int, ...] = ()  # the accepted ones, as indices into node_origins / node_depths

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


class StepClock:
    """Marks between a step's phases: wall time on CPU, CUDA events on CUDA (read after the step's end sync,
    so timing a step costs no synchronisation of its own)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: list[float] = []
        self.events: list[Any] = []
        self.mark()

    def mark(self) -> None:
        self.times.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def spans(self) -> list[float]:
        """Seconds between consecutive marks; on CUDA only once the device has passed the last mark."""
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:], strict=False)]
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


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
        pair: str = "",  # DRAFTER:TARGET, for methods that check what they load against it
    ):
        self.target = target
        self.drafter = drafter
        if drafter is not None:
            drafter.synchronize_timing = True
        self.config = config
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        vocab_size = target.model.config.vocab_size
        shared = {} if measurements is None else measurements
        self.method: Method = create_method(config, Models(target, drafter, vocab_size, shared, pair))
        check_mode(config.compile, target.device, [lm.model for lm in (target, drafter) if lm is not None])
        if config.compile != "off" and target.capture_indices:
            raise ConfigError(f"--compile {config.compile} cannot capture the hidden states an EAGLE-3 head reads",
                              "use --compile off with an EAGLE-3 drafter")
        self.backend = backend or select_backend(config.kernels, target.device)
        verify = self.backend.verify_greedy if config.sampling.greedy else self.backend.verify_sampling
        self._takes_buffers = "buffers" in inspect.signature(verify).parameters
        self.generator = torch.Generator(device=target.device)
        self.generator.manual_seed(config.seed)
        self.reads = HostReads()  # every device value a step reads into Python goes through it
        self._root_path = torch.zeros(1, 1, dtype=torch.long, device=target.device)  # a root-only tree's verdict

    def _sync(self) -> None:
        """On CUDA, wait for the device so step times are device times (the one explicit wait of a step)."""
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        if self.drafter is not None:
            self.drafter.settle_timing()

    def _uniforms(self, n: int, device: torch.device) -> torch.Tensor:
        # drawn where the generator lives (the same stream of uniforms on any layout), used where the logits are
        return torch.rand(1, n, generator=self.generator, device=self.target.device).to(device)

    def _verify(
        self,
        logits: torch.Tensor,  # [1, nodes, vocab]
        tree: DraftTree,  # on the logits' device
    ) -> Verdict:
        sampling = self.config.sampling
        if sampling.greedy and tree.num_nodes == 1:  # the root alone: its choice is the bonus
            root = self._root_path.to(logits.device)
            return Verdict(root, root[0], self.backend.greedy_choices(logits)[0])
        tokens, parents = tree.tokens[None], tree.parents[None]
        # the tree's own ancestor mask spares the torch reference rebuilding it (backends written against the
        # plain four-call interface do not take it)
        extra = {"buffers": (tree.ancestor_mask()[None], tree.depths[None])} if self._takes_buffers else {}
        if sampling.greedy:
            return self.backend.verify_greedy(logits, tokens, parents, **extra)
        uniforms = self._uniforms(tokens.shape[-1], logits.device)
        return self.backend.verify_sampling(
            logits, tokens, parents, uniforms, sampling.temperature, sampling.top_k, sampling.top_p, **extra
        )

    def _step_verdict(self, logits: torch.Tensor, tree: DraftTree, drafted: DraftTree) -> StepVerdict:
        """Greedy: the target's choices, walked on the host after the read; sampling: the backend's device verdict.
        ``logits``: ``[nodes, vocab]``; ``drafted``: the tree as the method drafted it (``tree`` is its copy on the
        logits' device), whose columns the host holds when a host-side builder drafted it."""
        host_tree = drafted if drafted.host else None
        if self.config.sampling.greedy:
            return StepVerdict(tree, choices=self.backend.greedy_choices(logits[None])[0], host_tree=host_tree)
        return StepVerdict(tree, device_verdict=self._verify(logits[None], tree), host_tree=host_tree)

    @inference  # once per request: the forwards and tensor ops inside pay no mode switch each
    def generate(
        self,
        prompt_ids: torch.Tensor,  # [prompt_length]
        on_step: Callable[[Generation], None] | None = None,
    ) -> Generation:
        device = self.target.device
        prompt_ids = prompt_ids.to(device)
        capacity = self._static_capacity(prompt_ids.numel())
        self.target.use_static(self.config.compile, capacity)
        if self.drafter is not None:  # the method's ``start`` resets it
            self.drafter.use_static(self.config.compile, capacity + self._drafter_headroom())
        self.target.reset()
        started = time.perf_counter()
        prefill_logits = self.target.forward(prompt_ids)
        root = DraftTree.from_root(prompt_ids[-1:], prefill_logits.device)
        first = self._verify(prefill_logits[-1:][None], root).bonus
        first_token = first.tolist()
        self.method.start(Prefill(prompt_ids, prefill_logits, first_token[0]))
        committed = torch.cat([prompt_ids, first.to(device)])
        self._sync()
        result = Generation(prompt_length=prompt_ids.numel(), output_ids=first_token)
        result.prefill_s = time.perf_counter() - started
        while not self._finished(result):
            with counting(self.reads):
                stats, committed = self._step(committed, result)
            result.steps.append(stats)
            if on_step is not None:
                on_step(result)
        self._truncate(result)
        result.wall_s = time.perf_counter() - started
        return result

    def _step(self, committed: torch.Tensor, result: Generation) -> tuple[StepStats, torch.Tensor]:
        """One draft → verify → commit → observe round. Reads the device once: the verdict, packed with
        what the method asked to see (``Method.readback``)."""
        reads_before, audited_before = self.reads.count, audited_count()
        clock = StepClock(self.target.device)
        drafter_before = self.drafter.forward_s if self.drafter is not None else 0.0
        drafted = self.method.draft(committed)
        tree = drafted.to(self.target.device)
        clock.mark()
        prefix = self.target.cache_length
        logits = self.target.forward_tree(tree.tokens, tree.depths, tree.ancestor_mask())
        clock.mark()
        # a target spread over devices returns logits from its last: verify there (moving the tree, not the logits)
        tree = tree.to(logits.device)
        verdict = self._step_verdict(logits, tree, drafted)
        extras = self.method.readback(tree, verdict, logits)
        packed, *host = fetch(verdict.packed(), *extras)
        accepted, new_tokens, node_depths, node_origins = verdict.unpack(host_value(packed))
        num_accepted = len(accepted) - 1
        self._commit(prefix, accepted)
        result.output_ids.extend(new_tokens)
        grown = torch.cat([committed, on_device_of(longs(new_tokens), committed.device)])
        observation = Observation(tree, logits, grown, num_accepted, new_tokens, accepted[1:], tuple(host))
        self.method.observe(observation)
        clock.mark()
        self._sync()
        draft_s, verify_s, host_s = clock.spans()
        audited_after = audited_count()
        drafter_forward_s = (self.drafter.forward_s if self.drafter is not None else 0.0) - drafter_before
        stats = StepStats(
            accepted_length=num_accepted + 1,
            nodes_verified=tree.size,
            drafter_calls=self.method.drafter_calls(),
            draft_s=draft_s,
            verify_s=verify_s,
            host_s=host_s,
            drafter_forward_s=drafter_forward_s,
            syncs=self.reads.count - reads_before,
            audited_syncs=None if audited_before is None else audited_after - audited_before,
            node_origins=tuple(node_origins),
            node_depths=tuple(node_depths),
            accepted_nodes=tuple(i - 1 for i in accepted[1:]),
        )
        return stats, grown

    def _static_capacity(self, prompt_length: int) -> int:
        """Cache rows a request may use: prompt, new tokens, the last step's overshoot (at most a tree's worth)
        and one padded tree, rounded up so that requests of similar length share one static cache (and its
        captured graphs)."""
        tree = bucket(self.config.tree.budget + 1)
        needed = prompt_length + self.config.max_new_tokens + self.config.tree.budget + 1 + tree
        return -(-needed // 512) * 512

    def _drafter_headroom(self) -> int:
        """Cache rows a model drafter may use beyond the target's: a step's forwards (up to ``depth`` layers of
        ``top_k`` padded trees' worth) and the padding of its catch-up forward."""
        tree = self.config.tree
        return CAPTURED_ROWS + tree.depth * tree.top_k * bucket(tree.budget + 1)

    def _commit(self, prefix: int, accepted: list[int]) -> None:
        """Keep the target's cache rows of the root and the ``accepted`` nodes (node indices, root first): rows
        already in place are only cropped."""
        if accepted == list(range(len(accepted))):
            self.target.crop(prefix + len(accepted))
        else:
            keep = on_device_of(longs([prefix + node for node in accepted]), self.target.device)
            self.backend.commit(self.target, keep, prefix)

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
