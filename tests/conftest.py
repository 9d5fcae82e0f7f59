"""Shared fixtures; the trainer, hook and trail readers they use live in ``tests/helpers.py``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import TinyTrainer, read_events
from tests.tiers import CUDA, FAST_TWIN, cuda_skip_reason


@pytest.fixture
def make_trainer(tmp_path: Path) -> Callable[..., TinyTrainer]:
    """``make_trainer(**kwargs)``: a TinyTrainer writing its audit trail under ``tmp_path``."""

    def factory(**kwargs: Any) -> TinyTrainer:
        kwargs.setdefault("workspace", tmp_path)
        kwargs.setdefault("max_steps", 3)
        return TinyTrainer(**kwargs)

    return factory


@pytest.fixture
def events(tmp_path: Path) -> Callable[[], list[dict[str, Any]]]:
    """``events()``: the events written under ``tmp_path`` so far."""
    return lambda: read_events(tmp_path)


# ---------------------------------------------------------------- the tiers (tests/tiers.py) and xdist
#: The modules that take longest in `make test-all` (minutes each on 2 cores): sent to the workers
#: first, so that neither is left running one of them alone at the end.
LONGEST = (
    "tests/slurm/test_job_end.py",  # ~500 s on one worker in CI: first, or it ends the run alone
    "tests/slurm/",  # the other SLURM modules, one unit: ~500 s
    "tests/test_faults.py",
    "tests/test_two_nodes.py",
    "tests/test_faults_sigusr1.py",
    "tests/test_torchrun_preemption.py",
)
#: Markers of the kinds of tests that start processes: their modules come next.
HEAVY = ("slow", "slurm", "distributed", "faults", "docs")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    # Modules in the order the workers should take them (see `pytest_xdist_make_scheduler`), each
    # module's tests together and in their order, so a module-scoped fixture is built once.
    weight: dict[Path, tuple[int, int]] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        first = next((i for i, prefix in enumerate(LONGEST) if path.startswith(prefix)), len(LONGEST))
        kind = 0 if item.get_closest_marker("slow") else 1 if any(item.get_closest_marker(m) for m in HEAVY) else 2
        weight[item.path] = min(weight.get(item.path, (first, 2)), (first, kind))
    items.sort(key=lambda item: weight[item.path])  # stable
    yield
    _drop_fast_twins(config, items)  # after -m and -k have deselected what they deselect
    _skip_cuda_without_a_device(items)


def _skip_cuda_without_a_device(items: list[pytest.Item]) -> None:
    """Mark every selected ``cuda`` test skipped, with the reason, where CUDA is absent: its
    fixtures (a process group, a GPU model) are never set up. With ``TRAINFSM_REQUIRE_CUDA`` set
    (scripts/gpu-check.sh on a GPU machine) a missing CUDA fails the session instead: a GPU tier
    of skips would pass and check nothing."""
    cuda = [item for item in items if item.get_closest_marker(CUDA)]
    if not cuda:
        return
    reason = cuda_skip_reason()
    if reason is None:
        return
    if os.environ.get("TRAINFSM_REQUIRE_CUDA"):
        raise pytest.UsageError(f"TRAINFSM_REQUIRE_CUDA is set, but the cuda tests cannot run: {reason}")
    for item in cuda:
        item.add_marker(pytest.mark.skip(reason=reason))


def _drop_fast_twins(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the fast twin of a ``trial_counts`` test whose full count is selected too."""

    def key(item: pytest.Item) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        params = getattr(getattr(item, "callspec", None), "params", {})
        others = tuple(sorted((name, repr(value)) for name, value in params.items() if name != "trials"))
        return str(item.path), getattr(item, "originalname", item.name), others

    full = {key(item) for item in items if "trials" in item.fixturenames and item.get_closest_marker("slow")}
    twins = [item for item in items if item.get_closest_marker(FAST_TWIN) and key(item) in full]
    if twins:
        config.hook.pytest_deselected(items=twins)
        items[:] = [item for item in items if item not in twins]


#: SLURM modules run as a unit of their own, beside the other SLURM modules (a module of 8 minutes,
#: and the others' 9, were one unit on one worker: the full suite's longest path).
SLURM_APART = ("tests/slurm/test_job_end.py",)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest -p no:xdist runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n N --dist loadfile`` (``make test``, ``make test-all``): one module to one worker, as
    ``loadfile`` does (a module-scoped fixture, such as a reference run or the built docs site, is built
    once, not once per worker), with ``tests/slurm/`` as two units: ``SLURM_APART``, whose jobs mostly
    wait out SLURM's time limits, and the rest (one cluster serves both: ``tests/slurm/conftest.py``
    stops it when its last user ends; the partitions keep their jobs apart: the ``debug`` jobs of both
    units fit its 4 CPUs, the preemption trials' ``low``/``high`` jobs use CPUs of their own); and the
    modules taken in the order ``pytest_collection_modifyitems`` puts them in (longest first), not by
    number of tests."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in SLURM_APART or not path.startswith("tests/slurm/") else "tests/slurm/"

        def remove_node(self, node: Any) -> str | None:
            # A worker that crashed (pytest-timeout ends a hung test's worker) left its module's tests
            # to the next worker, the one it was running included: xdist's module scheduling would
            # run that test again on each new worker, a hang costing its timeout once per restart.
            # It is reported once, as crashed, and the next worker starts after it.
            crashed = None
            for unit in self.assigned_work.get(node, {}).values():
                crashed = next((nodeid for nodeid, done in unit.items() if not done), None)
                if crashed is not None:
                    unit[crashed] = True
                    break
            super().remove_node(node)
            return crashed

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """Say why a worker may have ended: the thread method of pytest-timeout ends the process of a test
    that runs past its timeout, and under xdist the stacks it prints are not shown."""
    timeout = sched.config.getoption("timeout", None)
    report.longrepr = (
        f"{report.longrepr}: it ran past the per-test timeout ({timeout} s; pytest-timeout ends the worker), "
        "or its process died (a crash, the OOM killer). Run it alone to see which: "
        f"pytest -p no:xdist {crashitem!r}"
    )
