"""``trainfsm plot``: the PNG exists, has the size the command reports, and is a real picture."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli_helpers import cli, preempted, read_lines, run, trail, write_lines
from tests.helpers import TinyTrainer, trail_events
from trainfsm import CheckpointingHook
from trainfsm.tools.plot import STALL_GID, STATE_COLORS


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


def _colours(path: Path) -> set[tuple[int, int, int]]:
    """The distinct RGB colours of the image."""
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(path))[..., :3] * 255).round().astype("uint8")
    return {tuple(int(c) for c in row) for row in pixels.reshape(-1, 3)}  # type: ignore[misc]


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return (int(hex_colour[1:3], 16), int(hex_colour[3:5], 16), int(hex_colour[5:7], 16))


def test_plot_writes_a_timeline_of_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    preempted(tmp_path / "run", steps=6, at=3)
    run(tmp_path / "run", steps=8, interval=2, max_non_finite_grad_retries=1, script={3: "nan"})  # step 6 retried
    output = tmp_path / "out" / "run.png"
    code, out, err = cli(capsys, "plot", tmp_path / "run", "-o", output)
    assert code == 0, err
    assert output.is_file()
    assert f"wrote {output} (1200x280 px): 1 rank, 2 attempts" in out
    assert "drew the timeline only" in out  # the trail records no loss or learning rate
    assert _png_size(output) == (1200, 280)
    colours = _colours(output)
    assert len(colours) > 50  # anti-aliased text, bars and markers: not a blank canvas
    for state in ("BUILD", "ACCUMULATE", "CHECKPOINT", "EXIT"):
        assert _rgb(STATE_COLORS[state]) in colours, state  # its legend patch at least


def test_plot_draws_loss_and_learning_rate_when_events_carry_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    run(tmp_path / "real", steps=6, interval=3)
    events: list[dict[str, Any]] = read_lines(trail(tmp_path / "real"))
    for event in events:
        if event["event"] == "transition" and event["source"] == "ACCUMULATE":
            event.update(loss=1.0 / event["step"], lr=0.1 * 0.9 ** event["step"])
    path = write_lines(tmp_path / "run" / "logs" / "events.rank0.jsonl", events)
    output = tmp_path / "run.png"
    code, out, _ = cli(capsys, "plot", path, "-o", output, "--title", "with curves")
    assert code == 0
    assert "drew the timeline only" not in out
    width, height = _png_size(output)
    assert (width, height) == (1200, 580)  # the curves add 3 inches at 100 dpi
    assert _rgb("#3182bd") in _colours(output)


def test_logging_hook_metrics_in_the_trail_give_loss_and_learning_rate_curves(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trainfsm.hooks.logging_hook import LoggingHook
    from trainfsm.tools.plot import plot

    trainer = run(tmp_path / "run", steps=6, interval=3, hooks=[LoggingHook(interval=2)])
    metrics = [e for e in read_lines(trail(tmp_path / "run")) if e["event"] == "metrics"]
    assert [e["step"] for e in metrics] == [2, 4, 6]
    values = metrics[-1]["values"]
    assert values["train/lr/group_0"] == trainer.lr and values["train/loss"] > 0  # LoggingHook's keys, joined
    result = plot([tmp_path / "run"], tmp_path / "run.png")
    assert "loss" in result.metrics and "lr/group_0" in result.metrics
    assert _png_size(tmp_path / "run.png") == (1200, 580)


def test_plot_names_the_extra_when_matplotlib_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, steps=2, interval=1)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    code, _, err = cli(capsys, "plot", tmp_path, "-o", tmp_path / "run.png")
    assert code == 1
    assert "pip install 'trainfsm[plot]'" in err
    assert not (tmp_path / "run.png").exists()


def test_plot_of_an_unreadable_trail_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "plot", tmp_path / "missing", "-o", tmp_path / "run.png")
    assert code == 2 and "no such file or directory" in err


def test_the_commands_import_no_plotting_library_until_they_plot() -> None:
    code = (
        "import sys, trainfsm, trainfsm.tools.cli, trainfsm.tools.audit, trainfsm.tools.trace, trainfsm.tools.plot, "
        "trainfsm.tools.inspect_checkpoint; print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_compact_routine_steps_give_the_same_spans_as_every_transition(tmp_path: Path) -> None:
    from trainfsm.tools.plot import collect

    run(tmp_path / "compact", steps=8, interval=4, gradient_accumulation_steps=2)
    run(tmp_path / "full", steps=8, interval=4, gradient_accumulation_steps=2, trail_form="full")
    compact, _ = collect([tmp_path / "compact"])
    full, _ = collect([tmp_path / "full"])
    states = [span[2] for span in compact.spans[0]]
    assert states == [span[2] for span in full.spans[0]]
    assert states.count("ACCUMULATE") == 8 and states.count("CHECKPOINT") == 2


class SlowStep(TinyTrainer):
    """Its forward sleeps 1.5 s in step 3: with ``stall_timeout=0.5`` the watchdog reports a stall
    (at 0.5 s and 1 s), then clears it when the step ends."""

    def forward(self, input: Any) -> Any:
        if self.step == 3:
            time.sleep(1.5)
        return super().forward(input)


def _stalled_run(workspace: Path) -> list[dict[str, Any]]:
    """A real run with a stall in ACCUMULATE at step 3; its trail's lines as written."""
    SlowStep(max_steps=5, workspace=workspace, hooks=[CheckpointingHook(interval=100)], stall_timeout=0.5).train()
    return read_lines(trail(workspace))


