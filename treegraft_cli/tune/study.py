"""The Optuna study behind ``treegraft tune``: seeded TPE over a search space, objective = speedup over ``ar``.

* ``ar`` is timed once per process on the tuning questions (after a warm-up), so every trial is
  compared with the same baseline measured on this machine.
* Each trial reports its running speedup after every question; a median pruner stops bad trials
  early (single-objective only: Optuna cannot prune multi-objective trials).
* ``memory=True`` adds a second objective, peak memory in MiB (minimised), and the study keeps a
  Pareto front. On CPU the memory figure is the process's peak RSS, which never goes down; use it on GPU.
* Storage is any SQLAlchemy URL: ``sqlite:///file.db`` (default) or a server database
  (``postgresql://USER@HOST/DB``) shared by workers on many machines. Studies resume: re-running adds
  trials. The worker that creates the study enqueues the space's defaults, once; a worker joining a
  study made with another method, pair or search space is refused before any model loads.
* Workers beat a heartbeat while they run a trial. A worker that dies mid-trial (killed, preempted)
  stops beating; after two missed intervals the next worker to start a trial marks it FAIL and
  re-enqueues its parameters (at most ``RETRIES`` times), so no trial stays RUNNING for ever.
* Each worker seeds TPE from ``--seed``, its identity and the study's size, so concurrent and resumed
  workers do not repeat each other's random draws.
* A configuration the method rejects (ConfigError) is pruned with the reason as a user attribute.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna

from ..atomic import atomic_write_text
from ..bench.contenders import build_contender
from ..bench.runner import peak_memory_bytes, reset_peak_memory, run_conversation_turns
from ..bench.suites import Question
from ..config import DecodeConfig
from ..errors import ConfigError
from ..pipeline import Pipeline
from ..profiles import Profile, dump_profile
from .space import SearchSpace, apply
from .storage import hide_password, open_storage, worker_id

# (trial number, value or None when pruned/failed, done, total)
TrialProgress = Callable[[int, float | None, int, int], None]



@dataclass(frozen=True)
class TuneSettings:
    pair: str
    dtype: str
    device: str
    base: DecodeConfig  # method_options of the tuned method included
    trials: int
    storage: str
    study_name: str
    seed: int = 0
    memory: bool = False  # second objective: peak memory (MiB), minimised
    heartbeat_s: int = 60  # a running trial's heartbeat; missing for 2 intervals, the trial is failed and retried
    linear: str = "default"  # the linear kernels the trials ran with (``Pipeline.load``), kept in the exported profile


@dataclass(frozen=True)
class Timing:
    tokens: int
    seconds: float


def signature(space: SearchSpace, settings: TuneSettings) -> dict:
    """What trials of one study must share to be comparable: method, pair, searched and fixed values (JSON)."""
    params = {p.key: {"kind": p.kind, "low": p.low, "high": p.high, "step": p.step, "log": p.log,
                      "choices": dict(p.choices) if isinstance(p.choices, dict) else list(p.choices)}
              for p in space.params}
    document = {"method": space.method, "pair": settings.pair, "params": params, "fixed": dict(space.fixed)}
    return json.loads(json.dumps(document, sort_keys=True, default=str))


def _check_signature(study: optuna.Study, mine: dict) -> None:
    """Record the signature on a new study; refuse a study whose recorded signature differs."""
    recorded = study.user_attrs.get("signature")
    if recorded is None:  # this worker created the study, or it predates signatures
        study.set_user_attr("signature", mine)
        return
    if recorded == mine:
        return
    if recorded["method"] != mine["method"] or recorded["pair"] != mine["pair"]:
        raise ConfigError(f"study {study.study_name!r} tunes {recorded['method']} on {recorded['pair']}, "
                          f"this run {mine['method']} on {mine['pair']}",
                          "use another --study name, or that method and pair")
    keys = sorted(k for k in set(recorded["params"]) | set(mine["params"])
                  if recorded["params"].get(k) != mine["params"].get(k))
    keys += sorted(f"fixed {k}" for k in set(recorded["fixed"]) | set(mine["fixed"])
                   if recorded["fixed"].get(k) != mine["fixed"].get(k))
    raise ConfigError(f"study {study.study_name!r} was created with another search space ({', '.join(keys)} differ)",
                      "tune it with the space it was made with (--space FILE), "
                      "or start a new study with --study NAME")


def open_study(settings: TuneSettings, space: SearchSpace) -> optuna.Study:
    """Create or join the study; its creator enqueues the space's defaults. Checks everything before models load."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    directions = ["maximize", "minimize"] if settings.memory else ["maximize"]
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if settings.memory:
        pruner = optuna.pruners.NopPruner()
    storage = open_storage(settings.storage, settings.heartbeat_s)
    name = settings.study_name
    created = False
    try:  # creation is one INSERT under a unique name: of many workers starting at once, exactly one creates
        if settings.trials < 1:  # only exporting: never create an empty study
            raise optuna.exceptions.DuplicatedStudyError
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, pruner=pruner)
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        try:
            study = optuna.load_study(storage=storage, study_name=name, pruner=pruner)
        except KeyError:
            raise ConfigError(f"no study {name!r} in {hide_password(settings.storage)}",
                              "check --study and --storage, or run trials first (--trials N)") from None
    if len(study.directions) != len(directions):
        raise ConfigError(f"study {name!r} has {len(study.directions)} objective(s), this run wants {len(directions)}",
                          "use the same --memory setting as the study's first run, or another --study name")
    _check_signature(study, signature(space, settings))
    if created and space.defaults:
        study.enqueue_trial(dict(space.defaults), skip_if_exists=True)
    study.set_user_attr("method", space.method)
    study.set_user_attr("pair", settings.pair)
    study.sampler = optuna.samplers.TPESampler(seed=session_seed(settings.seed, worker_id(), len(study.trials)))
    return study


