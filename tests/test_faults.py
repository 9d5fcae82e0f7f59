"""Real processes, real SIGKILLs: resume is exact and never uses a partial checkpoint.

``tests/faults/kill_resume.py --trials N`` runs the same for any N.
"""

from __future__ import annotations

import signal
import sys

import pytest

from tests.faults import kill_resume, signal_resume
from tests.tiers import trial_counts

pytestmark = pytest.mark.faults


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL fault trials run on Linux")
@trial_counts(fast=1, full=7)
def test_sigkill_at_random_moments_then_resume_is_bitwise_exact(
    capsys: pytest.CaptureFixture[str], trials: int
) -> None:
    # 3 kills a trial; a kill drawn after the run finished is not sent, so the full count runs
    # further trials (at most 10 in all) until 20 kills landed.
    full = trials > 1
    passed, failed, kills = kill_resume.run_trials(
        trials=trials, kills=3, seed=20261122, slow=0.03, at_least=20 if full else 0, most=10
    )
    output = capsys.readouterr().out
    assert failed == 0, output
    assert passed >= trials
    assert kills >= (20 if full else 2), f"only {kills} kills landed while the process was alive\n{output}"


SIGNAL_TRIALS = 8


@pytest.mark.skipif(sys.platform != "linux", reason="signal fault trials run on Linux")
@trial_counts(fast=1, full=SIGNAL_TRIALS)
def test_a_signal_at_any_moment_of_train_preempts_or_checkpoints_at_the_agreed_step(
    capsys: pytest.CaptureFixture[str], trials: int
) -> None:
    """SIGTERM; SIGUSR1 in ``tests/test_faults_sigusr1.py`` (a module of its own, so that the
    full tier's two longest trial series run side by side)."""
    signal_trials(capsys, signal.SIGTERM, trials)


def signal_trials(capsys: pytest.CaptureFixture[str], sig: signal.Signals, trials: int) -> None:
    """At least 20 signals per signal, drawn over the whole life of train() (BUILD included). 8
    trials of up to 3 signals: a signal that lands once training is complete ends its trial early,
    and one drawn after the process ended is not sent, so the full count runs further trials (at
    most 12 in all) until 20 were sent. (The fast tier's one trial checks its own signals; where
    they land over all of train() is the full count's to check.)"""
    full = trials == SIGNAL_TRIALS
    passed, failed, sent = signal_resume.run_trials(
        trials=trials, signals=3, seed=20261124 + sig, slow=0.03, names=(sig,), at_least=20 if full else 0, most=12
    )
    output = capsys.readouterr().out
    assert failed == 0, output
    assert passed >= trials
    if full:
        assert sent >= 20, f"only {sent} signals were sent\n{output}"
        assert "BUILD" in output and "training" in output, f"no signal landed in BUILD or in training\n{output}"


@pytest.mark.skipif(sys.platform != "linux", reason="signal fault trials run on Linux")
@trial_counts(fast=1, full=3)
def test_sigint_at_random_moments_is_a_preemption_once_named_and_a_keyboard_interrupt_before(
    capsys: pytest.CaptureFixture[str], trials: int
) -> None:
    passed, failed, _ = signal_resume.run_trials(
        trials=trials, signals=3, seed=20261122, slow=0.03, names=(signal.SIGINT,)
    )
    output = capsys.readouterr().out
    assert failed == 0, output
    assert passed == trials
