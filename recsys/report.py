"""``recsys report``: one PNG and a text table that compare runs from their metrics.jsonl.

    recsys report runs/dlrm_fp32 runs/dlrm_bf16 [--output compare.png]

The picture has four panels, every run in its own colour and named in the legend on top (the
run directory's name, or its path where two names clash):

- loss against steps: the train loss of each log window (line) and the valid logloss (dots);
- AUC against steps: valid AUC (line), the final test AUC (star) and, on synthetic data, the
  oracle AUC of the same samples (dashed; a level line at the test's oracle AUC for a run
  without validation). The axis spans at least :data:`AUC_MIN_SPAN` (near-equal AUCs get
  ticks of 4 decimals at most) with room above the points and, below them, for the legend;
- training throughput (samples/s over all ranks) against steps;
- where a step's time goes: one bar per run, the mean milliseconds per step spent waiting for
  data, in forward, backward, the optimizer step and (under torchrun) the embedding
  collectives, stacked (the trainer logs them as disjoint parts that add up to the step:
  ``time_<part>`` of the train events, :data:`recsys.train.progress.STEP_PARTS`). Runs logged
  before those fields existed say "not logged" there; everything else works for them. The
  time torch.compile spent compiling (``compile_s``) is in no bar (nor in samples/s): it is
  written beside the run's name.

Where runs draw the same values, each later run is drawn thinner and with smaller markers on
top of the earlier ones, so every run stays visible. A run resumed from a checkpoint (a
``resume`` event in its metrics.jsonl) is drawn as one run with a dotted vertical line at each
resume step.

The table has one row per run: steps, the last valid AUC and its step, test AUC and logloss,
a sequence model's ranking metrics (last valid HR@10, test HR@10, NDCG@10, MRR, HR@50; columns
shown when some run logged them), mean samples/s (total samples over total train time: what
the run's summary line reports for a run that was not resumed), the seconds spent compiling
(when some run compiled) and the mean step-time breakdown in ms.

The PNG goes to ``--output`` (must end in ``.png``; an existing file there is replaced) or, by
default, ``<first run dir>/report.png``. Drawing uses matplotlib's Agg canvas: no display is
needed.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, ScalarFormatter

from recsys._files import write_bytes_atomic
from recsys.train.metrics import read_metrics
from recsys.train.progress import STEP_PARTS
from recsys.train.run_dir import METRICS_FILE

REPORT_FILE = "report.png"
# Colours of the step's parts (progress.STEP_PARTS: data, forward, backward, optimizer,
# collectives), stacked in that order; the collectives also hatched.
_PART_COLORS = ("#8da0cb", "#66c2a5", "#fc8d62", "#e5c494", "#b3b3b3")
AUC_MIN_SPAN = 0.002
"""The AUC axis spans at least this much: AUCs closer than that share a tick, and the ticks
need 4 decimals at most."""


@dataclass
class RunMetrics:
    """The events of one run directory, by kind, each list sorted by step (a step logged twice
    keeps its last event).

    Attributes:
        name: how the run is labelled in the picture and the table.
        run_dir: the directory.
        train: ``split == "train"`` events (loss, samples_per_s, time_* fields).
        valid: ``split == "valid"`` events (auc, logloss, oracle_auc).
        test: ``split == "test"`` events.
        resumed_at: steps at which the run was resumed from a checkpoint.
    """

    name: str
    run_dir: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    valid: list[dict[str, Any]] = field(default_factory=list)
    test: list[dict[str, Any]] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)


@dataclass
class RunSummary:
    """One row of the table. None where the run did not log the value.

    Attributes:
        name: the run's label.
        steps: the last step logged.
        valid_auc, valid_step: the last valid AUC and the step it was measured at.
        test_auc, test_logloss: the last test evaluation.
        samples_per_s: total samples / total train time over the train events.
        compile_s: seconds spent compiling under torch.compile (``compile_s`` of the train
            events: in neither samples/s nor ``step_ms``).
        step_ms: mean milliseconds per step of each part whose ``time_<part>`` field the run
            logged, keyed by part (``data``, ``forward``, ``backward``, ``optimizer``,
            ``collectives``: :data:`recsys.train.progress.STEP_PARTS`).
        ranking: a sequence model's ranking metrics, ``valid hr@10`` (the last valid one),
            ``test hr@10``, ``test ndcg@10``, ``test mrr``, ``test hr@50``: those it logged.
    """

    name: str
    steps: int
    valid_auc: float | None
    valid_step: int | None
    test_auc: float | None
    test_logloss: float | None
    samples_per_s: float | None
    compile_s: float | None
    step_ms: dict[str, float]
    ranking: dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    """What :func:`write_report` produced: the PNG's path, the table, and the summaries."""

    output: Path
    table: str
    summaries: list[RunSummary]


