"""``trainfsm plot``: a picture of a run from its audit trail.

Top: one band per rank over wall-clock time, coloured by the machine's state (spans between
transitions), with markers for checkpoints saved and loaded, non-finite retries, signals received
and agreed, exceptions and exits by the stall watchdog, and a dashed line where each restart (a
new attempt) began. Each stall the watchdog reported is a hatched span over its rank's band, from
the rank's last transition (the first report's ``ts`` less its ``seconds``) to its end: the
``stall_cleared`` (start + its ``seconds``), or for a stall never cleared the rank's last event of
the attempt. Below, when the trail has them, loss and learning-rate curves over steps.

``LoggingHook`` writes its interval averages to the trail as ``metrics`` events (``values``:
``train/loss``, ``train/lr/<group>``, ...; ``loss``, ``lr_<i>`` in trails of earlier versions).
Curves are drawn from those, and from any other event that carries a numeric ``loss`` or ``lr`` /
``lr_<i>`` field; a trail without any (no LoggingHook) gets the
timeline alone, and ``PlotResult.metrics`` says so.

matplotlib is optional (the ``plot`` extra) and imported only when a plot is drawn. The figure is
made with matplotlib's object API and the Agg canvas, never pyplot, so no global backend is set in
the caller's process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from trainfsm import machine as fsm
from trainfsm.trail.reader import Note, Record, expand_steps, open_trail

MISSING_MATPLOTLIB: Final = "trainfsm plot needs matplotlib: pip install 'trainfsm[plot]'"

STATE_COLORS: Final[dict[str, str]] = {
    fsm.BUILD: "#9e9e9e",
    fsm.RESTORE: "#8e6cc0",
    fsm.STEP: "#9ecae1",
    fsm.ACCUMULATE: "#3182bd",
    fsm.RETRY: "#fd8d3c",
    fsm.CHECKPOINT: "#31a354",
    fsm.EXIT: "#252525",
}

#: Event (an exit: ``exit_<reason>``) -> (label, marker, colour, vertical position within the band:
#: 0 bottom .. 1 top). The other exit reasons have their markers already: a preemption its signals,
#: a failure its exception, a kill the blank after the rank's last event.
MARKERS: Final[dict[str, tuple[str, str, str, float]]] = {
    "checkpoint_saved": ("checkpoint saved", "v", "#006d2c", 0.95),
    "checkpoint_loaded": ("checkpoint loaded", "^", "#006d2c", 0.05),
    "checkpoint_skipped": ("checkpoint skipped", "^", "#bdbdbd", 0.05),
    "non_finite": ("non-finite retry", "x", "#e6550d", 0.5),
    "oom": ("out of memory: split", "v", "#756bb1", 0.5),
    "signal_received": ("signal received", "*", "#de2d26", 0.75),
    "signal_agreed": ("signal agreed", "D", "#a50f15", 0.25),
    "exception": ("exception", "X", "#000000", 0.5),
    "exit_stalled": ("exit: stalled", "s", "#ce1256", 0.5),
}

#: A stall's span: a colour no state or marker has, hatched so the state under it still shows.
STALL_COLOR: Final = "#e7298a"
STALL_GID: Final = "stall"  # the ``gid`` of each stall's rectangle, for tests and SVG readers

#: Figure geometry (inches; 100 dpi by default): 12 wide, the timeline at least this high (room
#: for 14 legend entries) and higher when its legend has more, the curves below it this high.
TIMELINE_MIN_INCHES: Final = 2.8
LEGEND_ENTRY_INCHES: Final = 0.2
CURVES_INCHES: Final = 3.0

#: Spans of these frequent states shorter than this fraction of the run are absorbed by their
#: neighbour: they are far below a pixel, and a long run has millions of them.
_MIN_FRACTION: Final = 1 / 20000
_FREQUENT: Final = frozenset({fsm.STEP, fsm.ACCUMULATE})


class PlotError(Exception):
    """The plot cannot be drawn here (matplotlib missing); the message says what to install."""


@dataclass(slots=True)
class PlotResult:
    path: Path
    width: int  # pixels
    height: int
    ranks: list[int]
    attempts: int
    metrics: list[str]  # the curves drawn ("loss", "lr/group_0", "lr_0", ...); empty: timeline only
    notes: list[Note]


@dataclass(slots=True)
class Stall:
    """One stall of one rank, as drawn: ``start`` is its last transition, ``end`` the first one
    after (``cleared``) or, never cleared, its last event of the attempt."""

    rank: int
    attempt: int
    state: str
    step: int
    start: float
    end: float
    cleared: bool = False

    def label(self) -> str:
        return f"stall rank {self.rank} ({self.state}, step {self.step})"


@dataclass(slots=True)
class _Timeline:
    """What the picture needs from the trail, collected in one pass.

    A rank's open span is (since, state, attempt); a transition closes it and opens the next. An
    attempt's last span ends at that rank's last event of the attempt (its exit, or the last line
    a killed process wrote); the time until the next attempt's ``run_start`` stays blank.
    """

    spans: dict[int, list[list[Any]]] = field(default_factory=dict)  # rank -> [[start, end, state]]
    markers: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # event -> [(ts, rank)]
    restarts: dict[int, float] = field(default_factory=dict)  # attempt -> its earliest event
    stalls: list[Stall] = field(default_factory=list)
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)  # name -> step -> value
    start: float = math.inf
    end: float = -math.inf
    _open: dict[int, tuple[float, str, int]] = field(default_factory=dict)
    _last: dict[int, float] = field(default_factory=dict)  # rank -> ts of its latest event
    _stalled: dict[int, Stall] = field(default_factory=dict)  # rank -> its stall not cleared yet

    def add(self, record: Record) -> None:
        ts, rank = record.ts, record.rank
        self.start, self.end = min(self.start, ts), max(self.end, ts)
        opened = self._open.get(rank)
        if opened is not None and opened[2] != record.attempt:
            self._close(rank, opened, self._last[rank])
            self._stalled.pop(rank, None)  # never cleared: it ends at the attempt's last event
            opened = None
        if opened is None:
            self.restarts[record.attempt] = min(ts, self.restarts.get(record.attempt, math.inf))
            self._open[rank] = (ts, record.state, record.attempt)
        elif record.name == "transition":
            self._close(rank, opened, ts)
            self._open[rank] = (ts, str(record.data["dest"]), record.attempt)
        self._last[rank] = ts
        self._stall(record)
        name = f"exit_{record.data.get('reason')}" if record.name == "exit" else record.name
        if name in MARKERS:  # a signal is marked when it arrived, not when it was reported
            at: Any = record.data.get("received_at") if name == "signal_received" else None
            self.markers.setdefault(name, []).append((float(at) if _is_number(at) else ts, rank))
        self._metrics(record)

    def finish(self) -> None:
        for rank, opened in self._open.items():
            self._close(rank, opened, self._last[rank])
        self._open.clear()
        self._stalled.clear()

    def _close(self, rank: int, opened: tuple[float, str, int], end: float) -> None:
        since, state, _ = opened
        spans = self.spans.setdefault(rank, [])
        if spans and spans[-1][2] == state and spans[-1][1] == since:
            spans[-1][1] = end  # ACCUMULATE -> ACCUMULATE: one span
        else:
            spans.append([since, end, state])

    def _stall(self, record: Record) -> None:
        """A stall opens at its first report and lasts until ``stall_cleared``; until then every
        event of its rank (a later report, lines the watchdog's exit left) moves its end on. The
        watchdog writes from its own thread, so the trainer's lines may follow with earlier times."""
        stall = self._stalled.get(record.rank)
        if stall is not None:
            stall.end = max(stall.end, record.ts)
        if record.name not in ("stall", "stall_cleared"):
            return
        seconds: Any = record.data.get("seconds")
        seconds = float(seconds) if _is_number(seconds) else None
        if record.name == "stall" and (stall is None or record.data.get("report") == 1):
            start = record.ts - (seconds or 0.0)
            stall = Stall(record.rank, record.attempt, record.state, record.step, start, record.ts)
            self.stalls.append(stall)
            self._stalled[record.rank] = stall
        elif record.name == "stall_cleared" and stall is not None:
            if seconds is not None:
                stall.end = stall.start + seconds
            stall.cleared = True
            del self._stalled[record.rank]

    def _metrics(self, record: Record) -> None:
        data = record.data
        values = data.get("values") if record.name == "metrics" else None
        for key, value in (values if isinstance(values, dict) else data).items():
            # LoggingHook's "train/loss", "train/lr/<group>"; trails of older versions: "loss", "lr_<i>"
            name = key.removeprefix("train/")
            if (name in ("loss", "lr") or name.startswith(("lr_", "lr/"))) and _is_number(value):
                self.metrics.setdefault(name, {})[record.step] = float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def collect(inputs: Iterable[Path]) -> tuple[_Timeline, list[Note]]:
    """One pass over the trail of ``inputs``; ``TrailError`` when it is unreadable."""
    trail = open_trail(inputs)
    timeline = _Timeline()
    for record in trail.records():
        if record.name == "steps":  # a compact run of routine steps: its STEP/ACCUMULATE spans
            for event in expand_steps(record.data):
                timeline.add(Record(record.file, record.line, event))
        else:
            timeline.add(record)
    timeline.finish()
    return timeline, trail.notes


def plot(inputs: Iterable[Path], output: Path, *, title: str | None = None, dpi: int = 100) -> PlotResult:
    """Draw the run of ``inputs`` into ``output`` (PNG, or what its suffix says matplotlib can write)."""
    _figure_class()  # a missing matplotlib is named before the trail is read
    timeline, notes = collect(inputs)
    figure = draw(timeline, title=title, dpi=dpi)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    width, height_px = (round(v) for v in figure.get_size_inches() * dpi)
    return PlotResult(
        output, width, height_px, sorted(timeline.spans), len(timeline.restarts), sorted(timeline.metrics), notes
    )


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(MISSING_MATPLOTLIB) from None
    return Figure


def draw(timeline: _Timeline, *, title: str | None = None, dpi: int = 100) -> Any:
    """The matplotlib ``Figure`` of ``timeline`` (``collect``'s), not saved."""
    Figure = _figure_class()
    ranks = sorted(timeline.spans)
    metrics = sorted(timeline.metrics)
    has_curves = bool(metrics)
    entries = len(STATE_COLORS) + len(timeline.markers) + bool(timeline.stalls)
    band = max(TIMELINE_MIN_INCHES, 1.2 + 0.5 * len(ranks), LEGEND_ENTRY_INCHES * entries)  # the legend beside it
    figure = Figure(figsize=(12, band + (CURVES_INCHES if has_curves else 0.0)), dpi=dpi, layout="constrained")
    if has_curves:
        top, bottom = figure.subplots(2, 1, height_ratios=[band, CURVES_INCHES])
    else:
        top, bottom = figure.subplots(1, 1), None
    scale, unit = _time_unit(timeline.end - timeline.start)
    _draw_timeline(top, timeline, ranks, scale, unit)
    if bottom is not None:
        _draw_curves(bottom, timeline.metrics)
    suffix = "" if has_curves else "  (no loss or learning rate in the trail, add a LoggingHook: timeline only)"
    figure.suptitle((title or "trainfsm run") + suffix, fontsize=11)
    return figure


def summary(result: PlotResult) -> str:
    """The lines ``trainfsm plot`` prints once the picture is written: where, its size, the ranks and
    attempts drawn, and whether the trail had curves to draw."""
    ranks, attempts = len(result.ranks), result.attempts
    lines = [
        f"wrote {result.path} ({result.width}x{result.height} px): {ranks} rank{'s' * (ranks != 1)}, "
        f"{attempts} attempt{'s' * (attempts != 1)}"
    ]
    if not result.metrics:
        lines.append(
            "the trail has no loss or learning rate (no metrics events: add a LoggingHook): drew the timeline only"
        )
    return "\n".join(lines)


def _time_unit(total: float) -> tuple[float, str]:
    if total > 3 * 3600:
        return 3600.0, "h"
    if total > 180:
        return 60.0, "min"
    return 1.0, "s"


def _draw_timeline(axes: Any, timeline: _Timeline, ranks: list[int], scale: float, unit: str) -> None:
    t0 = timeline.start
    minimum = (timeline.end - t0) * _MIN_FRACTION
    for row, rank in enumerate(ranks):
        for state, bars in _bars(timeline.spans[rank], minimum).items():
            spans = [((start - t0) / scale, max(end - start, minimum) / scale) for start, end in bars]
            axes.broken_barh(spans, (row - 0.35, 0.7), facecolors=STATE_COLORS.get(state, "#cccccc"))
    row_of = {rank: row for row, rank in enumerate(ranks)}
    for name, points in timeline.markers.items():
        label, marker, color, height = MARKERS[name]
        xs = [(ts - t0) / scale for ts, _ in points]
        ys = [row_of.get(rank, 0) + 0.35 - 0.7 * height for _, rank in points]  # rows grow downwards
        axes.scatter(xs, ys, marker=marker, color=color, s=36, zorder=3, label=label)
    _draw_stalls(axes, timeline, row_of, scale)
    first = min(timeline.restarts, default=0)
    for attempt, ts in sorted(timeline.restarts.items()):
        x = (ts - t0) / scale
        if attempt != first:
            axes.axvline(x, color="#636363", linestyle="--", linewidth=1, zorder=1)
        axes.annotate(f"attempt {attempt}", (x, -0.42), xytext=(2, 0), textcoords="offset points", fontsize=8)
    axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axes.set_ylim(len(ranks) - 0.5, -0.75)  # rank 0 on top
    axes.set_xlabel(f"wall-clock time since the first event ({unit})")
    _legend(axes)


def _draw_stalls(axes: Any, timeline: _Timeline, row_of: dict[int, int], scale: float) -> None:
    from matplotlib.patches import Rectangle

    for index, stall in enumerate(timeline.stalls):
        x, row = (stall.start - timeline.start) / scale, row_of.get(stall.rank, 0)
        rectangle = Rectangle(
            (x, row - 0.45),
            (stall.end - stall.start) / scale,
            0.9,
            facecolor=STALL_COLOR,
            alpha=0.35,
            hatch="///",
            edgecolor=STALL_COLOR,
            zorder=2,
            gid=STALL_GID,
            label="stall" if index == 0 else "_stall",  # one legend entry for them all
        )
        axes.add_patch(rectangle)
        axes.annotate(
            stall.label(),
            (x, row + 0.45),
            xytext=(2, 1),
            textcoords="offset points",
            fontsize=7,
            color="#980043",
            verticalalignment="bottom",
        )


def _bars(spans: list[list[Any]], minimum: float) -> dict[str, list[tuple[float, float]]]:
    """Spans grouped by state; tiny spans of frequent states are absorbed by the span before."""
    kept: list[list[Any]] = []
    for start, end, state in spans:
        if kept and (kept[-1][2] == state or (state in _FREQUENT and end - start < minimum)):
            kept[-1][1] = max(kept[-1][1], end)
        else:
            kept.append([start, end, state])
    by_state: dict[str, list[tuple[float, float]]] = {}
    for start, end, state in kept:
        by_state.setdefault(state, []).append((start, end))
    return by_state


def _legend(axes: Any) -> None:
    from matplotlib.patches import Patch

    handles, _ = axes.get_legend_handles_labels()
    states = [Patch(facecolor=color, label=state) for state, color in STATE_COLORS.items()]
    axes.legend(
        handles=states + handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
        borderaxespad=0,
    )


def _draw_curves(axes: Any, metrics: dict[str, dict[int, float]]) -> None:
    lines = []
    if "loss" in metrics:
        steps = sorted(metrics["loss"])
        lines += axes.plot(steps, [metrics["loss"][s] for s in steps], color="#3182bd", label="loss")
        axes.set_ylabel("loss")
    rates = [name for name in sorted(metrics) if name != "loss"]
    if rates:
        lr_axes = axes.twinx() if "loss" in metrics else axes
        colors = iter(["#e6550d", "#756bb1", "#31a354", "#636363"] * len(rates))
        for name in rates:
            steps = sorted(metrics[name])
            lines += lr_axes.plot(
                steps, [metrics[name][s] for s in steps], linestyle="--", color=next(colors), label=name
            )
        lr_axes.set_ylabel("learning rate")
    axes.set_xlabel("step")
    axes.legend(handles=lines, loc="upper right", fontsize=8)
