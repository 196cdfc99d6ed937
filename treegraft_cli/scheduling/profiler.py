"""`treegraft profile`'s measurement: forward time against tree tokens and context, plus host costs.

For each context length c the model first runs over c random tokens (untimed), then for each tree width
t a t-token masked forward (tree-shaped: each token sees the context and a causal chain of the others)
is timed ``warmup + repeats`` times on a cropped-back cache; the median of the repeats is kept. CUDA is
synchronised around every timed forward. Host costs: one weak n-gram layer (K suffix lookups over a
repetitive context) and one adjacency retrieval (a rank-template gather from the root), each a median.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel

from .. import __version__
from ..atomic import save_figure
from ..drafters.adjacency import AdjacencyTable
from ..drafters.ngram import NgramIndex
from ..drafters.rank_template import build_template
from ..errors import ConfigError
from ..lm import CausalLM
from ..models.packed_linear import is_packed
from .cost_profile import CostProfile
from .costs import timing_lm

Progress = Callable[[str, int, int], None]  # (description, done, total)

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (128, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class ProfileSettings:
    tree_tokens: tuple[int, ...] = DEFAULT_TOKENS
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    warmup: int = 1
    repeats: int = 3
    width: int = 10  # K: n-gram continuations per parent and the adjacency table's k
    seed: int = 0


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(run: Callable[[], None], warmup: int, repeats: int, device: torch.device) -> float:
    times = []
    for i in range(warmup + repeats):
        _synchronise(device)
        started = time.perf_counter()
        run()
        _synchronise(device)
        if i >= warmup:
            times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def _tree_forward(lm: CausalLM, context: int, inputs: torch.Tensor) -> Callable[[], None]:
    """One forward of ``inputs`` ([t]) after ``context`` cached rows, each token seeing the context and a causal chain."""
    tokens = inputs.numel()
    positions = torch.arange(context, context + tokens, device=lm.device)
    visible = torch.ones(tokens, context + tokens, dtype=torch.bool, device=lm.device)
    visible[:, context:] = torch.ones(tokens, tokens, dtype=torch.bool, device=lm.device).tril()

    def run() -> None:
        lm.crop(context)  # drop the previous repeat's rows: every repeat sees the same cache
        lm.forward(inputs, positions, visible)

    return run


def forward_curve(
    model: nn.Module, settings: ProfileSettings, label: str, progress: Progress, done: int, total: int
) -> tuple[tuple[float, ...], ...]:
    """[context][tree_tokens] median ms of one forward of ``model`` (a causal LM or an EAGLE-3 head, see
    ``scheduling.costs.timing_lm``); ``done``/``total`` count grid points for progress."""
    lm = timing_lm(model)
    generator = torch.Generator().manual_seed(settings.seed)
    vocab = int(model.config.vocab_size)
    rows = []
    for context in settings.contexts:
        lm.reset()
        lm.forward(torch.randint(0, vocab, (context,), generator=generator).to(lm.device), logits_to_keep=1)
        row = []
        for tokens in settings.tree_tokens:
            progress(f"{label}: {tokens} tokens after {context}", done, total)
            inputs = torch.randint(0, vocab, (tokens,), generator=generator).to(lm.device)
            row.append(_median_ms(_tree_forward(lm, context, inputs), settings.warmup, settings.repeats, lm.device))
            done += 1
        rows.append(tuple(row))
    lm.reset()
    return tuple(rows)


def host_costs(vocab: int, settings: ProfileSettings) -> dict[str, float]:
    """Median ms of one weak layer (K lookups) and one adjacency retrieval, both on the CPU host."""
    generator = torch.Generator().manual_seed(settings.seed)
    k = settings.width
    pattern = torch.randint(0, vocab, (64,), generator=generator).tolist()
    context = (pattern * (settings.contexts[0] // len(pattern) + 1))[: max(settings.contexts[0], 64)]
    index = NgramIndex(max_n=5)
    index.extend(context)

    def ngram_layer() -> None:
        for _ in range(k):
            index.continuations(context[-5:], 5, k, 10)

    table = AdjacencyTable(k)
    tokens = torch.arange(min(vocab, 256))  # rows written; the gather cost does not depend on how many
    table.write(tokens, torch.randn(tokens.numel(), vocab, generator=generator))
    template = build_template((k, k, k // 2 or 1, k // 2 or 1), 4 * k, k)
    device = torch.device("cpu")
    return {
        "ngram": _median_ms(ngram_layer, settings.warmup, settings.repeats, device),
        "adjacency": _median_ms(lambda: table.materialise(int(tokens[0]), template), settings.warmup, settings.repeats, device),
    }


def versions() -> dict[str, str]:
    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__), "treegraft": __version__,
            "python": platform.python_version()}


def describe_device(device: torch.device, packed_linears: bool = False) -> str:
    """The device as a cost profile names it; packed linears (``--linear packed``) change CPU costs, so they are part of it."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    packed = ", packed linears" if packed_linears else ""
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads{packed})"


