"""Real processes, real SIGKILLs: resume is exact and never uses a partial checkpoint.

``tests/faults/kill_resume.py --trials N`` runs the same for any N.
"""

from __future__ import annotations

import signal
import sys

import pytest

from tests.faults import kill_resume, signal_resume


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL fault trials run on Linux")
def test_sigkill_at_random_moments_then_resume_is_bitwise_exact(capsys: pytest.CaptureFixture[str]) -> None:
    passed, failed, kills = kill_resume.run_trials(trials=7, kills=3, seed=20261122, slow=0.03)
    output = capsys.readouterr().out
    assert failed == 0, output
    assert passed == 7
    assert kills >= 20, f"only {kills} kills landed while the process was alive\n{output}"


@pytest.mark.skipif(sys.platform != "linux", reason="signal fault trials run on Linux")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_at_any_moment_of_train_preempts_or_checkpoints_at_the_agreed_step(
    capsys: pytest.CaptureFixture[str], sig: signal.Signals
) -> None:
    """At least 20 signals per signal, drawn over the whole life of train() (BUILD included). 8
    trials of up to 3 signals: a signal that lands once training is complete ends its trial early."""
    passed, failed, sent = signal_resume.run_trials(trials=8, signals=3, seed=20261124 + sig, slow=0.03, names=(sig,))
    output = capsys.readouterr().out
    assert failed == 0, output
    assert passed == 8
    assert sent >= 20, f"only {sent} signals were sent\n{output}"
    assert "BUILD" in output and "training" in output, f"no signal landed in BUILD or in training\n{output}"


@pytest.mark.skipif(sys.platform != "linux", reason="signal fault trials run on Linux")
def test_sigint_at_random_moments_is_a_preemption_once_named_and_a_keyboard_interrupt_before(
    capsys: pytest.CaptureFixture[str],
) -> None:
    passed, failed, _ = signal_resume.run_trials(trials=3, signals=3, seed=20261122, slow=0.03, names=(signal.SIGINT,))
    output = capsys.readouterr().out
    assert failed == 0, output
    assert passed == 3
