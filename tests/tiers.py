"""The tiers of the suite: ``make test`` (fast, on CPU: ``-m "not slow and not cuda"``), ``make test-all``
(everything), and ``make test-gpu`` (``-m cuda``: what needs a GPU, run whenever one is available).

A test marked ``slow`` runs in ``make test-all`` only. A fault trial whose count is what makes it slow
runs in both tiers, with a smaller count in the fast one::

    @trial_counts(fast=1, full=7)
    def test_sigkill_at_random_moments(trials: int) -> None:
        passed, failed, kills = kill_resume.run_trials(trials=trials, ...)

parametrizes ``trials`` twice: ``[1 trial]`` and ``[7 trials]`` (marked ``slow``). ``make test``
deselects the ``slow`` one; when both are selected (``make test-all``, ``pytest FILE``),
``tests/conftest.py`` deselects the fast twin, as its trials are the first of the full count's.
So each kind of fault is tried in the fast tier, and the full count runs once in the full suite.

A test marked ``cuda`` needs a CUDA device; without one it is skipped with the reason
``CUDA_SKIP_REASON`` (``tests/conftest.py`` marks it at collection, so its fixtures never run), unless
``TRAINFSM_REQUIRE_CUDA`` is set (``scripts/gpu-check.sh`` on a GPU machine), where a missing CUDA is
an error rather than a tier of skips. A test that runs on both devices takes ``DEVICES``::

    @pytest.mark.parametrize("device", DEVICES)
    def test_bf16_autocast(device: str) -> None: ...

whose ``cuda`` case is marked ``cuda``: ``make test`` runs the CPU case, ``make test-gpu`` the other.
"""

from __future__ import annotations

import pytest

#: The marker a fast twin carries (``tests/conftest.py`` looks for it).
FAST_TWIN = "fast_twin"
#: The marker of the GPU tier (``make test-gpu``).
CUDA = "cuda"
#: The two devices of a test that runs on both; CUDA's case is in the GPU tier.
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda, id="cuda"))


def cuda_skip_reason() -> str | None:
    """Why the ``cuda`` tests cannot run in this process, or None when they can. Asked once per
    session, at collection (``torch.cuda.is_available()``: no CUDA context is made)."""
    import torch

    if torch.cuda.is_available():
        return None
    built = torch.version.cuda
    why = f"this torch ({torch.__version__}) was built without CUDA" if built is None else "no CUDA device is visible"
    return f"needs a CUDA device: {why}; run `make test-gpu` (or scripts/gpu-check.sh) on a GPU machine"


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
