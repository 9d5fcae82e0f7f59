"""Real processes, real SIGKILLs: resume is exact and never uses a partial checkpoint.

``tests/faults/kill_resume.py --trials N`` runs the same for any N.
"""

from __future__ import annotations

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
def test_sigterm_sigusr1_sigint_at_random_moments_checkpoint_at_the_agreed_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    passed, failed, sent = signal_resume.run_trials(trials=7, signals=3, seed=20261122, slow=0.03)
    output = capsys.readouterr().out
    assert failed == 0, output
    assert passed == 7
    assert sent >= 20, f"only {sent} signals were sent\n{output}"
