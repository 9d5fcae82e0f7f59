"""The transition table as data, and compiled dispatch against plain ``transitions`` dispatch."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import transitions
from hypothesis import given, settings
from hypothesis import strategies as st
from transitions import MachineError

from trainfsm import STATES, TRANSITIONS
from trainfsm import machine as fsm

ROWS = fsm.transition_rows()
VALID = {(trigger, source) for trigger, source, _ in ROWS}
INVALID = [(trigger, state) for state in STATES for trigger in fsm.TRIGGERS if (trigger, state) not in VALID]


class Model:
    """A bare machine model that records every callback with the state it ran in."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []


def recorder(model: Model, *label: str) -> Callable[[], None]:
    def record() -> None:
        model.calls.append((*label, model.state))  # type: ignore[attr-defined]

    return record


def instrumented(variant: str) -> tuple[Model, transitions.Machine]:
    """A machine over a recording model, with a callback on every state's enter/exit and every
    transition's prepare/before/after; ``variant`` picks compiled or plain dispatch."""
    model = Model()
    machine_cls = transitions.Machine if variant == "transitions.Machine" else fsm.TrainMachine
    machine = fsm.build_machine(model, machine_cls=machine_cls)
    for state in STATES:
        for kind in ("enter", "exit"):
            fsm.bind(machine, kind, state, recorder(model, kind, state))
    for trigger, source, _ in ROWS:
        for kind in ("prepare", "before", "after"):
            fsm.bind(machine, kind, (trigger, source), recorder(model, kind, trigger, source))
    if variant == "compiled":
        machine.compile_events(model, lambda t, s, d: recorder(model, "announce", t, s, d))
    return model, machine


VARIANTS = ("compiled", "TrainMachine uncompiled", "transitions.Machine")


def fire(model: Model, trigger: str) -> Any:
    return getattr(model, trigger)()


def without_announce(calls: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [c for c in calls if c[0] != "announce"]


def path_to(state: str) -> list[str]:
    """The shortest trigger sequence from BUILD to ``state``."""
    queue: deque[tuple[str, list[str]]] = deque([(fsm.BUILD, [])])
    seen = {fsm.BUILD}
    while queue:
        current, path = queue.popleft()
        if current == state:
            return path
        for trigger, source, dest in ROWS:
            if source == current and dest not in seen:
                seen.add(dest)
                queue.append((dest, [*path, trigger]))
    raise AssertionError(f"{state} is unreachable")


# ---------------------------------------------------------------- the table
def test_states_are_the_designed_ones():
    assert STATES == ("BUILD", "RESTORE", "STEP", "ACCUMULATE", "RETRY", "CHECKPOINT", "EXIT")


def test_triggers_are_the_designed_ones():
    assert fsm.TRIGGERS == (
        "built",
        "restored",
        "micro",
        "non_finite",
        "oom",
        "retry",
        "stepped",
        "save",
        "resume",
        "exhausted",
        "finish",
        "preempt",
        "fail",
    )


def test_each_trigger_has_one_row_per_source():
    assert len(ROWS) == len(VALID)
    assert len(fsm.TRIGGERS) == len(set(fsm.TRIGGERS))


def test_nothing_leaves_exit():
    assert [row for row in ROWS if row[1] == fsm.EXIT] == []


def test_every_state_is_reachable_and_can_reach_exit():
    for state in STATES:
        path_to(state)
    for state in STATES:
        if state == fsm.EXIT:
            continue
        assert ("fail", state, fsm.EXIT) in ROWS or state == fsm.EXIT


def test_table_rows_are_the_designed_transitions():
    assert {(t, s, d) for t, s, d in ROWS} >= {
        ("built", "BUILD", "RESTORE"),
        ("restored", "RESTORE", "STEP"),
        ("micro", "STEP", "ACCUMULATE"),
        ("micro", "ACCUMULATE", "ACCUMULATE"),
        ("non_finite", "ACCUMULATE", "RETRY"),
        ("retry", "RETRY", "ACCUMULATE"),
        ("stepped", "ACCUMULATE", "STEP"),
        ("save", "ACCUMULATE", "CHECKPOINT"),
        ("resume", "CHECKPOINT", "STEP"),
        ("finish", "ACCUMULATE", "EXIT"),
        ("finish", "CHECKPOINT", "EXIT"),
        ("preempt", "BUILD", "EXIT"),
        ("preempt", "RESTORE", "EXIT"),
    }
    assert {s for t, s, d in ROWS if t == "fail"} == set(STATES) - {fsm.EXIT}
    assert all(d == fsm.EXIT for t, s, d in ROWS if t in ("fail", "preempt", "finish"))


def test_transition_rows_flatten_the_table_in_declaration_order():
    assert [(t, s, d) for t, sources, d in TRANSITIONS for s in sources] == ROWS


def test_seed_hooks_are_bound_to_rows_and_states_of_the_table():
    for bindings in fsm.HOOKS_ON_TRANSITIONS.values():
        for kind, trigger, source in bindings:
            assert kind in ("prepare", "before", "after")
            assert (trigger, source) in VALID
    assert fsm.HOOKS_ON_STATES == {"on_before_step": ("enter", "STEP"), "on_after_train": ("enter", "EXIT")}


def test_state_hook_names_cover_enter_and_exit_of_every_state():
    names = fsm.state_hook_names()
    assert len(names) == 2 * len(STATES)
    assert names[:2] == [("on_enter_build", "enter", "BUILD"), ("on_exit_build", "exit", "BUILD")]
    assert ("on_enter_checkpoint", "enter", "CHECKPOINT") in names


def test_build_machine_refuses_a_model_shadowing_triggers():
    class Shadow:
        def save(self) -> None: ...

        state = "mine"

    with pytest.raises(TypeError, match=r"^Shadow defines 'save', 'state', which .* rename them \(reserved: built, "):
        fsm.build_machine(Shadow())


def test_build_machine_starts_in_build():
    model = Model()
    fsm.build_machine(model)
    assert model.state == fsm.BUILD  # type: ignore[attr-defined]


# ---------------------------------------------------------------- compiled dispatch
@pytest.mark.parametrize(("trigger", "source", "dest"), ROWS, ids=[f"{t}:{s}" for t, s, _ in ROWS])
def test_every_row_dispatches_identically_compiled_and_not(trigger, source, dest):
    results = {}
    for variant in VARIANTS:
        model, _ = instrumented(variant)
        for step in path_to(source):
            fire(model, step)
        model.calls.clear()
        assert fire(model, trigger) is True
        assert model.state == dest  # type: ignore[attr-defined]
        results[variant] = model.calls
    assert results["compiled"] == [
        ("prepare", trigger, source, source),
        ("before", trigger, source, source),
        ("exit", source, source),
        ("announce", trigger, source, dest, dest),
        ("enter", dest, dest),
        ("after", trigger, source, dest),
    ]
    plain = without_announce(results["compiled"])
    assert results["TrainMachine uncompiled"] == plain
    assert results["transitions.Machine"] == plain


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(choices=st.lists(st.integers(min_value=0, max_value=100), max_size=30))
def test_random_trigger_sequences_give_identical_callback_order(choices):
    machines = {variant: instrumented(variant)[0] for variant in VARIANTS}
    state = fsm.BUILD
    fired = []
    for choice in choices:
        options = [trigger for trigger, source, _ in ROWS if source == state]
        if not options:  # EXIT
            break
        trigger = options[choice % len(options)]
        fired.append(trigger)
        for model in machines.values():
            fire(model, trigger)
        state = machines["compiled"].state  # type: ignore[attr-defined]
    for model in machines.values():
        assert model.state == state  # type: ignore[attr-defined]
    compiled = machines["compiled"].calls
    assert len([c for c in compiled if c[0] == "announce"]) == len(fired)
    assert machines["TrainMachine uncompiled"].calls == without_announce(compiled)
    assert machines["transitions.Machine"].calls == without_announce(compiled)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("trigger", "state"), INVALID, ids=[f"{t}:{s}" for t, s in INVALID])
