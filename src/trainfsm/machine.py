"""The training loop's state machine: states, transitions and hook bindings, as data.

This table is the single source of truth. ``BaseTrainer.train()`` runs it, ``trainfsm diagram``
draws it, and the audit tooling replays logs against it.

Which hook method fires where (every hook may also define ``on_enter_<state>`` /
``on_exit_<state>`` for any state, e.g. ``on_enter_checkpoint``):

====================== ==============================================================================
hook method            fires
====================== ==============================================================================
on_before_train        leaving RESTORE by ``restored`` (or ``finish`` when the checkpoint is already
                       at ``max_steps``): once, after resume, before the first step
on_before_step         entering STEP, after ``trainer.step`` was advanced to the step being run
on_before_optimizer_   during ACCUMULATE on a step's last micro-batch: after unscale and clip,
step                   before ``optimizer.step()``
on_evaluate            during ACCUMULATE, after a step's optimizer step, before ``wants_stop`` and
                       ``wants_checkpoint`` are asked (ValidationHook evaluates here)
on_after_step          ``stepped`` / ``save`` / ``finish`` out of ACCUMULATE: the optimizer step is
                       applied (or skipped by the fp16 grad scaler), before any checkpoint is written
on_after_train         entering EXIT, on every way out: completed, failed, preempted, stopped
on_state_dict          inside ``trainer.state_dict()`` (the checkpoint hook calls it in CHECKPOINT)
on_load_state_dict     inside ``trainer.load_state_dict()`` (the checkpoint hook calls it in RESTORE)
on_log, on_log_images  whenever ``trainer.log()`` / ``trainer.log_images()`` is called
====================== ==============================================================================

Why a compiled event: ``transitions`` resolves callbacks and walks its generic pipeline on every
trigger, which alone is several percent of a small training step (docs/guides/performance.md). ``CompiledEvent``
keeps transitions' semantics and order (prepare -> conditions -> before -> exit -> state change ->
enter -> after) but resolves each (trigger, source) pair's callbacks once, when ``compile_events``
is called after all callbacks are registered. It refuses what it does not cover (conditions,
machine-wide callbacks, string callbacks) rather than silently differing; an invalid trigger still
goes to transitions, which raises ``MachineError`` naming the trigger and the state. A test checks
that compiled and uncompiled dispatch give the same callback order for every row of the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any, Final, cast

from transitions import Machine
from transitions.core import Event

BUILD: Final = "BUILD"
RESTORE: Final = "RESTORE"
STEP: Final = "STEP"
ACCUMULATE: Final = "ACCUMULATE"
RETRY: Final = "RETRY"
CHECKPOINT: Final = "CHECKPOINT"
EXIT: Final = "EXIT"

STATES: Final[tuple[str, ...]] = (BUILD, RESTORE, STEP, ACCUMULATE, RETRY, CHECKPOINT, EXIT)

#: Every transition the loop may take: (trigger, sources, dest). Sources are listed explicitly:
#: a ``"*"`` source would also match EXIT, and nothing may leave EXIT.
TRANSITIONS: Final[tuple[tuple[str, tuple[str, ...], str], ...]] = (
    ("built", (BUILD,), RESTORE),
    ("restored", (RESTORE,), STEP),
    ("micro", (STEP, ACCUMULATE), ACCUMULATE),  # one micro-batch; ACCUMULATE->ACCUMULATE for the next
    ("non_finite", (ACCUMULATE,), RETRY),  # non-finite gradients, no fp16 scaler to skip the step
    # Out of device memory in a micro-batch (``max_oom_retries``): the step again, in smaller pieces.
    ("oom", (ACCUMULATE,), RETRY),
    # Back to ACCUMULATE, not STEP: the step is the same step (``trainer.step`` and
    # ``on_before_step`` must not fire again), only its micro-batches start over.
    ("retry", (RETRY,), ACCUMULATE),
    ("stepped", (ACCUMULATE,), STEP),  # optimizer stepped, nothing to save
    ("save", (ACCUMULATE,), CHECKPOINT),  # a hook wants a checkpoint after this step
    ("resume", (CHECKPOINT,), STEP),
    # The data ran out after ``max_epochs`` epochs, at the first micro-batch of a step that then
    # never happens: CHECKPOINT saves the last completed step (``on_after_step`` does not fire).
    ("exhausted", (ACCUMULATE,), CHECKPOINT),
    # Last step done, or a stop was requested; from RESTORE: the checkpoint is already at max_steps.
    ("finish", (RESTORE, ACCUMULATE, CHECKPOINT), EXIT),
    ("preempt", (BUILD, RESTORE), EXIT),  # exit signal before training began: nothing to save
    ("fail", (BUILD, RESTORE, STEP, ACCUMULATE, RETRY, CHECKPOINT), EXIT),  # exception, then re-raise
)


class ExitReason(str, Enum):
    """Why a run took EXIT: ``trainer.exit_reason`` and the trail's ``exit.reason``.

    A ``str`` enum, so ``trainer.exit_reason == "preempted"`` and JSON keep working as before."""

    COMPLETED = "completed"  # max_steps reached, max_epochs used up, or resumed at max_steps
    STOPPED = "stopped"  # a hook's wants_stop() said yes (early stopping), or SystemExit(0)
    PREEMPTED = "preempted"  # an exit signal: checkpoint (if a hook wants), requeue, exit 128+signal
    FAILED = "failed"  # an exception left train()
    INTERRUPTED = "interrupted"  # KeyboardInterrupt (Ctrl-C): the process ends with 130
    STALLED = "stalled"  # the stall watchdog ended it (stall_action="exit"): STALL_EXIT_CODE

    __str__ = str.__str__  # "preempted", not "ExitReason.PREEMPTED", in messages and f-strings


#: The status a process ended by the stall watchdog exits with (``stall_action="exit"``): 75,
#: ``EX_TEMPFAIL`` of sysexits.h, "a temporary failure: the user is invited to retry". Not 128 +
#: a signal, so neither a launcher nor ``trainfsm audit`` takes it for a preemption or a kill.
STALL_EXIT_CODE: Final = 75

TRIGGERS: Final[tuple[str, ...]] = tuple(trigger for trigger, _, _ in TRANSITIONS)


class Triggers:
    """The machine's names on its model, for type checkers: ``state`` and one method per trigger
    (``BaseTrainer`` derives from this; at run time the class is empty, and ``build_machine``
    refuses a model that defines any of these names itself)."""

    #: The machine's current state; set by ``transitions`` once ``train()`` builds the machine.
    state: str

    if TYPE_CHECKING:  # attached to the model by transitions when the machine is built

        def built(self) -> bool: ...
        def restored(self) -> bool: ...
        def micro(self) -> bool: ...
        def non_finite(self) -> bool: ...
        def oom(self) -> bool: ...
        def retry(self) -> bool: ...
        def stepped(self) -> bool: ...
        def save(self) -> bool: ...
        def resume(self) -> bool: ...
        def finish(self) -> bool: ...
        def exhausted(self) -> bool: ...
        def preempt(self) -> bool: ...
        def fail(self) -> bool: ...


#: Triggers that take back the step STEP began (it found no data): the trainer's step is one less
#: when they fire, and the audit's replay goes back with it.
STEP_TAKEN_BACK: Final[frozenset[str]] = frozenset({"exhausted"})

#: A routine step, the path almost every step takes: into ACCUMULATE for its first micro-batch,
#: ACCUMULATE -> ACCUMULATE for each further one, back to STEP with the optimizer step applied.
#: Nothing else happening, such a step is determined by its micro-batch count, so the trail writes
#: runs of them as one compact ``steps`` record (``trainfsm.trail.schema``) that the audit replays as
#: these rows (checked against the table below at import).
ROUTINE_START: Final = ("micro", STEP, ACCUMULATE)
ROUTINE_NEXT: Final = ("micro", ACCUMULATE, ACCUMULATE)
ROUTINE_END: Final = ("stepped", ACCUMULATE, STEP)

#: Where the seed hook methods fire: method -> (callback list, trigger, source) of the transitions
#: they run just before, and state entries. The trainer calls them through its dispatcher
#: (``trainfsm.run.Hooks``) at those places; ``tests/test_dispatch.py`` checks a run against this.
HOOKS_ON_TRANSITIONS: Final[dict[str, tuple[tuple[str, str, str], ...]]] = {
    "on_before_train": (("before", "restored", RESTORE), ("before", "finish", RESTORE)),
    "on_after_step": (
        ("before", "stepped", ACCUMULATE),
        ("before", "save", ACCUMULATE),
        ("before", "finish", ACCUMULATE),
    ),
}
HOOKS_ON_STATES: Final[dict[str, tuple[str, str]]] = {
    "on_before_step": ("enter", STEP),
    "on_after_train": ("enter", EXIT),
}


def step_end_reason(*, preempted: bool, stop: bool, last: bool) -> ExitReason | None:
    """Why the run ends after an applied step, or None when it goes on: an exit signal the ranks
    agreed on outranks a hook's ``wants_stop``, which outranks reaching ``max_steps`` (``last``)."""
    if preempted:
        return ExitReason.PREEMPTED
    if stop:
        return ExitReason.STOPPED
    return ExitReason.COMPLETED if last else None