def _number(value: Any) -> float | None:
    """A logged value as a float; None when absent. Non-finite floats are logged as strings
    ("nan", "inf"), which float() reads back."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _by_step(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted({int(e["step"]): e for e in events}.values(), key=lambda e: int(e["step"]))


def load_run(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    """The events of ``<run_dir>/metrics.jsonl``.

    Args:
        run_dir: a directory written by ``recsys train``.
        name: the run's label (default: the directory's name).

    Returns:
        The run's events by kind.

    Raises:
        FileNotFoundError: the directory or its metrics.jsonl does not exist.
        ValueError: metrics.jsonl is not JSON lines, or holds no train or eval event.
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: '{run_dir}'")
    if not path.is_file():
        raise FileNotFoundError(
            f"'{run_dir}' has no {METRICS_FILE}: not a run directory of recsys train, or a run "
            "that has not logged anything yet"
        )
    try:
        events = read_metrics(path)
    except ValueError as error:  # json.JSONDecodeError
        raise ValueError(f"'{path}' is not one JSON object per line: {error}") from error
    run = RunMetrics(name or run_dir.resolve().name, run_dir)
    for split in ("train", "valid", "test"):
        setattr(run, split, _by_step([e for e in events if e.get("split") == split]))
    run.resumed_at = sorted({int(e["step"]) for e in events if e.get("split") == "resume"})
    if not (run.train or run.valid or run.test):
        raise ValueError(f"'{path}' holds no train or eval event yet")
    return run


def run_names(run_dirs: Sequence[str | Path]) -> list[str]:
    """Labels for runs: each directory's name, or the path as given where names clash."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(run_dirs, names, strict=True)]


def _window_steps(run: RunMetrics) -> list[int]:
    """Steps trained in each train event's window: since the previous train event, or since
    the resume it follows."""
    bounds = sorted({int(e["step"]) for e in run.train} | set(run.resumed_at))
    previous = dict(zip(bounds, [0, *bounds], strict=False))  # each bound -> the one before
    return [int(e["step"]) - previous[int(e["step"])] for e in run.train]


def summarize(run: RunMetrics) -> RunSummary:
    """The table's row for ``run``: last evaluations, mean throughput and step-time parts."""
    windows = list(zip(run.train, _window_steps(run), strict=True))
    rated = [(n, r) for e, n in windows if (r := _number(e.get("samples_per_s"))) and n > 0]
    # Each window's train time is proportional to n / rate: overall = sum(n) / sum(n / rate).
    samples_per_s = sum(n for n, _ in rated) / sum(n / r for n, r in rated) if rated else None
    step_ms = {}
    for part in STEP_PARTS:
        times = [(n, _number(e.get(f"time_{part}"))) for e, n in windows if n > 0]
        timed = [(n, t) for n, t in times if t is not None]
        if timed:
            step_ms[part] = 1000 * sum(n * t for n, t in timed) / sum(n for n, _ in timed)
    compiled = [c for e in run.train if (c := _number(e.get("compile_s"))) is not None]
    last_valid = run.valid[-1] if run.valid else {}
    last_test = run.test[-1] if run.test else {}
    all_steps = [int(e["step"]) for e in (*run.train, *run.valid, *run.test)]
    return RunSummary(
        name=run.name,
        steps=max(all_steps),
        valid_auc=_number(last_valid.get("auc")),
        valid_step=last_valid.get("step"),
        test_auc=_number(last_test.get("auc")),
        test_logloss=_number(last_test.get("logloss")),
        samples_per_s=samples_per_s,
        compile_s=sum(compiled) if compiled else None,
        step_ms=step_ms,
        ranking=_ranking(last_valid, last_test),
    )


RANKING_COLUMNS = (
    ("valid", "hr@10"),
    ("test", "hr@10"),
    ("test", "ndcg@10"),
    ("test", "mrr"),
    ("test", "hr@50"),
)
"""The ranking metrics of a sequence model's run that the table shows."""


