"""Exit signals from the first line of train() to its last: real processes, real signals.

The checkpoint hook's policy (``exit_signals``) is known only once ``build_hooks()`` returned; a
signal before that is held and then acted on (named) or passed on to its old disposition (not
named). ``tests/faults/early_signal.py`` is the training script; it is made slow in one place.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import audit_problems
from tests.faults.early_signal import HERE as SCRIPT
from tests.faults.signal_burst import HERE as BURST
from tests.helpers import ignored_here, trail_events

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="real signals to child processes"), pytest.mark.faults]

STEPS = 8


def launch(workspace: Path, *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(SCRIPT), "--workspace", str(workspace), "--out", str(workspace / "final.pt")]
    return subprocess.Popen([*command, "--steps", str(STEPS), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen[bytes]) -> tuple[int, str]:
    _, err = process.communicate(timeout=120)
    return process.returncode, err.decode()


def signal_in(workspace: Path, place: str, sig: signal.Signals, *args: str) -> tuple[int, str]:
    """Launch slow in ``place``, send ``sig`` as soon as the process is there; (exit code, stderr)."""
    marker = workspace.parent / f"{workspace.name}.marker"
    marker.unlink(missing_ok=True)
    process = launch(workspace, "--slow-in", place, "--marker", str(marker), *args)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert process.poll() is None, finish(process)
        assert time.monotonic() < deadline, f"the script never reached {place}"
        time.sleep(0.01)
    process.send_signal(sig)
    return finish(process)


def events(workspace: Path) -> list[dict[str, Any]]:
    return trail_events(workspace)


def outline(trail: list[dict[str, Any]]) -> list[str]:
    names = []
    for e in trail:
        if e["event"] == "transition":
            names.append(f"{e['trigger']}:{e['source']}>{e['dest']}")
        elif e["event"] in ("signal_received", "signal_passed_on"):
            names.append(f"{e['event']}:{e['signal']}")
        elif e["event"] in ("checkpoint_saved", "checkpoint_loaded", "exit"):
            names.append(e["event"] + (f":{e['reason']}:{e['code']}" if e["event"] == "exit" else ""))
    return names


def parameters(workspace: Path) -> list[torch.Tensor]:
    return torch.load(workspace / "final.pt")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """The uninterrupted run's final parameters."""
    workspace = tmp_path_factory.mktemp("straight")
    code, err = finish(launch(workspace))
    assert code == 0, err
    return parameters(workspace)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("place", "sig"),
    [
        pytest.param("build_data_loader", signal.SIGUSR1, marks=pytest.mark.slow),
        pytest.param("build_model", signal.SIGUSR1, marks=pytest.mark.slow),
        ("build_model", signal.SIGTERM),
        pytest.param("build_optimizer", signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param("build_hooks", signal.SIGUSR1, marks=pytest.mark.slow),
    ],
)
def test_a_signal_in_build_preempts_saves_nothing_and_the_next_launch_starts_fresh(
    tmp_path: Path, straight: list[torch.Tensor], place: str, sig: signal.Signals
) -> None:
    workspace = tmp_path / "run"
    code, err = signal_in(workspace, place, sig)
    assert code == 128 + sig, err
    trail = events(workspace)
    assert outline(trail) == [f"signal_received:{sig.name}", "preempt:BUILD>EXIT", f"exit:preempted:{128 + sig}"]
    received = next(e for e in trail if e["event"] == "signal_received")
    assert (received["at_state"], received["at_step"]) == ("BUILD", 0)
    assert not (workspace / "checkpoints").exists() or not list((workspace / "checkpoints").iterdir())

    code, err = finish(launch(workspace))
    assert code == 0, err
    second = [e for e in events(workspace) if e["attempt"] == 1]
    assert next(e for e in second if e["event"] == "restore")["resumed"] is False
    assert_same(parameters(workspace), straight)
    assert audit_problems(workspace) == []  # trainfsm audit accepts a preemption in BUILD