def step_end_trigger(reason: ExitReason | None, *, save: bool) -> str:
    """How ACCUMULATE is left after an applied step: ``save`` when a hook wants a checkpoint
    (CHECKPOINT then decides, ``checkpoint_trigger``), ``finish`` when the run ends, else ``stepped``."""
    if save:
        return "save"
    return "finish" if reason is not None else "stepped"


def checkpoint_trigger(reason: ExitReason | None) -> str:
    """How CHECKPOINT is left: ``finish`` when the run ends, ``resume`` for the next step."""
    return "finish" if reason is not None else "resume"


def transition_rows() -> list[tuple[str, str, str]]:
    """The table flattened to (trigger, source, dest) rows, in declaration order."""
    return [(trigger, source, dest) for trigger, sources, dest in TRANSITIONS for source in sources]


class CompiledEvent(Event):
    """A transitions ``Event`` whose per-source callback plans are resolved once.

    Until ``compile()`` is called it dispatches through transitions unchanged (the tests compare
    both). The compiled plan runs, in transitions' order: prepare, before, the source's exit
    callbacks, the state change, ``announce`` (the audit event, so it lands exactly between the
    source's callbacks and the destination's), the destination's enter callbacks, after.
    """

    def __init__(self, name: str, machine: Machine) -> None:
        super().__init__(name, machine)
        self._plans: dict[str, Callable[[], bool]] = {}

    def compile(self, model: Any, announce: Callable[[str, str, str], Callable[[], Any]]) -> None:
        machine = self.machine
        if (
            machine.prepare_event
            or machine.before_state_change
            or machine.after_state_change
            or machine.finalize_event
            or machine.on_exception
            or machine.send_event
        ):
            raise TypeError("CompiledEvent supports machines without machine-wide callbacks")
        self._plans = {}
        for source, transitions in self.transitions.items():
            (transition,) = transitions  # the table has exactly one row per (trigger, source)
            dest = transition.dest
            if dest is None or transition.conditions or machine.get_state(dest).final:
                raise TypeError(f"transition {self.name!r} from {source!r} is internal or has conditions")
            src, dst = machine.get_state(source), machine.get_state(dest)
            callbacks = (*transition.prepare, *transition.before, *src.on_exit, *dst.on_enter, *transition.after)
            if not all(callable(cb) for cb in callbacks):
                raise TypeError(f"transition {self.name!r} from {source!r} has a non-callable callback")
            split = len(transition.prepare) + len(transition.before) + len(src.on_exit)
            before = cast(tuple[Callable[[], Any], ...], callbacks[:split])
            after = (announce(self.name, source, dest), *cast(tuple[Callable[[], Any], ...], callbacks[split:]))
            self._plans[source] = _plan(model, machine.model_attribute, dest, before, after, machine.progress)
        # The model's trigger method (transitions set a partial of ``trigger``) becomes one call
        # that looks up the plan: the per-step path is this closure and the plan, nothing else.
        plans, attribute, trigger = self._plans, machine.model_attribute, partial(Event.trigger, self, model)

        def fire(*args: Any, **kwargs: Any) -> bool:
            plan = plans.get(getattr(model, attribute))
            if plan is not None and not args and not kwargs:
                return plan()
            return bool(trigger(*args, **kwargs))  # an invalid trigger raises transitions' error

        setattr(model, self.name, fire)

    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        plan = self._plans.get(getattr(model, self.machine.model_attribute))
        if plan is not None and not args and not kwargs:
            return plan()
        return bool(super().trigger(model, *args, **kwargs))