def test_invalid_trigger_raises_machine_error_naming_trigger_and_state(variant, trigger, state):
    model, _ = instrumented(variant)
    for step in path_to(state):
        fire(model, step)
    model.calls.clear()
    with pytest.raises(MachineError) as info:
        fire(model, trigger)
    assert f"Can't trigger event {trigger} from state {state}!" in str(info.value)
    assert model.state == state  # type: ignore[attr-defined]
    assert model.calls == []


def test_compiled_machine_keeps_dispatching_after_an_invalid_trigger():
    model, _ = instrumented("compiled")
    with pytest.raises(MachineError):
        fire(model, "stepped")
    fire(model, "built")
    assert model.state == fsm.RESTORE  # type: ignore[attr-defined]


def test_compiled_event_propagates_a_callback_exception_after_the_state_changed():
    model, machine = Model(), None
    machine = fsm.build_machine(model)

    def boom() -> None:
        raise ValueError("enter failed")

    fsm.bind(machine, "enter", fsm.RESTORE, boom)
    machine.compile_events(model, lambda t, s, d: lambda: None)
    with pytest.raises(ValueError, match="enter failed"):
        fire(model, "built")
    assert model.state == fsm.RESTORE  # type: ignore[attr-defined]


def test_compile_refuses_machine_wide_callbacks():
    model = Model()
    machine = fsm.build_machine(model)
    machine.prepare_event = [lambda: None]
    with pytest.raises(TypeError, match=r"^CompiledEvent supports machines without machine-wide callbacks$"):
        machine.compile_events(model, lambda t, s, d: lambda: None)


def test_compile_refuses_conditions():
    model = Model()
    machine = fsm.build_machine(model)
    (transition,) = machine.events["built"].transitions[fsm.BUILD]
    transition.conditions.append(transitions.core.Condition(lambda: True))
    with pytest.raises(TypeError, match=r"^transition 'built' from 'BUILD' (is internal or )?has conditions$"):
        machine.compile_events(model, lambda t, s, d: lambda: None)


def test_compile_refuses_string_callbacks():
    model = Model()
    machine = fsm.build_machine(model)
    fsm.bind(machine, "before", ("micro", fsm.STEP), "some_method_name")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^transition 'micro' from 'STEP' has a non-callable callback$"):
        machine.compile_events(model, lambda t, s, d: lambda: None)
