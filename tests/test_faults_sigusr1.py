"""SIGUSR1 at any moment of train() (the path SIGTERM takes, ``tests/test_faults.py``): its full
count of trials, in ``make test-all`` only, in a module of its own so that it runs beside SIGTERM's.
"""

from __future__ import annotations

import signal
import sys

import pytest

from tests.test_faults import SIGNAL_TRIALS, signal_trials

pytestmark = [pytest.mark.faults, pytest.mark.slow]


@pytest.mark.skipif(sys.platform != "linux", reason="signal fault trials run on Linux")
def test_sigusr1_at_any_moment_of_train_preempts_or_checkpoints_at_the_agreed_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    signal_trials(capsys, signal.SIGUSR1, SIGNAL_TRIALS)
