"""What bench runs side by side: every registered method, and transformers' own accelerators as peers.

A contender has ``generate(prompt_ids) -> Generation``, so bench times and records them all the same
way, and ``reset()``, which forgets what earlier questions taught it (``carried_state`` says what that
is: a method's ``Method.carried_state``; for ``hf-assisted`` the assistant's candidate count when its
generation config uses transformers' heuristic schedule). Peers (``hf-assisted``, ``hf-lookup``) run ``model.generate``; their per-step statistics are
recovered from forward hooks on the target and the drafter:

* one step = one target forward after the first (the first forward is the prefill, which for
  ``hf-assisted`` also verifies the first candidates; its tokens are not counted as a step);
* accepted length of a step = committed tokens, from the position id of the next forward's first token;
* verify time = time inside target forwards, draft time = time inside drafter forwards
  (``hf-lookup`` drafts on the host), host time = the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from ..config import DecodeConfig
from ..engine import Generation, StepStats
from ..errors import ConfigError
from ..methods import METHODS, method_names
from ..methods.base import check_method
from ..models.load import check_same_family
from ..models.registry import parse_pair, resolve
from ..pipeline import Pipeline


@dataclass(frozen=True)
class Peer:
    """A transformers generation mode timed like a method."""

    description: str
    needs_drafter: bool
    generate_kwargs: Callable[[Pipeline], dict[str, Any]]

    def usable(self, pipeline: Pipeline) -> bool:
        """transformers can only assist with a drafter that is a generating model (not an EAGLE-3 head)."""
        if not self.needs_drafter:
            return True
        return pipeline.drafter is not None and isinstance(pipeline.drafter.model, PreTrainedModel)


PEERS: Mapping[str, Peer] = {
    "hf-assisted": Peer(
        "transformers assisted generation with the pair's drafter",
        True,
        lambda pipeline: {"assistant_model": pipeline.drafter.model},
    ),
    "hf-lookup": Peer("transformers prompt-lookup decoding (10 tokens)", False, lambda pipeline: {"prompt_lookup_num_tokens": 10}),
}


def contender_names() -> list[str]:
    """Every name ``--methods`` accepts: the registered methods, then the peers."""
    return method_names() + sorted(PEERS)


def check_names(names: list[str]) -> None:
    unknown = [n for n in names if n.partition(":")[0] not in METHODS and n not in PEERS]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}", f"choose from: {', '.join(contender_names())}")


@dataclass(frozen=True)
class PairShape:
    """What a pair offers the contenders, known from its name before any model loads."""

    has_drafter: bool
    lm_drafter: bool  # the drafter is a causal LM (transformers' assisted generation can use it)

    @classmethod
    def of(cls, pair: str) -> PairShape:
        """Names resolved and tokenizer families compared on the way, reading no model file: a typo or a
        mismatched pair fails before anything loads."""
        drafter, target = parse_pair(pair)
        target_ref = resolve(target)
        if not drafter:
            return cls(False, False)
        drafter_ref = resolve(drafter)
        check_same_family(drafter_ref, target_ref)
        return cls(True, not drafter_ref.eagle3)


def check_config(config: DecodeConfig, shape: PairShape) -> None:
    """Everything about one contender that can fail without a model: name, argument, options, drafter."""
    if config.method in PEERS:
        if PEERS[config.method].needs_drafter and not shape.lm_drafter:
            raise ConfigError(f"peer {config.method!r} needs a drafter that is a causal LM",
                              "pass --pair DRAFTER:TARGET with a small LM drafter")
        if not config.sampling.greedy:
            raise ConfigError(f"peer {config.method!r} is benchmarked greedy only", "use --temperature 0, or drop it from --methods")
        if config.method_options:
            raise ConfigError(f"peer {config.method!r} takes no options", f"remove the options given for {config.method}")
        return
    check_method(config, shape.has_drafter)


class MethodContender:
    """A registered method run by the speculative decoder."""

    kind = "method"

    def __init__(self, pipeline: Pipeline, config: DecodeConfig):
        self.name = config.method
        self.config = config
        self.decoder = pipeline.decoder(config)  # builds the method now: bad options fail before any timing
        self.carried_state = self.decoder.method.carried_state

    def reset(self) -> None:
        self.decoder.method.reset()

    def generate(self, prompt_ids: torch.Tensor) -> Generation:  # prompt_ids: [prompt_length]
        return self.decoder.generate(prompt_ids)


@dataclass
class _ForwardLog:
    """Forward calls seen by the hooks during one ``generate``."""

    target_starts: list[int] = field(default_factory=list)  # position of each target forward's first token
    target_sizes: list[int] = field(default_factory=list)  # tokens in each target forward
    target_s: list[float] = field(default_factory=list)
    drafter_s: float = 0.0
    drafter_calls: list[int] = field(default_factory=list)  # drafter forwards before each target forward
    pending_drafter_calls: int = 0


class PeerContender:
    """``target.generate`` with a transformers accelerator, observed through forward hooks."""

    kind = "peer"

    def __init__(self, pipeline: Pipeline, name: str, config: DecodeConfig):
        peer = PEERS[name]
        if not peer.usable(pipeline):
            raise ConfigError(f"peer {name!r} needs a drafter that is a causal LM", "pass --pair DRAFTER:TARGET with a small LM drafter")
        if not config.sampling.greedy:
            raise ConfigError(f"peer {name!r} is benchmarked greedy only", "use --temperature 0, or drop it from --methods")
        self.name = name
        self.config = config
        self.pipeline = pipeline
        self.kwargs = peer.generate_kwargs(pipeline)
        self.target = pipeline.target.model
        self.drafter = pipeline.drafter.model if peer.needs_drafter else None
        self._log = _ForwardLog()
        self._started = 0.0
        # transformers' "heuristic" schedule carries the assistant's candidate count from one generate to the next
        config_of = self.drafter.generation_config if self.drafter is not None else None
        heuristic = config_of is not None and config_of.num_assistant_tokens_schedule == "heuristic"
        self.carried_state = "the assistant's candidate count (heuristic schedule)" if heuristic else ""
        self._initial_candidates = config_of.num_assistant_tokens if heuristic else None

    def reset(self) -> None:
        if self._initial_candidates is not None:
            self.drafter.generation_config.num_assistant_tokens = self._initial_candidates

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def _pre(self, module, args, kwargs) -> None:
        if module is not self.target and module is not self.drafter:
            return  # a layer-truncated self-drafter shares the target's hook table
        self._sync()
        self._started = time.perf_counter()
        if module is self.target:
            positions = kwargs.get("position_ids")
            self._log.target_starts.append(int(positions[0, 0]) if positions is not None else -1)
            input_ids = kwargs.get("input_ids")
            self._log.target_sizes.append(int(input_ids.shape[-1]) if input_ids is not None else 1)
            self._log.drafter_calls.append(self._log.pending_drafter_calls)
            self._log.pending_drafter_calls = 0
        else:
            self._log.pending_drafter_calls += 1

    def _post(self, module, args, kwargs, output) -> None:
        if module is not self.target and module is not self.drafter:
            return
        self._sync()
        elapsed = time.perf_counter() - self._started
        if module is self.target:
            self._log.target_s.append(elapsed)
        else:
            self._log.drafter_s += elapsed

    def generate(self, prompt_ids: torch.Tensor) -> Generation:  # prompt_ids: [prompt_length]
        self._log = _ForwardLog()
        modules = [self.target] + ([self.drafter] if self.drafter is not None else [])
        handles = []
        tables: set[int] = set()
        for module in modules:
            if id(module._forward_pre_hooks) in tables:
                continue  # a layer-truncated self-drafter shares the target's hook tables: hook once
            tables.add(id(module._forward_pre_hooks))
            handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        ids = prompt_ids.to(self.target.device)[None]  # [1, prompt_length]
        try:
            started = time.perf_counter()
            out = self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.config.max_new_tokens,
                do_sample=False,
                eos_token_id=self.pipeline.target.eos_token_ids or None,
                pad_token_id=self.pipeline.tokenizer.pad_token_id or (self.pipeline.target.eos_token_ids or [0])[0],
                **self.kwargs,
            )
            self._sync()
            wall = time.perf_counter() - started
        finally:
            for handle in handles:
                handle.remove()
        output_ids = out[0, ids.shape[1]:].tolist()
        result = Generation(prompt_length=ids.shape[1], output_ids=output_ids, wall_s=wall)
        self._fill_steps(result)
        return result

    def _fill_steps(self, result: Generation) -> None:
        log = self._log
        if not log.target_s:
            return
        total = result.prompt_length + result.new_tokens
        # committed length after target forward i: next forward starts at its last committed token
        committed = [s + 1 for s in log.target_starts[1:]] + [total]
        known = all(s >= 0 for s in log.target_starts)
        drafter_each = log.drafter_s / max(1, sum(log.drafter_calls))
        result.prefill_s = log.target_s[0] + drafter_each * log.drafter_calls[0]
        steps = len(log.target_s) - 1
        busy = result.prefill_s + sum(log.target_s[1:]) + drafter_each * sum(log.drafter_calls[1:])
        host_each = max(0.0, result.wall_s - busy) / max(1, steps)
        for i in range(1, len(log.target_s)):
            calls = log.drafter_calls[i]
            result.steps.append(
                StepStats(
                    accepted_length=committed[i] - committed[i - 1] if known else 0,
                    nodes_verified=log.target_sizes[i] - 1,
                    drafter_calls={"model": calls} if self.drafter is not None else {},
                    draft_s=drafter_each * calls,
                    verify_s=log.target_s[i],
                    host_s=host_each,
                    drafter_forward_s=drafter_each * calls,  # peers: all draft time is drafter forwards
                )
            )


def build_contender(pipeline: Pipeline, config: DecodeConfig) -> MethodContender | PeerContender:
    """The contender for ``config.method``: a peer name, or a registered method."""
    if config.method in PEERS:
        return PeerContender(pipeline, config.method, config)
    return MethodContender(pipeline, config)
