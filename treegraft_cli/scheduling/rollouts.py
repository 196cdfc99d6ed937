"""`treegraft collect`: the offline value system that labels the TreeGraft scheduler's decisions.

Value system (ours; the papers do not publish theirs). Decoding runs the ``treegraft`` method with its
real policy π (``--policy``: a rule, or ``learned:FILE`` for on-policy iterations). At every ``every``-th
step the step's tree is first built with π, recording the real action a_b and the 17 features at each
layer b. Then for each layer ℓ = 1..D and each action x ∈ {call, skip}, the layer loop is run again with
forced actions {b: a_b for b < ℓ} ∪ {ℓ: x} and the *continuation* policy for the layers after ℓ
(default ``policy``: π itself, so a decision is judged by the rest of the step under the policy being
learned; a fixed policy such as ``all-small`` may be named instead). Each resulting tree is verified
against the target on a scratch extension of its KV cache (cropped back right after: the committed state
is never touched) and walked greedily, giving τ_x = accepted tokens + the bonus. The real step's own
outcome (its τ, nodes, calls, weak layers and the nodes each call forwarded) is kept with the step's rows.

    modelled time  T_x = verify_ms(tree nodes + root, context) + Σ_calls strong_ms(m_c, context)
                         + [calls_x > 0] · s · (strong_ms(m_1 + lag, context) − strong_ms(m_1, context))
                         + weak_layers_x · ngram_ms                      (all from the cost profile)

m_c is the number of tree nodes call c forwarded (``LayerRecord.forwarded``): none for a call from the root,
which forwards only the pending committed tokens, K for a later call on a tree without n-gram chains, up to 2·K
plus the nodes with children after a weak layer. A forward's time grows with its tokens, so pricing every call
at a typical 2·K would overprice strong steps, most of all short ones, whose only call forwards the lag alone,
and a scheduler would learn to call less than is worth it. Rollouts collected before those counts were stored
are priced at 2·K a call.

lag is what the strong drafter has not forwarded of the committed text when the step is decided (its first
call catches up on it); s = ``values.CATCH_UP_SHARE`` (1/``CATCH_UP_HORIZON``): the next call forwards those
tokens whenever it comes, so calling now moves that work rather than adding it, and the step pays a share, as the
step rule pays for a prompt's catch-up. Charged in full, a lag made every call after a few weak steps look dear,
and a scheduler learned to stop calling once it had skipped; charged nothing, a call after the prompt would look
as cheap as one right after another call. Moving the work holds where another call follows soon. The step rule
collecting on the Qwen pair took a weak step at 91 % of steps, with a median lag of 163 tokens: there a call's
catch-up is work a weak step postpones, often past the generation's end, and labels charging an eighth of it made
full steps the best kind at 47 % of steps (at 12 % charged in full). Where the collecting rule calls about once a
step (the same pair under a Zen 4's profile, a median lag of 3 tokens) the share hardly matters: 32 % against 31 %.
``distill --catch-up-share`` re-prices the labels with another share from the stored lags.
    running rate   R   = Σ τ_real / Σ T_real over the generation's probed steps, under π
    value          V_x = τ_x − R · T_x                                   (tokens)
    label          margin = V_call − V_skip = (τ_call − τ_skip) − R · (T_call − T_skip)

Why this value: decoding maximises accepted tokens per second over the whole generation, Σ τ / Σ T, not
the rate of one step. An action changes the ratio for the better iff it adds more tokens than its extra
time would have earned at the rate the policy achieves (Dinkelbach's parametric form of a ratio
objective; a policy that takes the larger V at every decision has no improving deviation at its own
rate R). A one-step ratio τ/T instead favours small cheap trees even where the policy's rate makes a
larger tree worth its time. ``distill`` and ``replay`` price T and R under any cost profile from the
stored counts, so the same rollouts label decisions for other hardware.

Per-step decisions (``--decide step``, for ``step_rule.LearnedStepRule``): at a probed step each step kind
of the step rule (weak: no strong call; short: a call at layer 1; full: calls at ``layers``, default
1..D−1) is built with every layer forced, verified and priced the same way; one row per step holds every
kind's outcome and value, with the layer-1 features.

The scheduler's cost features are the profile's costs after ``COST_CONTEXT`` tokens, what the method's
warm-up measures at run time; the labels' modelled times use the real context length.

Layers where a call is impossible (no grafting position) give no row. The features of the row are the
real build's features at ℓ, which equal the counterfactual builds' (same forced prefix, deterministic).
After probing, the strong drafter is rewound to the committed text it had forwarded before the step
(``TreeDrafter.rewind``): a probe's call catches it up on text the real policy may never have paid to forward,
and without the rewind the rows would show a lag of a few tokens where decoding on its own meets the whole
prompt's. Then the real tree is built once more, so the strong drafter's cache rows match the tree the
engine verifies and commits: decoding stays lossless and the trajectory is the real policy's.

The policy that drives decoding keeps time on a modelled clock (``ModelledClock``): each decoded step advances it
by the real step's time under the profile, and probes advance it by nothing. A policy that measures its rate and
its steps' times (the step rule, and a distilled scheduler inside it) would otherwise mix the profile's modelled
times (for what it has not yet measured) with this machine's wall time: collected under a profile of slower
hardware, the step rule never tried a step kind the profile priced too high for this machine's rate. On the
modelled clock it decides as it would on the profile's hardware, whatever machine collects, and a collection does
not depend on how busy the machine was.

Each question starts from a fresh policy (``Method.reset``), as ``bench`` decodes by default: what a rule measured
on the questions before (its τ of each step kind, R, the catch-up's price per token) would otherwise decide the
first steps of the next, and the rows would show states that decoding a question on its own never meets.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import DecodeConfig
from ..engine import SpeculativeDecoder
from ..errors import ConfigError
from ..lm import inference
from ..methods import Method, Observation, Prefill
from ..methods.treegraft import TreeGraftMethod
from ..pipeline import Pipeline, chat_messages
from ..tree import DraftTree
from .clock import ModelledClock, Outcome
from .cost_profile import CostProfile, profile_document, profile_from_document
from .costs import COST_CONTEXT
from .policies import FEATURE_NAMES, HISTORY_FEATURE_NAMES, CallPolicy, MeasuredValues
from .registry import make_policy
from .shards import (
    SETTINGS_FILE,
    claim_shard,
    differing_settings,
    other_settings_error,
    record_settings,
    shard_holder,
    shard_key,
    shard_state,
    write_shard,
)
from .step_rule import kind_layers
from .values import LAG_COLUMN, decision_values, running_rates

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class CollectSettings:
    """What labels depend on: they are stored in ``collect.json`` and must match on resume."""

    pair: str
    dtype: str
    config: DecodeConfig  # method treegraft (its policy in method_options), greedy
    continuation: str = "policy"  # POLICY_ITSELF or a policy spec
    every: int = 1  # probe every ``every``-th step
    fmt: str = "parquet"
    decide: str = "layer"  # label each layer's call/skip ("layer") or each step's kind ("step")

    def document(self, costs: CostProfile) -> dict[str, Any]:
        tree = self.config.tree
        return {
            "pair": self.pair,
            "dtype": self.dtype,
            "tree": {"budget": tree.budget, "depth": tree.depth, "top_k": tree.top_k},
            "max_new_tokens": self.config.max_new_tokens,
            "method_options": dict(self.config.method_options),
            "continuation": self.continuation,
            "every": self.every,
            "decide": self.decide,
            "feature_names": list(FEATURE_NAMES),
            "history_feature_names": list(HISTORY_FEATURE_NAMES),
            "cost_profile": profile_document(costs),
        }


POLICY_ITSELF = "policy"  # the continuation after a probed layer is the real policy
SHORT_LAYERS = (1,)  # a short step's layers in per-step rollouts (the step rule's default)


def rule_columns(measured: MeasuredValues | None) -> dict[str, float]:
    """What the driving policy weighed when it chose the step's kind (a step rule's ``MeasuredValues``) as rollout
    columns ``rule_tau_KIND``, ``rule_ms_KIND`` and ``rule_rate``, for a residual scheduler to correct; none for a
    policy that measures nothing."""
    if measured is None:
        return {}
    return {"rule_rate": measured.rate, **{f"rule_tau_{kind}": tau for kind, tau in measured.taus.items()},
            **{f"rule_ms_{kind}": ms for kind, ms in measured.times.items()}}


class ProbingMethod(Method):
    """Wraps a TreeGraftMethod: the engine decodes as usual, sampled steps are probed first (see module doc)."""

    name = "treegraft-probe"
    options_class = TreeGraftMethod.options_class  # it decodes with the wrapped method's settings

    def __init__(self, inner: TreeGraftMethod, target, backend, costs: CostProfile, continuation: CallPolicy | None,
                 every: int, decide: str = "layer"):
        super().__init__(inner.models, inner.config)
        self.inner, self.target, self.backend = inner, target, backend
        self.costs, self.every, self.decide = costs, every, decide
        self.fixed_continuation = continuation  # None: the real policy continues (``POLICY_ITSELF``)
        self.rows: list[dict[str, Any]] = []
        self.step = 0
        self.taus: dict[tuple, int] = {}  # this step's verified trees: probes often rebuild the same one
        self.step_rows: list[dict[str, Any]] = []  # this step's rows, completed with the real outcome by ``observe``
        self.real: Outcome | None = None  # the real tree's counts, τ still unknown (0)
        self.clock = ModelledClock()  # the driving policy's clock
        self.real_ms = 0.0  # the real step's time under the profile

    @property
    def continuation(self) -> CallPolicy:
        # read at every probe: the method may replace its policy object between requests (``reset``)
        return self.fixed_continuation or self.inner.policy

    def start(self, prefill: Prefill) -> None:
        tree = self.config.tree
        # the cost features as the method's own warm-up would measure them (after COST_CONTEXT tokens): one value
        # per profile, so within one collection they carry no prompt identity the MLP could latch onto
        self.inner.costs = self.costs.cost_model(tree.budget, tree.top_k, COST_CONTEXT)
        self.inner.measure_history = True  # rows keep the history features whatever the policy reads
        self.inner.probed = True  # probes force skipped layers: the n-gram scores are needed whatever the policy
        self.inner.start(prefill)
        self.inner.policy.time_by(self.clock)
        self.step = 0

    def draft(self, committed: torch.Tensor) -> DraftTree:  # committed: [L], root last
        history = list(self.inner.history.values())  # the recent steps, before this one
        lag = self.inner.loop.strong_lag(committed)  # before any build of this step moves the strong drafter
        strong = self.inner.loop.strong
        seen = strong.committed_length if strong is not None else 0
        tree, records = self.inner.build(committed, record=True)
        decided_on = rule_columns(self.inner.policy.decided_on()) if self.decide == "step" else {}
        self.step_rows, self.real = [], None
        if self.step % self.every == 0:
            self.taus = {}
            real = {r.layer: r.called for r in records}
            probes = [(records[0], self.probe_step(committed, lag))] if self.decide == "step" else [
                (record, self.probe(committed, real, record.layer, lag)) for record in records]
            for record, row in probes:
                if row is not None:
                    self.step_rows.append({**row, "step": self.step, "features": record.features.tolist(),
                                           "history": history, LAG_COLUMN: lag, "preview": list(record.preview),
                                           "real_call": record.called, **decided_on})
            if strong is not None:  # the probes' catch-up is not the real policy's: it pays its own, if it calls
                strong.rewind(seen)
            tree, _ = self.inner.build(committed)  # the real tree again: the strong cache must hold its rows
        real = Outcome.of_build(0, tree, records)
        self.real = real if self.step % self.every == 0 else None  # a probed step's rows take its outcome
        self.real_ms = real.ms(self.costs, self.config.tree.top_k, int(committed.numel()), lag)
        self.step += 1
        return tree

    def probe_step(self, committed: torch.Tensor, lag: int) -> dict[str, Any] | None:
        """Every step kind built with all its layers forced (the rest of the step is the kind), verified, priced.

        None when no kind could call the strong drafter (there is nothing to decide)."""
        depth = self.config.tree.depth
        outcomes = {}
        for name, called in kind_layers(self.inner.options.layers, SHORT_LAYERS, depth).items():
            forced = {layer: layer in called for layer in range(1, depth + 1)}
            tree, records = self.inner.build(committed, policy=self.continuation, forced=forced)
            outcomes[name] = Outcome.of_build(self.accepted(tree), tree, records)
        if all(o.calls == 0 for o in outcomes.values()):
            return None
        width, context = self.config.tree.top_k, int(committed.numel())
        row: dict[str, Any] = {"layer": 1, "context_length": context}
        for name, o in outcomes.items():
            row.update({**o.columns(f"kind_{name}"), f"ms_kind_{name}": o.ms(self.costs, width, context, lag)})
        return row

    def probe(self, committed: torch.Tensor, real: Mapping[int, bool], layer: int, lag: int) -> dict[str, Any] | None:
        forced = {b: real[b] for b in range(1, layer)}
        outcomes = {}
        for action in (True, False):
            tree, records = self.inner.build(committed, policy=self.continuation, forced={**forced, layer: action})
            if records[layer - 1].called != action:  # no grafting position: a call is impossible here
                return None
            outcomes[action] = Outcome.of_build(self.accepted(tree), tree, records)
        return self.label(outcomes[True], outcomes[False], layer, int(committed.numel()), lag)

    @inference
    def accepted(self, tree: DraftTree) -> int:
        """τ of ``tree`` against the target, on a scratch extension of its cache (cropped back after)."""
        key = (tuple(tree.tokens.tolist()), tuple(tree.parents.tolist()))
        if key not in self.taus:
            self.taus[key] = self.verify(tree)
        return self.taus[key]

    def verify(self, tree: DraftTree) -> int:
        tree = tree.to(self.target.device)
        prefix = self.target.cache_length
        ancestor_mask, _ = self.backend.tree_buffers(tree.parents[None])
        try:
            logits = self.target.forward_tree(tree.tokens, tree.depths, ancestor_mask[0])
        finally:
            self.target.crop(prefix)
        verdict = self.backend.verify_greedy(logits[None], tree.tokens[None], tree.parents[None])
        return int(verdict.num_accepted[0]) + 1

    def label(self, call: Outcome, skip: Outcome, layer: int, context: int, lag: int) -> dict[str, Any]:
        width = self.config.tree.top_k
        row: dict[str, Any] = {"layer": layer, "context_length": context}
        for name, o in (("call", call), ("skip", skip)):
            row.update({**o.columns(name), f"ms_{name}": o.ms(self.costs, width, context, lag)})
        return row

    def labelled_rows(self) -> list[dict[str, Any]]:
        """This generation's rows with R, each action's value and the margin under the collection's profile."""
        rows = self.rows
        if not rows:
            return []
        width = self.config.tree.top_k

        def column(name: str) -> torch.Tensor:
            return torch.tensor([row[name] for row in rows], dtype=torch.float32)

        ms_real = torch.tensor([self.costs.step_ms(r["nodes_real"] + 1, r["calls_real"], r["weak_real"], width,
                                                   r["context_length"], r[LAG_COLUMN], r["forwarded_real"])
                                for r in rows])
        rate = running_rates([0] * len(rows), [r["step"] for r in rows], column("tau_real"), ms_real)
        actions = [a[len("tau_"):] for a in rows[0] if a.startswith("tau_") and a != "tau_real"]
        values = {a: decision_values(column(f"tau_{a}"), column(f"ms_{a}"), rate) for a in actions}
        labelled = []
        for i, row in enumerate(rows):
            row = {**row, "ms_real": float(ms_real[i]), "rate": float(rate[i]),
                   **{f"value_{a}": float(v[i]) for a, v in values.items()}}
            if "call" in values:
                row["margin"] = row["value_call"] - row["value_skip"]
            labelled.append(row)
        return labelled

    def readback(self, tree, verdict, logits):
        return self.inner.readback(tree, verdict, logits)

    def observe(self, observation: Observation) -> None:
        """The real step's τ completes its rows (the running rate R is priced from them)."""
        if self.real is not None:
            real = dataclasses.replace(self.real, tau=observation.num_accepted + 1)
            self.rows.extend({**row, **real.columns("real")} for row in self.step_rows)
            self.step_rows, self.real = [], None
        self.clock.advance(self.real_ms)  # before the policy reads the step's time
        self.inner.observe(observation)

    def reset(self) -> None:
        self.inner.reset()

    def drafter_calls(self) -> dict[str, int]:
        return self.inner.drafter_calls()