def _ranking(valid: dict[str, Any], test: dict[str, Any]) -> dict[str, float]:
    events = {"valid": valid, "test": test}
    found = {f"{split} {key}": _number(events[split].get(key)) for split, key in RANKING_COLUMNS}
    return {name: value for name, value in found.items() if value is not None}


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def format_table(summaries: Sequence[RunSummary]) -> str:
    """The text table: one row per run, aligned columns, ``-`` for a value not logged; the
    compile column (seconds) and the step-time columns (ms per step) appear when some run
    logged them."""
    labels = [part for part in STEP_PARTS if any(part in s.step_ms for s in summaries)]
    compiled = any(s.compile_s is not None for s in summaries)
    ranking = [f"{split} {key}" for split, key in RANKING_COLUMNS]
    ranking = [name for name in ranking if any(name in s.ranking for s in summaries)]
    header = ["run", "steps", "valid auc", "at step", "test auc", "test logloss", *ranking]
    header += ["samples/s"]
    header += ["compile s"] if compiled else []
    header += [f"{label} ms" for label in labels]
    rows = [header]
    for s in summaries:
        row = [s.name, str(s.steps), _cell(s.valid_auc, ".4f")]
        row += ["-" if s.valid_step is None else str(s.valid_step)]
        row += [_cell(s.test_auc, ".4f"), _cell(s.test_logloss, ".4f")]
        row += [_cell(s.ranking.get(name), ".4f") for name in ranking]
        row += [_cell(s.samples_per_s, ",.0f")]
        row += [_cell(s.compile_s, ",.1f")] if compiled else []
        row += [_cell(s.step_ms.get(label), ".2f") for label in labels]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines) + "\n"