def _stall_rectangles(figure: Any) -> list[Any]:
    return [patch for patch in figure.axes[0].patches if patch.get_gid() == STALL_GID]


def _legend(figure: Any) -> list[str]:
    return [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_plot_shades_a_stall_from_the_last_transition_to_its_clearing(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trainfsm.tools.plot import collect, draw, plot

    lines = _stalled_run(tmp_path / "run")
    first = next(e for e in lines if e["event"] == "stall" and e["state"] == "ACCUMULATE" and e["report"] == 1)
    cleared = next(e for e in lines if e["event"] == "stall_cleared" and e["stalled_state"] == "ACCUMULATE")
    start = first["ts"] - first["seconds"]  # the rank's last transition, as the watchdog saw it
    end = start + cleared["seconds"]
    # the watchdog's times agree with the step's: it began with step 3's ACCUMULATE, ended after it
    step3 = [e for e in trail_events(tmp_path / "run") if e["event"] == "transition" and e["step"] == 3]
    assert step3[0]["dest"] == "ACCUMULATE" and step3[-1]["source"] == "ACCUMULATE"
    assert step3[0]["ts"] - 0.01 <= start <= step3[0]["ts"] + 0.5
    assert end >= step3[-1]["ts"] - 0.01 and end - start >= 1.0

    timeline, _ = collect([tmp_path / "run"])
    figure = draw(timeline)
    t0 = min(e["ts"] for e in lines)  # the time axis: seconds since the first event
    drawn = {text.get_text(): text.xy for text in figure.axes[0].texts}
    assert drawn["stall rank 0 (ACCUMULATE, step 3)"][0] == pytest.approx(start - t0)
    rectangles = {round(r.get_x(), 6): r for r in _stall_rectangles(figure)}
    rectangle = rectangles[round(start - t0, 6)]
    assert rectangle.get_width() == pytest.approx(end - start)
    assert (rectangle.get_y(), rectangle.get_height()) == pytest.approx((-0.45, 0.9))  # over rank 0's band
    # every stall of the trail is drawn (BUILD may stall too, importing on a loaded machine), once in the legend
    assert len(rectangles) == len([e for e in lines if e["event"] == "stall" and e["report"] == 1])
    assert _legend(figure).count("stall") == 1
    result = plot([tmp_path / "run"], tmp_path / "run.png")
    assert _png_size(tmp_path / "run.png") == (result.width, result.height)


def test_a_stall_never_cleared_lasts_until_the_watchdog_ends_the_process(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trainfsm.tools.plot import collect, draw

    lines = _stalled_run(tmp_path / "real")
    # stall_action="exit": the trail ends after the watchdog's exit, written while the step hangs
    last = max(i for i, e in enumerate(lines) if e["event"] == "stall" and e["state"] == "ACCUMULATE")
    stall = next(e for e in lines if e["event"] == "stall" and e["state"] == "ACCUMULATE")
    ended = {**lines[last], "event": "exit", "ts": lines[last]["ts"] + 0.2, "reason": "stalled", "code": 75}
    for key in ("micro", "seconds", "budget", "report", "action", "doing", "collective", "hook", "stack"):
        ended.pop(key)
    path = write_lines(tmp_path / "run" / "logs" / "events.rank0.jsonl", [*lines[: last + 1], ended])

    timeline, _ = collect([path])
    figure = draw(timeline)
    t0 = min(e["ts"] for e in lines)
    rectangle = max(_stall_rectangles(figure), key=lambda r: r.get_x())
    assert rectangle.get_x() == pytest.approx(stall["ts"] - stall["seconds"] - t0)
    assert rectangle.get_x() + rectangle.get_width() == pytest.approx(ended["ts"] - t0)  # the attempt's end
    handles, labels = figure.axes[0].get_legend_handles_labels()
    marker = handles[labels.index("exit: stalled")]
    assert [tuple(xy) for xy in marker.get_offsets()] == [pytest.approx((ended["ts"] - t0, 0.0))]
    assert "exit: stalled" in _legend(figure)


def test_a_run_without_stalls_draws_no_stall_span(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trainfsm.tools.plot import collect, draw

    run(tmp_path, steps=4, interval=2)  # stall_timeout="auto": minutes of budget, nothing reported
    timeline, _ = collect([tmp_path])
    figure = draw(timeline)
    assert timeline.stalls == [] and _stall_rectangles(figure) == []
    assert not [text for text in figure.axes[0].texts if text.get_text().startswith("stall")]
    assert "stall" not in _legend(figure) and "exit: stalled" not in _legend(figure)