def _plan(
    model: Any,
    attribute: str,
    dest: str,
    before: tuple[Callable[[], Any], ...],
    after: tuple[Callable[[], Any], ...],
    progress: Progress,
) -> Callable[[], bool]:
    """One transition's callbacks as one callable: those before the state change, the change
    (and the progress mark), those after it (the audit event first)."""

    def run() -> bool:
        for callback in before:
            callback()
        setattr(model, attribute, dest)
        progress.moves += 1
        for callback in after:
            callback()
        return True

    return run


class Progress:
    """The mark the stall watchdog watches (``trainfsm.watchdog``): ``moves`` counts the machine's
    transitions. One attribute write per transition, taken as the state changes; the watchdog
    thread only reads it, so there is no lock and no clock read on the step's path.
    ``evaluating``: the trainer is in the hooks' ``on_evaluate`` (at a step's end, in ACCUMULATE),
    which the watchdog gives a budget of its own."""

    __slots__ = ("evaluating", "moves")

    def __init__(self) -> None:
        self.moves = 0
        self.evaluating = False


class TrainMachine(Machine):
    """``transitions.Machine`` with compiled events; states are plain strings."""

    event_cls = CompiledEvent

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.progress = Progress()
        super().__init__(*args, **kwargs)

    def compile_events(self, model: Any, announce: Callable[[str, str, str], Callable[[], Any]]) -> None:
        """Resolve every trigger's callbacks; call after the last callback is registered.

        ``announce(trigger, source, dest)`` returns the callable that records that transition.
        """
        for event in self.events.values():
            cast(CompiledEvent, event).compile(model, announce)