@pytest.mark.parametrize("sig", [signal.SIGUSR1, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_during_a_slow_checkpoint_load_preempts_from_restore_and_the_next_launch_resumes(
    tmp_path: Path, straight: list[torch.Tensor], sig: signal.Signals
) -> None:
    workspace = tmp_path / "run"
    code, err = finish(launch(workspace, "--steps", "4"))  # a first launch: 4 of the 8 steps, checkpoint 4
    assert code == 0, err

    code, err = signal_in(workspace, "load", sig)
    assert code == 128 + sig, err
    trail = [e for e in events(workspace) if e["attempt"] == 1]
    assert outline(trail) == [
        "built:BUILD>RESTORE",
        "checkpoint_loaded",
        f"signal_received:{sig.name}",
        "preempt:RESTORE>EXIT",
        f"exit:preempted:{128 + sig}",
    ]
    received = next(e for e in trail if e["event"] == "signal_received")
    assert received["at_state"] == "RESTORE"
    assert sorted(p.name for p in (workspace / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]

    code, err = finish(launch(workspace))
    assert code == 0, err
    resumed = [e for e in events(workspace) if e["attempt"] == 2]
    assert next(e for e in resumed if e["event"] == "checkpoint_loaded")["from_step"] == 4
    assert_same(parameters(workspace), straight)
    assert audit_problems(workspace) == []  # and one in RESTORE


def test_a_signal_no_policy_names_kills_the_process_as_its_default_action_would(tmp_path: Path) -> None:
    workspace = tmp_path / "run"
    code, err = signal_in(workspace, "build_model", signal.SIGTERM, "--exit-signals", "USR1")
    assert code == -signal.SIGTERM, err  # killed by the signal, as without trainfsm
    trail = events(workspace)
    assert trail[-1]["event"] == "signal_passed_on"
    assert (trail[-1]["signal"], trail[-1]["disposition"], trail[-1]["at_state"]) == ("SIGTERM", "default", "BUILD")
    assert not any(e["event"] in ("signal_received", "exit") for e in trail)


@pytest.mark.slow
def test_a_signal_no_policy_names_runs_the_users_own_handler_and_training_goes_on(
    tmp_path: Path, straight: list[torch.Tensor]
) -> None:
    workspace = tmp_path / "run"
    code, err = signal_in(workspace, "build_optimizer", signal.SIGUSR2, "--user-handler", "USR2")
    assert code == 0, err
    assert (tmp_path / "run.marker.handled").read_text() == str(int(signal.SIGUSR2))
    trail = events(workspace)
    passed = next(e for e in trail if e["event"] == "signal_passed_on")
    assert (passed["signal"], passed["disposition"]) == ("SIGUSR2", "handler")
    assert trail[-1]["event"] == "exit" and trail[-1]["reason"] == "completed"
    assert_same(parameters(workspace), straight)


@pytest.mark.slow
def test_a_signal_ignored_before_train_stays_ignored_and_run_start_says_so(
    tmp_path: Path, straight: list[torch.Tensor]
) -> None:
    workspace = tmp_path / "run"
    code, err = signal_in(workspace, "build_model", signal.SIGUSR2, "--ignore", "USR2")
    assert code == 0, err
    trail = events(workspace)
    assert trail[0]["event"] == "run_start" and trail[0]["signals"]["ignored"] == ignored_here(signal.SIGUSR2)
    passed = next(e for e in trail if e["event"] == "signal_passed_on")
    assert (passed["signal"], passed["disposition"]) == ("SIGUSR2", "ignored")
    assert_same(parameters(workspace), straight)


def test_a_named_signal_ignored_before_train_is_still_handled(tmp_path: Path) -> None:
    workspace = tmp_path / "run"
    code, err = signal_in(workspace, "build_hooks", signal.SIGTERM, "--ignore", "TERM")
    assert code == 128 + signal.SIGTERM, err
    trail = events(workspace)
    assert trail[0]["signals"]["ignored"] == ignored_here(signal.SIGTERM)
    assert outline(trail)[-2:] == ["preempt:BUILD>EXIT", "exit:preempted:143"]


@pytest.mark.parametrize("at", ["handler", "sleep"])
def test_a_signal_at_every_instant_of_the_handler_or_of_exit_wait_ends_the_process_at_once(at: str) -> None:
    """A second signal inside the first one's handler, or a signal while the main thread is inside
    ``exit_wait``'s sleep: the handler takes no lock either could hold, so nothing deadlocks, each
    signal is recorded, and the sleep (30 s) is cut short. ``tests/faults/signal_burst.py``."""
    command = [sys.executable, str(BURST), "--at", at, "--sleep", "30"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as exc:
        hint = "a lock in the handler, or a sleep that the signals do not wake"
        pytest.fail(f"no exit within 20 s with a signal at every instant of the {at} ({hint}): {exc}")
    assert done.returncode == 128 + signal.SIGUSR1, done.stderr
    seen = json.loads(done.stdout)
    assert seen["sent"] > 5  # the burst reached its place
    assert seen["received"] == 1 + seen["sent"]  # the first signal and every one of the burst, none lost
    assert seen["slept"] < 5