def session_seed(seed: int, worker: str, trials: int) -> int:
    """TPE's seed for one worker session: --seed alone would replay the same random draws in every worker and rerun."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{worker}:{trials}".encode()).digest()[:4], "little")


def time_questions(pipeline: Pipeline, contender, questions: Sequence[Question],
                   after_each: Callable[[int, Timing], None] | None = None) -> list[Timing]:
    """Run each question (all its turns) and time it; ``after_each(i, cumulative)`` may raise to stop."""
    timings, tokens, seconds = [], 0, 0.0
    for i, question in enumerate(questions):
        turns = run_conversation_turns(pipeline, contender, question)
        timing = Timing(sum(t.generation.new_tokens for t in turns), sum(t.generation.wall_s for t in turns))
        timings.append(timing)
        tokens, seconds = tokens + timing.tokens, seconds + timing.seconds
        if after_each is not None:
            after_each(i, Timing(tokens, seconds))
    return timings


def measure_baseline(pipeline: Pipeline, base: DecodeConfig, questions: Sequence[Question], warmup_tokens: int = 8) -> list[Timing]:
    """``ar`` on the tuning questions, after a short warm-up."""
    config = dataclasses.replace(base, method="ar", method_options={})
    build_contender(pipeline, dataclasses.replace(config, max_new_tokens=warmup_tokens)).generate(
        pipeline.encode_chat([{"role": "user", "content": questions[0].turns[0]}])
    )
    return time_questions(pipeline, build_contender(pipeline, config), questions)


def _rate(timing: Timing) -> float:
    return timing.tokens / timing.seconds if timing.seconds > 0 else 0.0


def make_objective(pipeline: Pipeline, space: SearchSpace, settings: TuneSettings, questions: Sequence[Question],
                   baseline: Sequence[Timing]):
    cumulative = []
    tokens, seconds = 0, 0.0
    for timing in baseline:
        tokens, seconds = tokens + timing.tokens, seconds + timing.seconds
        cumulative.append(Timing(tokens, seconds))

    def objective(trial: optuna.Trial):
        trial.set_user_attr("worker", worker_id())  # a retried trial arrives with its dead worker's attributes
        try:
            config = apply(settings.base, space.method, space.suggest(trial))
            contender = build_contender(pipeline, config)
        except ConfigError as error:
            trial.set_user_attr("rejected", str(error))
            raise optuna.TrialPruned(str(error)) from None
        reset_peak_memory(pipeline.device)
        per_question: list[float] = []

        def after_each(i: int, so_far: Timing) -> None:
            speedup = _rate(so_far) / _rate(cumulative[i]) if _rate(cumulative[i]) else 0.0
            per_question.append(speedup)
            trial.set_user_attr("speedup_by_question", per_question)
            if not settings.memory:
                trial.report(speedup, i)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"speedup {speedup:.3f} after {i + 1} question(s)")

        time_questions(pipeline, contender, questions, after_each)
        speedup = per_question[-1]
        memory_mb = peak_memory_bytes(pipeline.device) / 2**20
        trial.set_user_attr("peak_memory_mb", memory_mb)
        return (speedup, memory_mb) if settings.memory else speedup

    return objective


def run_tune(pipeline: Pipeline, study: optuna.Study, space: SearchSpace, settings: TuneSettings,
             questions: Sequence[Question], progress: TrialProgress | None = None) -> list[int]:
    """Run ``settings.trials`` more trials of ``study`` (from ``open_study``); the numbers of the trials run here."""
    if settings.trials < 1:
        raise ConfigError(f"--trials {settings.trials} < 1", "pass --trials 1 or more")
    baseline = measure_baseline(pipeline, settings.base, questions)
    objective = make_objective(pipeline, space, settings, questions, baseline)
    ran: list[int] = []

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        ran.append(trial.number)
        if progress is not None:
            value = trial.values[0] if trial.values else None
            progress(trial.number, value, len(ran), settings.trials)

    study.optimize(objective, n_trials=settings.trials, callbacks=[callback], catch=())
    return ran


def completed(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


VALIDATION_ATTR = "validation"  # the study's record of validated trials (tune/validation.py)


def search_ranking(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Completed trials, best search speedup first (two objectives: the Pareto front only)."""
    trials = study.best_trials if len(study.directions) > 1 else completed(study)
    return sorted(trials, key=lambda t: -t.values[0])


