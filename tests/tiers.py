"""The two tiers of the suite: ``make test`` (fast: ``-m "not slow"``) and ``make test-all`` (everything).

A test marked ``slow`` runs in ``make test-all`` only. A fault trial whose count is what makes it slow
runs in both tiers, with a smaller count in the fast one::

    @trial_counts(fast=1, full=7)
    def test_sigkill_at_random_moments(trials: int) -> None:
        passed, failed, kills = kill_resume.run_trials(trials=trials, ...)

parametrizes ``trials`` twice: ``[1 trial]`` and ``[7 trials]`` (marked ``slow``). ``make test``
deselects the ``slow`` one; when both are selected (``make test-all``, ``pytest FILE``),
``tests/conftest.py`` deselects the fast twin, as its trials are the first of the full count's.
So each kind of fault is tried in the fast tier, and the full count runs once in the full suite.
"""

from __future__ import annotations

import pytest

#: The marker a fast twin carries (``tests/conftest.py`` looks for it).
FAST_TWIN = "fast_twin"


def trial_counts(fast: int, full: int) -> pytest.MarkDecorator:
    """Parametrize the test's ``trials`` argument: ``fast`` in ``make test``, ``full`` in ``make test-all``."""
    if not 0 < fast < full:
        raise ValueError(f"trial_counts(fast={fast}, full={full}): the fast count must be at least 1 and below full")
    return pytest.mark.parametrize(
        "trials",
        [
            pytest.param(fast, marks=getattr(pytest.mark, FAST_TWIN), id=f"{fast} trial{'s' * (fast > 1)}"),
            pytest.param(full, marks=pytest.mark.slow, id=f"{full} trials"),
        ],
    )
