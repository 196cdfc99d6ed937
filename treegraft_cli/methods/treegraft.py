"""TreeGraft methods: ``treegraft`` (the step rule decides), ``all-small``, ``all-mid``, ``fixed`` and ``ngram``.

The first four share one layer loop (``grafting.builder``) and differ only in the call policy; ``fixed``
takes its layers as ``fixed:1,3`` or ``--option layers=1,3``, and ``treegraft:POLICY`` runs ``treegraft``
with another policy (``treegraft:cost-aware``). ``ngram`` is the prompt-lookup chain
baseline on the same index. Settings: ``TreeGraftConfig`` from ``DecodeConfig.method_options``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ..config import DecodeConfig
from ..drafters import StrongDrafter, make_strong_drafter
from ..drafters.ngram import NgramIndex, TargetLogProbCache
from ..grafting.builder import LayerLoop, LayerRecord
from ..hostlists import longs
from ..lm import on_device_of
from ..scheduling.clock import ModelledClock, Outcome
from ..scheduling.cost_profile import check_profile_pair, load_cost_profile
from ..scheduling.costs import COST_CONTEXT, measure_costs
from ..scheduling.history import StepHistory
from ..scheduling.options import TreeGraftConfig
from ..scheduling.policies import CallPolicy, CostModel
from ..scheduling.registry import LEARNED, POLICY_FACTORIES, make_policy
from ..scheduling.step_rule import StepRule
from ..syncs import fetch, host_only
from ..tree import ORIGIN_NGRAM, DraftTree, RootTrees
from ..verify import StepVerdict
from .base import Method, Models, Observation, Prefill, register

PREFILL_CHUNK = 64  # prompt rows turned into log-probs at a time (a full-vocab float32 softmax per row)


def _target_logp(options: TreeGraftConfig) -> TargetLogProbCache:
    return TargetLogProbCache(options.top_w, options.fallback_penalty)


def _record_prefill(cache: TargetLogProbCache, prefill: Prefill) -> None:
    cache.reset()
    for start in range(0, prefill.logits.shape[0], PREFILL_CHUNK):
        cache.append(start, prefill.logits[start : start + PREFILL_CHUNK])


@register
class TreeGraftMethod(Method):
    """Weak n-gram + strong model drafter on one tree; the call policy decides per layer (``StepRule``)."""

    name = "treegraft"
    options_class = TreeGraftConfig
    needs_drafter = True
    description = "TreeGraft: n-gram + model drafter on one shared tree, strong calls where measured gains pay"
    carried_state = "the call policy's measured step times, rates and acceptance calibration"
    argument = "POLICY"
    argument_help = f"POLICY: the call policy, one of {', '.join(POLICY_FACTORIES)}, e.g. treegraft:cost-aware (default {StepRule.name})"
    default_policy = StepRule.name

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        self.index = NgramIndex(self.options.max_n)
        self.target_logp = _target_logp(self.options)
        self.strong = self._strong_drafter(models)
        self.loop = LayerLoop(config.tree, self.options, self.index, self.target_logp, self.strong)
        self.policy: CallPolicy = make_policy(self.policy_spec(self.options), self.options)
        self.policy.check_pair(models.pair)
        self.costs = CostModel(self.options.verify_ms, self.options.strong_ms)
        # ``clock``: the profile whose modelled step times the policy measures (None: the wall clock)
        self.clock_profile = load_cost_profile(self.options.clock) if self.options.clock else None
        if self.clock_profile is not None:
            check_profile_pair(self.clock_profile, models.pair, self.options.clock)
        self.clock = ModelledClock()
        self.step_ms = 0.0  # the step being decoded's modelled time
        self.prompt_length = 0
        # this request's recent steps: measured for a policy that reads the extended features, and for ``collect``
        self.measure_history = self.policy.feature_set != "paper"
        self.probed = False  # set by ``collect``: forced actions may draft weak layers under any policy
        self.history: StepHistory | None = None
        self.last_records: list[LayerRecord] = []
        self.weak_expansions = 0
        self.committed = torch.zeros(0, dtype=torch.long)  # [L] the step being decoded's committed tokens, root last
        self.looked_ahead = False  # this step's readback made the next step's layer-1 call (``LayerLoop.look_ahead``)

    @classmethod
    def options_from_argument(cls, argument: str) -> dict[str, Any]:
        """``treegraft:step`` / ``treegraft:cost-aware``: the method with another call policy."""
        return {"policy": argument}

    def _strong_drafter(self, models: Models) -> StrongDrafter | None:
        return make_strong_drafter(models.drafter, models.target) if models.drafter is not None else None

    @classmethod
    def policy_spec(cls, options: TreeGraftConfig) -> str:
        """The ``policy`` option; else the distilled scheduler when one is given to ``treegraft``; else the default."""
        if options.policy:
            return options.policy
        learned = options.scheduler and cls.default_policy == StepRule.name
        return LEARNED if learned else cls.default_policy

    @classmethod
    def check_options(cls, options: TreeGraftConfig) -> None:
        make_policy(cls.policy_spec(options), options)  # an unknown policy, fixed without layers, a bad scheduler file

    def reset(self) -> None:
        self.policy = make_policy(self.policy_spec(self.options), self.options)  # a fresh policy: no measured averages

    @property
    def needs_costs(self) -> bool:
        return self.policy.uses_costs and (self.costs.verify_ms <= 0 or self.costs.strong_ms <= 0)

    def start(self, prefill: Prefill) -> None:
        self.built_tree = DraftTree.from_root(0, host=True)
        self.prompt_length = int(prefill.prompt_ids.numel())
        self.history = StepHistory() if self.measure_history else None
        self.index.reset()
        self.index.extend(prefill.context())
        if self.keeps_target_logp:
            _record_prefill(self.target_logp, prefill)
        else:
            self.target_logp.reset()
        if self.strong is not None:
            self.strong.reset()
        if self.looks_ahead and prefill.first_token is not None:
            first = on_device_of(longs([prefill.first_token]), prefill.prompt_ids.device)
            self.loop.look_ahead_from_prompt(prefill.prompt_ids, first)
        else:
            self.loop.forget_ahead()
        if self.clock_profile is not None:  # the costs the modelled clock charges, as the profile's hardware measures them
            tree = self.config.tree
            self.costs = self.clock_profile.cost_model(tree.budget, tree.top_k, COST_CONTEXT)
            self.clock = ModelledClock()
            self.policy.time_by(self.clock)
        elif self.needs_costs:
            self.costs = self.measured_costs(prefill.prompt_ids)

    @property
    def looks_ahead(self) -> bool:
        """Whether each step makes the next step's layer-1 call before its verdict is read (``LayerLoop.looks_ahead``);
        not for ``collect``, whose probes draft a step several ways."""
        return not self.probed and self.loop.looks_ahead(self.policy)

    @property
    def keeps_target_logp(self) -> bool:
        """Whether this request keeps the target log-probs that score n-gram chains: not when no step can draft weak
        layers (``all-mid``: a prompt's rows over a 152k vocabulary and each step's readback cost more than the
        step's host work)."""
        return self.probed or self.policy.drafts_weak(self.config.tree.depth)

    def measured_costs(self, prompt_ids: torch.Tensor) -> CostModel:  # prompt_ids: [prompt_length]
        """The given costs, the rest timed once per set of models and tree shape (``Models.measurements``)."""
        tree = self.config.tree
        key = ("treegraft-costs", tree.budget, tree.top_k)
        measured = self.models.measurements.get(key)
        if measured is None:
            drafter = self.models.drafter.model if self.models.drafter is not None else None
            context = prompt_ids[-COST_CONTEXT:]
            measured = measure_costs(self.models.target.model, drafter, context, tree.budget, tree.top_k)
            self.models.measurements[key] = measured
        if self.costs.verify_ms:  # a given full-tree time: the measured curve would not end at it
            return CostModel(self.costs.verify_ms, self.costs.strong_ms or measured.strong_ms,
                             strong_token_ms=measured.strong_token_ms)
        return replace(measured, strong_ms=self.costs.strong_ms or measured.strong_ms)

    def draft(self, committed: torch.Tensor) -> DraftTree:
        """The tree is built on the host (or left on the strong drafter's device when nothing reads it there:
        ``device_tree``); verification gets it moved to the target's device."""
        lag = self.loop.strong_lag(committed)  # before the build moves the strong drafter
        self.committed = committed
        tree, records = self.build(committed, device_tree=self.device_tree)
        if self.clock_profile is not None:
            outcome = Outcome.of_build(0, tree, records)
            self.step_ms = outcome.ms(self.clock_profile, self.config.tree.top_k, int(committed.numel()), lag)
        return tree.to(self.models.target.device)

    @property
    def device_tree(self) -> bool:
        """Whether this request reads nothing of a verified tree on the host but the drafter rows of its accepted nodes
        (``readback``): no probe, no history. Whether the policy reads it is the layer loop's check."""
        return not self.probed and self.history is None

    def build(
        self,
        committed: torch.Tensor,  # [L] root last
        policy: CallPolicy | None = None,
        forced: Mapping[int, bool] | None = None,
        record: bool = False,
        device_tree: bool = False,
    ) -> tuple[DraftTree, list[LayerRecord]]:
        """Draft with ``policy`` (default: the method's), ``forced`` actions by layer, features if ``record``;
        ``device_tree``: see ``LayerLoop.build``.

        Safe to call several times for one step (``collect`` tries call and skip at a layer): the strong
        drafter's cache is cropped back to the committed context each time.
        """
        tree, records, self.weak_expansions = self.loop.build(
            committed, policy or self.policy, self.costs, self.prompt_length, forced, record,
            self.history.values() if self.history is not None else (), device_tree,
        )
        self.built_tree = tree  # the last tree built is the one verified: observe learns from it
        self.last_records = records
        return tree, records

    def readback(self, tree: DraftTree, verdict: StepVerdict, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Read with the verdict: a device tree's drafter cache rows (``kv_slot``), for the strong drafter's commit;
        the target's top-W log-probs at the root and the accepted nodes (rows along the path, at most its depth + 1),
        for the n-gram scores, unless no step drafts weak layers; the next step's root lookup when it looks ahead."""
        extras = () if self.built_tree.host else (tree.kv_slot,)
        self.looked_ahead = self.looks_ahead and self.built_tree.host
        if not (self.keeps_target_logp or self.looked_ahead):
            return extras
        path = verdict.path_rows(max(self.built_tree.listed("depths")))
        if self.keeps_target_logp:
            extras += self.target_rows(path, logits)
        if self.looked_ahead:
            extras += self.loop.look_ahead(self.committed, verdict, path)
        return extras

    def target_rows(
        self,
        root_path: torch.Tensor,  # [m] the root and accepted node indices, root first (the root may pad the end)
        logits: torch.Tensor,  # [num_nodes, vocab]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [m, W]
        """The target's top-W log-probs and tokens at ``root_path`` (host trees only: the n-gram drafter's)."""
        return self.target_logp.top(logits[root_path])

    def observe(self, observation: Observation) -> None:
        a = observation.num_accepted
        tree, host = self.built_tree, observation.host
        if self.looked_ahead:
            *host, top_logp, top_tokens = host
            self.loop.settle_ahead(observation.committed.shape[0], a, top_logp, top_tokens)
            self.looked_ahead = False
        elif self.strong is not None:
            forwarded = None  # counted from the tree: a host tree's rows, or one read of a device tree's
            if not tree.host and host:
                with host_only():
                    slots, host = host[0].tolist(), host[1:]
                forwarded = next((j for j, node in enumerate(observation.accepted_nodes) if slots[node] < 0), a)
            self.strong.commit(tree, observation.path, forwarded)
        with host_only():
            self.index.extend(observation.new_tokens)
            # the root and the accepted nodes were verified on the committed prefix: their target rows are exact
            if self.keeps_target_logp:
                if not host:  # a caller that did not ask for the readback (a wrapper): read the rows now
                    logits = observation.logits
                    host = fetch(*self.target_rows(on_device_of(observation.root_path, logits.device), logits))
                # the rows of the root and the accepted nodes (a path padded with the root's row after them)
                root_position = observation.committed.shape[0] - a - 2
                self.target_logp.append_top(root_position, *host, count=a + 1)
            # the target's token after each verified node: the next accepted node's, then the bonus
            verified = observation.root_path
            self.clock.advance(self.step_ms)  # before the policy reads the step's time (modelled time only)
            self.policy.observe(tree, verified, longs(observation.new_tokens))
            if self.history is not None:
                calls = sum(record.called for record in self.last_records)
                self.history.observe(tree, verified, calls, self.costs, self.config.tree.budget)

    def drafter_calls(self) -> dict[str, int]:
        if self.strong is None:
            return {"model": 0, "ngram": self.weak_expansions}
        return {self.strong.name: self.strong.calls, "ngram": self.weak_expansions}


@register
class AllSmallMethod(TreeGraftMethod):
    name = "all-small"
    needs_drafter = False
    description = "TreeGraft layer loop with the weak n-gram drafter only"
    argument = ""
    default_policy = "all-small"
    carried_state = ""  # its policy decides from the tree alone
    options_from_argument = Method.options_from_argument


@register
class AllMidMethod(TreeGraftMethod):
    name = "all-mid"
    description = "TreeGraft layer loop calling the strong drafter at every layer"
    argument = ""
    default_policy = "all-mid"
    carried_state = ""  # its policy decides from the tree alone
    options_from_argument = Method.options_from_argument


@register
class FixedMethod(TreeGraftMethod):
    name = "fixed"
    description = "TreeGraft layer loop calling the strong drafter at the layers given"
    argument = "L[,L...]"
    argument_help = "L: a 1-based tree layer, e.g. fixed:1,3 (or -o layers=1,3); required"
    needs_argument = True  # or -o layers=...; without layers it would be all-small
    default_policy = "fixed"
    carried_state = ""  # its policy decides from the tree alone

    @classmethod
    def options_from_argument(cls, argument: str) -> dict[str, Any]:
        return {"layers": argument}


@register
class NgramMethod(Method):
    """Prompt lookup: the longest-suffix match's continuation as one chain."""

    name = "ngram"
    options_class = TreeGraftConfig
    description = "prompt-lookup chain from the n-gram index (no model drafter)"

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        self.index = NgramIndex(self.options.max_n)
        self.roots = RootTrees()

    def start(self, prefill: Prefill) -> None:
        self.index.reset()
        self.index.extend(prefill.context())

    def draft(self, committed: torch.Tensor) -> DraftTree:
        self.index.sync(committed)
        length = min(self.options.chain_length, self.config.tree.budget)
        found = self.index.continuations(self.index.context[-self.options.max_n :], self.options.max_n, 1, length)
        chain = list(found[0].tokens) if found else []
        tree = self.roots.tree(committed[-1:], self.models.target.device, capacity=len(chain) + 1)
        if chain:  # one chain: node i's parent is node i - 1, all new
            m = len(chain)
            tree._write(1, torch.arange(m, device=tree.device), on_device_of(longs(chain), tree.device),
                        torch.zeros(m, device=tree.device), ORIGIN_NGRAM, generations=m)
        return tree

    def observe(self, observation: Observation) -> None:
        self.index.extend(observation.new_tokens)