@dataclass
class CollectReport:
    prompts: int = 0  # prompts in this worker's shard
    collected: int = 0
    skipped: int = 0  # sealed before this worker came to them (an earlier run, or another worker)
    redone: int = 0  # torn or corrupt shards collected again
    rows: int = 0  # rows written in this run
    waited: int = 0  # prompts another live worker was collecting: waited for, taken over only if left unsealed
    cost_profile: str = ""  # identity of the cost profile the labels use
    seconds: float = 0.0  # wall time of this run (collection time; what a rerun skips costs nothing)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (0-based i) → (i, n)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard {text!r} is not i/n", "e.g. --shard 0/4 (0-based worker index / workers)") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"--shard {text!r} is out of range", "need 0 <= i < n")
    return index, count


def probing_decoder(pipeline: Pipeline, settings: CollectSettings, costs: CostProfile) -> tuple[SpeculativeDecoder, ProbingMethod]:
    if pipeline.drafter is None:
        raise ConfigError("collect needs a model drafter (the strong drafter a call would run)", "pass --pair DRAFTER:TARGET")
    if not settings.config.sampling.greedy:
        raise ConfigError("collect labels greedy acceptance only", "drop --temperature (or pass 0)")
    config = dataclasses.replace(settings.config, method="treegraft")
    decoder = pipeline.decoder(config)
    itself = settings.continuation == POLICY_ITSELF
    continuation = None if itself else make_policy(settings.continuation, decoder.method.options)
    probe = ProbingMethod(decoder.method, decoder.target, decoder.backend, costs, continuation, settings.every,
                          settings.decide)
    decoder.method = probe
    return decoder, probe


