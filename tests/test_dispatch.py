"""One hook dispatcher (issue 32): every hook method is called from one place, at the places the
machine's table names, and the step-end decision is a pure function of what the step found."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import RecordingHook, TinyTrainer
from trainfsm import machine as fsm
from trainfsm.hooks.base import BaseHook
from trainfsm.machine import ExitReason

SRC = Path(__file__).resolve().parents[1] / "src" / "trainfsm"
#: The runtime: every module but the built-in hooks (a hook may call its base class's method)
#: and the offline tools.
RUNTIME = [p for p in SRC.rglob("*.py") if "tools" not in p.parts and (p.parent.name != "hooks" or p.name == "base.py")]
METHODS = sorted(name for name, value in vars(BaseHook).items() if callable(value) and not name.startswith("_"))


@pytest.mark.parametrize("method", METHODS)
def test_each_hook_method_has_exactly_one_call_site_in_the_runtime(method: str) -> None:
    call = re.compile(rf"\.{method}\(")
    sites = [
        f"{p.relative_to(SRC)}:{n}"
        for p in RUNTIME
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if call.search(line) and not line.lstrip().startswith("def ")
    ]
    assert len(sites) == 1, sites


def test_every_hook_method_is_known_to_the_dispatcher() -> None:
    assert (
        sorted(
            [
                "on_after_step",
                "on_after_train",
                "on_before_optimizer_step",
                "on_before_step",
                "on_before_train",
                "on_evaluate",
                "on_load_state_dict",
                "on_log",
                "on_log_images",
                "on_log_scalars",
                "on_state_dict",
                "on_step_info",
                "wants_checkpoint",
                "wants_stop",
            ]
        )
        == METHODS
    )


# ---------------------------------------------------------------- the step-end decision
@pytest.mark.parametrize(
    ("preempted", "stop", "last", "reason"),
    [
        (False, False, False, None),
        (False, False, True, ExitReason.COMPLETED),
        (False, True, False, ExitReason.STOPPED),
        (False, True, True, ExitReason.STOPPED),  # a hook's stop outranks the last step
        (True, False, False, ExitReason.PREEMPTED),
        (True, True, True, ExitReason.PREEMPTED),  # an agreed signal outranks everything
    ],
)
def test_the_exit_reason_after_a_step(preempted: bool, stop: bool, last: bool, reason: Any) -> None:
    assert fsm.step_end_reason(preempted=preempted, stop=stop, last=last) is reason


@pytest.mark.parametrize(
    ("reason", "save", "trigger"),
    [
        (None, False, "stepped"),
        (None, True, "save"),
        (ExitReason.COMPLETED, False, "finish"),
        (ExitReason.COMPLETED, True, "save"),  # CHECKPOINT first, then finish from there
        (ExitReason.PREEMPTED, True, "save"),
        (ExitReason.STOPPED, False, "finish"),
    ],
)
def test_the_trigger_that_leaves_accumulate(reason: Any, save: bool, trigger: str) -> None:
    assert fsm.step_end_trigger(reason, save=save) == trigger


def test_every_step_end_trigger_leaves_accumulate_and_checkpoints_leave_checkpoint() -> None:
    rows = set(fsm.transition_rows())
    triggers = {fsm.step_end_trigger(r, save=s) for r in (None, *ExitReason) for s in (False, True)}
    assert {(t, fsm.ACCUMULATE) for t in triggers} <= {(t, src) for t, src, _ in rows}
    assert {(fsm.checkpoint_trigger(r), fsm.CHECKPOINT) for r in (None, ExitReason.COMPLETED)} <= {
        (t, src) for t, src, _ in rows
    }


# ---------------------------------------------------------------- the table and a run agree
class StateRecorder(RecordingHook):
    """Also notes the machine's state at each call: the state a seed method ran in, and the next
    ``on_enter_<state>`` after it, give the transition it ran before."""

    def _rec(self, method: str, trainer: Any) -> None:
        self.log.append((method, trainer.state, trainer.step))


def _fired_before(tmp_path: Path, **flags: Any) -> dict[str, set[tuple[str, str]]]:
    """For each seed method: the (source, dest) of the transition that followed it."""
    log: list[Any] = []
    TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[StateRecorder(log, **flags)]).train()
    fired: dict[str, set[tuple[str, str]]] = {}
    for i, (method, state, _) in enumerate(log):
        if method.startswith(("on_enter_", "on_exit_")):
            continue
        dest = next(m.removeprefix("on_enter_").upper() for m, _, _ in log[i + 1 :] if m.startswith("on_enter_"))
        fired.setdefault(method, set()).add((state, dest))
    return fired


def test_a_run_calls_the_seed_methods_where_the_machines_table_says(tmp_path: Path) -> None:
    fired = _fired_before(tmp_path, checkpoint_at={2}, stop_at={3})
    rows = fsm.transition_rows()
    for method, targets in fsm.HOOKS_ON_TRANSITIONS.items():
        allowed = {
            (source, dest) for _, trigger, source in targets for t, s, dest in rows if (t, s) == (trigger, source)
        }
        assert fired[method] and fired[method] <= allowed, (method, fired[method], allowed)
    # on_after_step ran before a plain step, a save (step 2) and the stop (step 3): all three rows
    assert fired["on_after_step"] == {("ACCUMULATE", "STEP"), ("ACCUMULATE", "CHECKPOINT"), ("ACCUMULATE", "EXIT")}
    for method, (kind, state) in fsm.HOOKS_ON_STATES.items():  # state entries: they run in that state
        assert kind == "enter" and fired[method], method
        assert {s for s, _ in fired[method]} == {state}, (method, fired[method])