def _series(events: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the events that logged a finite ``key``."""
    points = [(int(e["step"]), _number(e.get(key))) for e in events]
    points = [(s, v) for s, v in points if v is not None and math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def _mark_resumes(ax: Axes, run: RunMetrics, color: str) -> None:
    for step in run.resumed_at:
        ax.axvline(step, color=color, linestyle=":", linewidth=1.2, alpha=0.8)


def _layer(index: int, count: int) -> float:
    """How much wider than the last run's the lines and markers of run ``index`` are drawn:
    1.8 for the first (drawn first, at the bottom) down to 1.0 for the last (on top), so runs
    that draw the same values stay visible around each other."""
    return 1.0 if count == 1 else 1.8 - 0.8 * index / (count - 1)


def _draw_loss(ax: Axes, runs: Sequence[RunMetrics], colors: Sequence[str]) -> None:
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        size = _layer(i, len(runs))
        ax.plot(*_series(run.train, "loss"), color=color, linewidth=1.6 * size)
        ax.plot(
            *_series(run.valid, "logloss"), color=color, linestyle="none", marker="o", ms=5 * size
        )
        _mark_resumes(ax, run, color)
    styles = [
        Line2D([], [], color="gray", linewidth=1.6, label="train loss"),
        Line2D([], [], color="gray", linestyle="none", marker="o", ms=5, label="valid logloss"),
    ]
    if any(run.resumed_at for run in runs):
        styles.append(Line2D([], [], color="gray", linestyle=":", label="resumed"))
    ax.legend(handles=styles, loc="upper right", fontsize=9)
    ax.set(title="Loss", xlabel="step", ylabel="binary cross-entropy")


def _oracle_series(run: RunMetrics) -> tuple[str, list[int], list[float]]:
    """The oracle AUC to draw for ``run``: ("valid", steps, values) of its validations, or,
    without any, ("test", [first step, test step], [value] * 2): a level line at the test's
    oracle AUC over the run; ("", [], []) when neither was logged."""
    steps, oracle = _series(run.valid, "oracle_auc")
    if steps:
        return "valid", steps, oracle
    test_steps, test_oracle = _series(run.test, "oracle_auc")
    if not test_steps:
        return "", [], []
    first = min(int(e["step"]) for e in (*run.train, *run.test))
    return "test", [first, test_steps[-1]], [test_oracle[-1]] * 2


def _auc_limits(values: list[float]) -> tuple[float, float]:
    """y limits for AUCs: a span of at least :data:`AUC_MIN_SPAN` around them, 8% of it free
    above the highest point and 25% below the lowest (where the legend goes)."""
    low, high = min(values), max(values)
    span = max(high - low, AUC_MIN_SPAN)
    middle = (low + high) / 2
    low, high = middle - span / 2, middle + span / 2
    return low - 0.25 * span, high + 0.08 * span


def _draw_auc(ax: Axes, runs: Sequence[RunMetrics], colors: Sequence[str]) -> None:
    oracle_splits, values = set(), []
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        size = _layer(i, len(runs))
        valid, test = _series(run.valid, "auc"), _series(run.test, "auc")
        ax.plot(*valid, color=color, linewidth=1.6 * size, marker="o", ms=5 * size)
        # under every valid marker (smaller, so both show where they meet)
        ax.plot(*test, color=color, linestyle="none", marker="*", ms=13 * size, zorder=1.9)
        split, steps, oracle = _oracle_series(run)
        if split:
            oracle_splits.add(split)
            # a run of one step: a dash at its oracle AUC
            dash = {"marker": "_", "ms": 16 * size} if len(set(steps)) == 1 else {}
            ax.plot(steps, oracle, color=color, linestyle="--", linewidth=size, alpha=0.7, **dash)
        values += valid[1] + test[1] + oracle
        _mark_resumes(ax, run, color)
    styles = [
        Line2D([], [], color="gray", linewidth=1.6, marker="o", ms=5, label="valid"),
        Line2D([], [], color="gray", linestyle="none", marker="*", ms=12, label="test (end)"),
    ]
    if oracle_splits:
        which = f" ({oracle_splits.pop()})" if len(oracle_splits) == 1 else ""
        styles.append(Line2D([], [], color="gray", linestyle="--", label=f"oracle{which}"))
    if values:
        ax.set_ylim(*_auc_limits(values))
    # Plain tick values (no offset like "+8.5e-1"); the minimum span keeps them to 4 decimals.
    ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))
    ax.legend(handles=styles, loc="lower right", fontsize=9, ncols=len(styles))
    ax.set(title="AUC", xlabel="step", ylabel="AUC")


def _rate_label(value: float, _position: object = None) -> str:
    """A samples/s tick label: 2.5k, 80k, 1.25M (exact to the tick value, never rounded to a
    neighbour); below 1,000 as it is."""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.6g}{unit}"
    return f"{value:.6g}"


def _draw_throughput(ax: Axes, runs: Sequence[RunMetrics], colors: Sequence[str]) -> None:
    top = 0.0
    for i, (run, color) in enumerate(zip(runs, colors, strict=True)):
        size = _layer(i, len(runs))
        steps, rates = _series(run.train, "samples_per_s")
        ax.plot(steps, rates, color=color, linewidth=1.6 * size, marker=".", ms=6 * size)
        top = max([top, *rates])
        _mark_resumes(ax, run, color)
    ax.set_ylim(0, 1.08 * top or 1.0)  # from 0: heights compare as ratios
    if top >= 10_000:  # 80k rather than 80000; small rates as they are
        ax.yaxis.set_major_formatter(FuncFormatter(_rate_label))
    ax.set(title="Training throughput", xlabel="step", ylabel="samples/s (all ranks)")


_PART_STYLE = {
    part: {"facecolor": color, "hatch": "///" if part == "collectives" else None}
    for part, color in zip(STEP_PARTS, _PART_COLORS, strict=True)
}


def _draw_step_bar(
    ax: Axes, row: int, summary: RunSummary, parts: list[str], widest: float
) -> None:
    """One run's stacked bar at ``row``: a segment per part (its ms written inside when there
    is room), the total at its end."""
    left = 0.0
    for part in parts:
        width = summary.step_ms.get(part, 0.0)
        ax.barh(
            row,
            width,
            left=left,
            height=0.45,
            edgecolor="white",
            linewidth=0.5,
            **_PART_STYLE[part],
        )
        if width > 0.08 * widest:
            ax.text(left + width / 2, row, f"{width:.1f}", ha="center", va="center", fontsize=8)
        left += width
    total = f" {left:.2f} ms" if left < 10 else f" {left:.1f} ms"
    ax.text(left, row, total if summary.step_ms else " not logged", va="center", fontsize=9)


def _draw_breakdown(ax: Axes, summaries: Sequence[RunSummary], colors: Sequence[str]) -> None:
    """Horizontal stacked bars, one per run (the first on top, its name above it in the run's
    colour): the parts of a step, which add up to the whole step, and the total."""
    ax.set_title("Where a step's time goes (mean ms per step)")
    parts = [part for part in STEP_PARTS if any(part in s.step_ms for s in summaries)]
    if not parts:
        message = "no step-time breakdown logged\n(time_* fields of train events)"
        ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])
        return
    widest = max(sum(s.step_ms.values()) for s in summaries)
    for row, (summary, color) in enumerate(zip(summaries, colors, strict=True)):
        _draw_step_bar(ax, row, summary, parts, widest)
        label = summary.name
        if summary.compile_s is not None:
            label += f"   (+ compile {summary.compile_s:,.1f} s, in no bar)"
        ax.text(0, row - 0.26, label, va="bottom", color=color, fontsize=9)
    ax.set_yticks([])
    ax.set_ylim(len(summaries) - 0.5, -1.2)  # first run on top; room for the legend above
    ax.set_xlim(0, widest * 1.18)  # room for the totals
    ax.set_xlabel("ms per step")
    handles = [Patch(edgecolor="white", label=part, **_PART_STYLE[part]) for part in parts]
    ax.legend(
        handles=handles,
        loc="upper center",
        ncols=len(handles),
        fontsize=9,
        handlelength=1.5,
        columnspacing=1.0,
        frameon=False,
    )


def plot_report(runs: Sequence[RunMetrics], summaries: Sequence[RunSummary]) -> Figure:
    """The report figure (2 x 2 panels, the runs named in a legend on top)."""
    colors = [f"C{i % 10}" for i in range(len(runs))]
    figure = Figure(figsize=(13, 8.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    (loss, auc), (speed, breakdown) = figure.subplots(2, 2)
    _draw_loss(loss, runs, colors)
    _draw_auc(auc, runs, colors)
    _draw_throughput(speed, runs, colors)
    _draw_breakdown(breakdown, summaries, colors)
    for ax in (loss, auc, speed):
        ax.grid(alpha=0.3)
    auc.sharex(loss)  # the same steps under every curve
    speed.sharex(loss)
    loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    names = [
        Line2D([], [], color=c, linewidth=3, label=r.name)
        for r, c in zip(runs, colors, strict=True)
    ]
    figure.legend(
        handles=names,
        loc="outside upper center",
        ncols=min(len(runs), 4),
        fontsize=10,
        frameon=False,
    )
    return figure


def output_path(run_dirs: Sequence[str | Path], output: str | Path | None) -> Path:
    """Where the PNG goes: ``output``, or ``<first run dir>/report.png``.

    Raises:
        ValueError: ``output`` does not end in ``.png``, is a directory, or is in a directory
            that does not exist.
    """
    path = Path(run_dirs[0]) / REPORT_FILE if output is None else Path(output)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--output '{path}' must end in .png (the report is a PNG image)")
    if path.is_dir():
        raise ValueError(f"--output '{path}' is a directory; give a file name ending in .png")
    if output is not None and not path.parent.is_dir():
        raise ValueError(
            f"--output '{path}': directory '{path.parent}' does not exist (create it first)"
        )
    return path


def write_report(run_dirs: Sequence[str | Path], output: str | Path | None = None) -> Report:
    """Read the runs, draw the PNG and build the table.

    Args:
        run_dirs: one or more run directories written by ``recsys train``.
        output: the PNG to write (default ``<first run dir>/report.png``); replaced if it
            exists; its directory must exist.

    Returns:
        The PNG's path, the table and one summary per run.

    Raises:
        ValueError: no run directory, a bad ``output``, an unreadable metrics.jsonl.
        FileNotFoundError: a run directory or its metrics.jsonl is missing.

    Example:
        >>> report = write_report(["runs/dlrm_fp32", "runs/dlrm_bf16"], "compare.png")
        >>> print(report.table)
    """
    if not run_dirs:
        raise ValueError("recsys report needs at least one run directory")
    path = output_path(run_dirs, output)
    runs = [load_run(d, n) for d, n in zip(run_dirs, run_names(run_dirs), strict=True)]
    summaries = [summarize(run) for run in runs]
    png = io.BytesIO()
    plot_report(runs, summaries).savefig(png, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, png.getbuffer())
    return Report(path, format_table(summaries), summaries)