def collect(
    pipeline: Pipeline,
    questions: Sequence,
    settings: CollectSettings,
    costs: CostProfile,
    out: Path,
    shard: tuple[int, int] = (0, 1),
    progress: Progress | None = None,
    costs_measured: bool = False,
) -> CollectReport:
    """Decode this worker's prompts, writing one sealed shard per prompt; finished prompts are skipped.

    ``costs_measured``: ``costs`` were measured by this run, not chosen; when another worker recorded the
    directory's settings first, its cost profile is taken instead, so all labels share one profile."""
    report_progress = progress or (lambda description, done, total: None)
    started = time.perf_counter()
    out = Path(out)
    costs = _shared_settings(out, settings, costs, costs_measured)
    mine = [q for i, q in enumerate(questions) if i % shard[1] == shard[0]]
    decoder, probe = probing_decoder(pipeline, settings, costs)
    report = CollectReport(prompts=len(mine), cost_profile=costs.identity)
    busy = []
    for done, question in enumerate(mine):
        key = shard_key(question.benchmark, question.question_id)
        status = shard_state(out, key).status  # before our own claim file exists
        if status == "done":
            report.skipped += 1
            continue
        report_progress(f"collect {key}", done, len(mine))
        with claim_shard(out, key) as held:
            if held:
                _collect_claimed(pipeline, decoder, probe, question, key, status, out, settings.fmt, report)
            else:
                busy.append((question, key, status))
    for question, key, status in busy:  # another worker had them: wait for it; a dead worker's key is taken over
        report.waited += 1
        report_progress(f"waiting for {key} ({shard_holder(out, key) or 'released'})", len(mine) - len(busy), len(mine))
        with claim_shard(out, key, wait=True):
            _collect_claimed(pipeline, decoder, probe, question, key, status, out, settings.fmt, report)
    report_progress("done", len(mine), len(mine))
    report.seconds = time.perf_counter() - started
    return report