def recorded_validation(study: optuna.Study) -> dict:
    """The study's validation record ({} when none): questions, max_new_tokens, speedups by trial number (str)."""
    return dict(study.user_attrs.get(VALIDATION_ATTR) or {})


def validation_speedups(study: optuna.Study) -> dict[int, float]:
    return {int(number): float(value) for number, value in recorded_validation(study).get("speedups", {}).items()}


def selected_trial(study: optuna.Study) -> tuple[optuna.trial.FrozenTrial, float | None]:
    """The trial to export: best on validation when the study has validated trials, else best on search;
    with its validation speedup (None: not validated)."""
    ranking = search_ranking(study)
    if not ranking:
        raise ConfigError(f"study {study.study_name!r} has no completed trial", "run more --trials")
    validated = validation_speedups(study)
    candidates = [t for t in ranking if t.number in validated]
    if not candidates:
        return ranking[0], None
    best = max(candidates, key=lambda t: validated[t.number])
    return best, validated[best.number]


def export_profile(
    study: optuna.Study, space: SearchSpace, settings: TuneSettings, out: Path, thinking: bool | None = None
) -> Profile:
    """Write the selected configuration (best on validation, else best on search: ``selected_trial``) as a
    profile YAML (atomically) and return it; ``thinking``: the chat template switch the study's prompts were
    formatted with, so the profile formats them the same way."""
    best, validation_speedup = selected_trial(study)
    validation = recorded_validation(study)
    config = apply(settings.base, space.method, space.resolve(best.params))
    pareto = []
    if len(study.directions) > 1:
        pareto = [{"trial": t.number, "speedup": t.values[0], "peak_memory_mb": t.values[1]} for t in study.best_trials]
    profile = Profile(
        name=Path(out).stem,
        pair=settings.pair,
        decode=dataclasses.replace(config, method_options={}),
        method_options={space.method: dict(config.method_options)},
        dtype=settings.dtype,
        device=settings.device,
        linear=settings.linear,
        description=f"tuned by `treegraft tune` ({space.method}, study {study.study_name})",
        tuned={"study": study.study_name, "trial": best.number, "speedup": best.values[0], "trials": len(study.trials),
               "selected_by": "search" if validation_speedup is None else "validation",
               **({"validation_speedup": validation_speedup, "validation_questions": validation["questions"],
                   "validation_max_new_tokens": validation["max_new_tokens"]} if validation_speedup is not None else {}),
               "space": space.source, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               **({"pareto": pareto} if pareto else {})},
        thinking=thinking,
    )
    atomic_write_text(Path(out), dump_profile(profile))
    return profile