def build_machine(model: Any, *, machine_cls: type[Machine] = TrainMachine) -> Machine:
    """Attach the table to ``model`` (the trainer), which must not shadow a trigger name.

    transitions silently keeps a model's own method when it has a trigger's name, which would turn
    that transition into a call of the user's method; this refuses such a model instead.
    """
    clashes = [name for name in (*TRIGGERS, "state") if hasattr(model, name)]
    if clashes:
        raise TypeError(
            f"{type(model).__name__} defines {', '.join(repr(c) for c in clashes)}, which the "
            f"trainer's state machine needs as trigger or state names; rename "
            f"{'it' if len(clashes) == 1 else 'them'} (reserved: {', '.join(TRIGGERS)}, state)."
        )
    return machine_cls(
        model=model,
        states=list(STATES),
        transitions=[
            {"trigger": trigger, "source": list(sources), "dest": dest} for trigger, sources, dest in TRANSITIONS
        ],
        initial=BUILD,
        auto_transitions=False,
        ignore_invalid_triggers=False,
        model_attribute="state",
    )


def bind(
    machine: Machine,
    kind: str,
    target: str | tuple[str, str],
    callback: Callable[[], Any],
    before: Callable[[], Any] | None = None,
) -> None:
    """Add ``callback`` to a state's enter/exit list or a transition's before/after list: at the
    end, or right before ``before`` when that is in the list. Call ``compile_events`` afterwards."""
    if isinstance(target, str):
        state = machine.get_state(target)
        callbacks = state.on_enter if kind == "enter" else state.on_exit
    else:
        trigger, source = target
        (transition,) = machine.events[trigger].transitions[source]
        callbacks = getattr(transition, kind)
    if before is not None and before in callbacks:
        callbacks.insert(callbacks.index(before), callback)
    else:
        callbacks.append(callback)


def state_hook_names(states: Sequence[str] = STATES) -> list[tuple[str, str, str]]:
    """(method name, kind, state) for every ``on_enter_<state>`` / ``on_exit_<state>``."""
    return [(f"on_{kind}_{state.lower()}", kind, state) for state in states for kind in ("enter", "exit")]


def _check_routine_rows() -> None:
    rows = set(transition_rows())
    for row in (ROUTINE_START, ROUTINE_NEXT, ROUTINE_END):
        if row not in rows:  # pragma: no cover - a table edit that forgot the compact trail
            raise AssertionError(f"the routine step's row {row} is not a row of TRANSITIONS")


_check_routine_rows()