def _shared_settings(out: Path, settings: CollectSettings, costs: CostProfile, costs_measured: bool) -> CostProfile:
    """Record this run's settings, or check them against the directory's; the cost profile labels must use."""
    document = settings.document(costs)
    recorded = record_settings(out, document)
    differing = differing_settings(recorded, document)
    if differing == ["cost_profile"] and costs_measured:
        return profile_from_document(recorded["cost_profile"], str(out / SETTINGS_FILE))
    if differing:
        raise other_settings_error(out, differing)
    return costs


def _collect_claimed(pipeline: Pipeline, decoder: SpeculativeDecoder, probe: ProbingMethod, question, key: str,
                     status: str, out: Path, fmt: str, report: CollectReport) -> None:
    """Collect one prompt whose lock this worker holds (``status``: its state before the claim), unless it was
    sealed meanwhile."""
    if shard_state(out, key).status == "done":  # sealed by another worker between our check and our claim
        report.skipped += 1
        return
    rows = collect_question(pipeline, decoder, probe, question, key)
    write_shard(out, key, rows, fmt)
    report.collected += 1
    report.redone += status in ("torn", "corrupt")
    report.rows += len(rows)


def collect_question(pipeline: Pipeline, decoder: SpeculativeDecoder, probe: ProbingMethod, question, key: str) -> list[dict]:
    """Every turn of one question as one conversation, from a fresh policy; rows carry the prompt's identity."""
    decoder.method.reset()
    answers: list[str] = []
    rows: list[dict[str, Any]] = []
    for turn in range(len(question.turns)):
        prompt = pipeline.encode_chat(chat_messages(question.turns[: turn + 1], answers))
        probe.rows = []
        generation = decoder.generate(prompt)
        answers.append(pipeline.decode(generation.output_ids))
        ident = {"key": key, "benchmark": question.benchmark, "question_id": str(question.question_id),
                 "turn": turn, "prompt_length": int(prompt.numel())}
        rows.extend({**ident, **row} for row in probe.labelled_rows())
    return rows