def measure_profile(
    pair: str,
    dtype: str,
    target: PreTrainedModel,
    drafter: nn.Module | None,  # a causal LM or an EAGLE-3 head
    settings: ProfileSettings,
    progress: Progress | None = None,
) -> CostProfile:
    """Time the target (and the drafter, if any) over the grid, then the host-side drafters."""
    report = progress or (lambda description, done, total: None)
    points = len(settings.contexts) * len(settings.tree_tokens)
    total = points * (2 if drafter is not None else 1) + 1
    target_ms = forward_curve(target, settings, "target", report, 0, total)
    drafter_ms = forward_curve(drafter, settings, "drafter", report, points, total) if drafter is not None else ()
    report("host: n-gram and adjacency", total - 1, total)
    host = host_costs(int(target.config.vocab_size), settings)
    report("done", total, total)
    return CostProfile(
        pair=pair,
        device=describe_device(target.device, is_packed(target)),
        dtype=dtype,
        tree_tokens=tuple(settings.tree_tokens),
        contexts=tuple(settings.contexts),
        target_ms=target_ms,
        drafter_ms=drafter_ms,
        host_ms=host,
        versions=versions(),
        warmup=settings.warmup,
        repeats=settings.repeats,
    )


def parse_grid(text: str, name: str) -> tuple[int, ...]:
    """``"1,4,16"`` → ``(1, 4, 16)``, sorted and unique; a clear error on anything else."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--{name} {text!r} is not a comma list of integers", f"e.g. --{name} 1,4,16") from None
    if not values or values[0] < 1:
        raise ConfigError(f"--{name} needs positive integers (got {text!r})", f"e.g. --{name} 1,4,16")
    return tuple(values)


def plot_profile(profile: CostProfile, path) -> None:
    """A PNG of the curves: ms against tree tokens, one line per context, target solid, drafter dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for i, context in enumerate(profile.contexts):
        colour = f"C{i % 10}"
        axis.plot(profile.tree_tokens, profile.target_ms[i], "-o", color=colour, ms=3, label=f"target, ctx {context}")
        if profile.drafter_ms:
            axis.plot(profile.tree_tokens, profile.drafter_ms[i], "--", color=colour, label=f"drafter, ctx {context}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens in one forward (tree size + root)")
    axis.set_ylabel("median ms")
    axis.set_title(f"{profile.pair} — {profile.device}, {profile.dtype}")
    axis.legend(fontsize=7)
    figure.tight_layout()
    save_figure(figure, path, dpi=120)


def summary_rows(profile: CostProfile, columns: Sequence[int]) -> list[list]:
    """Rows (model, context, ms at each of ``columns`` tree tokens) for the CLI's table."""
    rows = []
    for context in profile.contexts:
        rows.append(["target", context, *(profile.target_forward_ms(t, context) for t in columns)])
        if profile.drafter_ms:
            rows.append(["drafter", context, *(profile.drafter_forward_ms(t, context) for t in columns)])
    return rows
