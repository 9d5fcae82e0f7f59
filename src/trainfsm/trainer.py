"""``BaseTrainer``: the machine's model. Each state has one ``_run_<state>`` method that does the
state's work and returns the trigger to fire next; ``train()`` alternates the two until EXIT.

Hooks, the trainer's own bookkeeping and the audit events are callbacks on the machine, bound once
in BUILD (see ``trainfsm.machine`` for what fires where).
"""

from __future__ import annotations

import os
import platform
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import torch
from torch import nn

from trainfsm import data_state, rng, slurm
from trainfsm import machine as fsm
from trainfsm import validation as check
from trainfsm.agreement import (
    Agreement,
    SignalAgreement,
    add_note,
    agree_now,
    collective_note,
    is_collective_error,
    trails,
)
from trainfsm.events import FLUSH_SECONDS, FORMAT_VERSION, EventLog, new_run_id, previous_attempt
from trainfsm.hooks.base import BaseHook, overrides
from trainfsm.signals import (
    HELD_SIGNALS,
    REPORTED_SIGNALS,
    ExitPolicy,
    SignalWatcher,
    exit_policy,
    on_launcher_death,
    restore_launcher_death,
    state_at_start,
)
from trainfsm.step import Stepper, close_iterator
from trainfsm.torch_workarounds import (
    GROUP_KEPT_ALIVE,
    GroupOutlivesDestroyWarning,
    default_group_kept_alive,
    import_collectives_before_any_group,
)
from trainfsm.utils import is_distributed_wrapper, unwrap, user_stacklevel

import_collectives_before_any_group()  # a script imports us before it creates its group (see there)

#: What ``_next_batch`` returns once ``max_epochs`` epochs of data are used up.
_EXHAUSTED: Final = object()


_LOSS_NONE_ALONE: Final = (
    "forward() returned loss=None for a DDP/FSDP model; this rank skips the micro-batch. Return None on "
    "every rank at the same micro-batch without calling the wrapped model, or pass loss_none_agreement=True "
    "to the trainer so that every rank skips it when any rank returns None."
)
_LOSS_NONE_AGREED: Final = (
    "forward() returned loss=None for a DDP/FSDP model; every rank skips this micro-batch. Call the wrapped "
    "model before returning None, as the other ranks do: collectives in its forward (DDP's bucket rebuild and "
    "buffer broadcast, FSDP's all-gathers) have no partner otherwise."
)


class LossNoneWarning(UserWarning):
    """``forward`` returned ``loss=None`` for a DDP/FSDP model (on this rank).

    By default (the ``trainloop`` contract) the ranks do not talk about it: return None on every
    rank at the same micro-batch, without calling the wrapped model. A rank that skips alone pairs
    its next gradient all-reduce with the others' current one; the next checkpoint notices (the
    ranks' skip counts differ), saves nothing and fails on every rank with an error saying so.

    With ``loss_none_agreement=True`` the ranks agree before every backward (one small host
    all-reduce per micro-batch), and every rank skips a micro-batch when any rank returned None.
    Collectives inside the wrapped module's forward run before that agreement (DDP rebuilds its
    buckets in its second forward and broadcasts buffers in every forward; FSDP all-gathers), so
    then call the wrapped model on every rank before returning None."""


class BaseTrainer:
    """Subclass it, implement ``build_data_loader``, ``build_model``, ``build_optimizer`` and
    ``forward``, then call ``train()``."""

    #: The machine's current state; set by ``transitions`` once ``train()`` builds the machine.
    state: str

    if TYPE_CHECKING:  # trigger methods that transitions attaches to the trainer in train()

        def built(self) -> bool: ...
        def restored(self) -> bool: ...
        def micro(self) -> bool: ...
        def non_finite(self) -> bool: ...
        def retry(self) -> bool: ...
        def stepped(self) -> bool: ...
        def save(self) -> bool: ...
        def resume(self) -> bool: ...
        def finish(self) -> bool: ...
        def exhausted(self) -> bool: ...
        def preempt(self) -> bool: ...
        def fail(self) -> bool: ...

    def __init__(
        self,
        max_steps: int,
        grad_clip: float | None = None,
        max_non_finite_grad_retries: int | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        workspace: Path | str | None = None,
        device: torch.device | str | int | None = None,
        no_sync_accumulate: bool = True,
        state_dict_options: Any = None,
        logger: Any = None,
        max_epochs: int | None = None,
        loss_none_agreement: bool = False,
        trail_form: str = "compact",
    ) -> None:
        self.max_steps: int = check.positive_int("max_steps", max_steps)  # type: ignore[assignment]
        self.grad_clip = check.grad_clip(grad_clip)
        self.max_non_finite_grad_retries: int = (
            check.positive_int("max_non_finite_grad_retries", max_non_finite_grad_retries, allow_none=True, minimum=0)
            or 0
        )
        self.mixed_precision = check.mixed_precision(mixed_precision)
        self.gradient_accumulation_steps: int = (
            check.positive_int("gradient_accumulation_steps", gradient_accumulation_steps, allow_none=True) or 1
        )
        self.workspace = check.workspace(workspace)
        self.device = check.device(device)
        self.no_sync_accumulate = check.boolean("no_sync_accumulate", no_sync_accumulate)
        self.state_dict_options = check.state_dict_options(state_dict_options)
        self.logger = check.logger(logger)
        # None: every exhaustion of the data starts a new epoch, and only max_steps ends the run.
        self.max_epochs = check.positive_int("max_epochs", max_epochs, allow_none=True)
        # With several ranks: agree before every backward whether some rank's loss is None (one
        # small host all-reduce per micro-batch), so one rank may skip alone; see trainfsm.agreement.
        self.loss_none_agreement = check.boolean("loss_none_agreement", loss_none_agreement)
        # How the audit trail writes routine steps: "compact" runs of them, or "full" transitions.
        self.trail_form = check.trail_form(trail_form)
        #: Micro-batches this rank skipped for loss=None in this launch (with loss_none_agreement,
        #: also those another rank returned None for): checkpoints compare the ranks' counts.
        self.loss_none_skips = 0

        # The trainer's own resumable state: the completed step count and the data epoch.
        self.step = 0
        self.epoch = 0
        self.step_info: dict[str, Any] = {}
        self.exit_reason: str | None = None
        self.exit_code: int | None = None
        self.data_loader: Iterable[Any] | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.grad_scaler: torch.amp.GradScaler | None = None
        self.hooks: list[BaseHook] = []
        self.exit_policy: ExitPolicy | None = None
        self._trained = False

    # ---------------------------------------------------------------- the user's contract
    def build_data_loader(self) -> Iterable[Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement build_data_loader()")

    def build_model(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def build_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError(f"{type(self).__name__} must implement build_optimizer()")

    def build_lr_scheduler(self) -> Any:
        return None

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type, enabled=self.mixed_precision == "fp16")

    def build_hooks(self) -> list[BaseHook]:
        return []

    def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(input)")

    def set_exit_signals(
        self,
        signals: Iterable[int | signal.Signals] | int | signal.Signals,
        exit_code: int | str = "128+signal",
        exit_wait: float | Any = 0.0,
        requeue: bool | str = "auto",
        max_requeues: int | None = None,
    ) -> None:
        """Exit cleanly on these signals, for runs that do not use ``CheckpointingHook``'s (or want
        them from the very start of BUILD). Handlers are installed by ``train()``, not here."""
        self.exit_policy = exit_policy("set_exit_signals()", signals, exit_code, exit_wait, requeue, max_requeues)

    # ---------------------------------------------------------------- driving the machine
    def train(self) -> None:
        """Run BUILD -> RESTORE -> steps -> EXIT. Exceptions take ``fail`` to EXIT, then re-raise."""
        if self._trained:
            raise RuntimeError("train() was already called on this trainer; build a new trainer to train again.")
        self._trained = True
        # First of all: from here on no exit signal is lost (see trainfsm.signals for the rule).
        own = self.exit_policy.signals if self.exit_policy is not None else ()
        at_start = state_at_start((*REPORTED_SIGNALS, *own))
        self._signals = SignalWatcher(self)
        self._signals.install(dict.fromkeys((*HELD_SIGNALS, *own)))
        if self.exit_policy is not None:
            self._signals.acting = frozenset(own)
        launcher_death = on_launcher_death(signal.SIGTERM)  # torchrun died: its workers must not train on
        try:
            self._run_machine(at_start)
        finally:
            restore_launcher_death(launcher_death)
            self._signals.restore()

    def _run_machine(self, signals_at_start: dict[str, list[str]]) -> None:
        self._machine = fsm.build_machine(self)
        self._open_events(signals_at_start)
        self._data_iter: Iterator[Any] | None = None
        # The trainer's own bookkeeping is bound (and the machine compiled) before any user code
        # runs, so that a failure in BUILD is recorded like any other: transition, exception, exit.
        fsm.bind(self._machine, "enter", fsm.STEP, self._begin_step)
        fsm.bind(self._machine, "enter", fsm.EXIT, self._finish_exit)
        self._machine.compile_events(self, self._events.transition_recorder)
        self._agreement: Agreement | None = None
        self._signal_agreement: SignalAgreement | None = None
        # The signal pending on any rank at the end of a step: this rank's own, the step's signal
        # all-reduce, or the last micro-batch agreement's. Chosen in BUILD, called once per step.
        self._pending_signal: Callable[[], int] = lambda: self._signals.pending
        runs: dict[str, Callable[[], Callable[[], bool] | None]] = {
            fsm.BUILD: self._run_build,
            fsm.RESTORE: self._run_restore,
            fsm.STEP: self._run_step,
            fsm.ACCUMULATE: self._run_accumulate,
            fsm.RETRY: self._run_retry,
            fsm.CHECKPOINT: self._run_checkpoint,
            fsm.EXIT: lambda: None,
        }
        try:
            trigger = runs[self.state]()
            while trigger is not None:
                trigger()
                trigger = runs[self.state]()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._events.close()
        if self.exit_reason == "preempted":
            if self.exit_policy is not None and self.exit_policy.wait and not self._requeued:
                self._signals.sleep(self.exit_policy.wait)  # e.g. let SLURM record TIMEOUT, not FAILED
            raise SystemExit(self.exit_code)
        if self._exit_errors:  # EXIT's work failed after training completed: recorded, now raised
            raise self._exit_errors[0]

    def _open_events(self, signals_at_start: dict[str, list[str]]) -> None:
        rank, world = _rank_and_world()
        self._logs = self.workspace / "logs" if self.workspace else None
        path = self._logs / f"events.rank{rank}.jsonl" if self._logs else None
        previous = previous_attempt(path) if path else None
        self.run_id, self.attempt = (previous[0], previous[1] + 1) if previous else (new_run_id(), 0)
        if world > 1:
            self.run_id, self.attempt = _share_run_id(self.run_id, self.attempt)
        self.rank, self.world_size = rank, world
        self._events = EventLog(
            path=path,
            console=self.logger,
            rank=rank,
            run_id=self.run_id,
            attempt=self.attempt,
            progress=lambda: (self.step, self.state),
            owner=self,
            form=self.trail_form,
        )
        self.audit = self._events.log
        self._exit_errors: list[BaseException] = []
        self._failure: BaseException | None = None  # the exception on its way out of train(), if any
        self._requeued = False
        self.slurm = slurm.detect()
        self.audit.info(
            "run_start",
            format=FORMAT_VERSION,
            world_size=world,
            max_steps=self.max_steps,
            slurm=self.slurm.as_event() if self.slurm else None,
            signals=signals_at_start,
            torchelastic=_torchelastic(),
            trail={
                "form": self.trail_form,
                "flush_seconds": FLUSH_SECONDS,
                "segment_bytes": self._events.segment_bytes,
            },
            versions={"trainfsm": _version(), "torch": torch.__version__, "python": platform.python_version()},
            config={
                "grad_clip": self.grad_clip,
                "max_non_finite_grad_retries": self.max_non_finite_grad_retries,
                "mixed_precision": self.mixed_precision,
                "device": str(self.device),
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "workspace": str(self.workspace) if self.workspace else None,
                "max_epochs": self.max_epochs,
                "loss_none_agreement": self.loss_none_agreement,
            },
        )

    def _fail(self, exc: BaseException) -> None:
        if self.world_size > 1 and is_collective_error(exc):  # most likely another rank's failure
            note = collective_note(self.rank, self.world_size, self.step, self.state, self._logs)
            add_note(exc, note)
            self.audit.error("collective_failed", note=note, trails=trails(self._logs, self.rank, self.world_size))
        self.audit.error(
            "exception",
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
        if self.state == fsm.EXIT:
            return
        self.exit_reason, self.exit_code = _exit_status(exc)
        self._failure = exc
        try:
            self.fail()
        except BaseException as inner:  # EXIT's own work failed: record it, keep the original error
            self.audit.error(
                "exception",
                type=type(inner).__name__,
                message=str(inner),
                traceback="".join(traceback.format_exception(inner)),
            )

    # ---------------------------------------------------------------- states
    def _run_build(self) -> Callable[[], bool]:
        if self.world_size > 1 and self.loss_none_agreement:  # first: it may create a gloo group
            self._agreement = Agreement(rank=self.rank, world=self.world_size, watcher=self._signals)
        self.data_loader = check.built("build_data_loader", self.build_data_loader(), Iterable)
        self.model = check.built("build_model", self.build_model(), nn.Module)
        self.optimizer = check.built("build_optimizer", self.build_optimizer(), torch.optim.Optimizer)
        if default_group_kept_alive():  # checked here: building the first optimizer may import it
            self.audit.warning("group_outlives_destroy", cause=GROUP_KEPT_ALIVE)
            warnings.warn(GROUP_KEPT_ALIVE, GroupOutlivesDestroyWarning, stacklevel=user_stacklevel())
        self.lr_scheduler = self.build_lr_scheduler()
        self.grad_scaler = check.built("build_grad_scaler", self.build_grad_scaler(), torch.amp.GradScaler)
        self.hooks = list(check.built("build_hooks", self.build_hooks(), (list, tuple)))
        for hook in self.hooks:
            check.built("build_hooks", hook, BaseHook)
        model = self.model
        self._warn_loss_none = is_distributed_wrapper(model)
        no_sync = getattr(model, "no_sync", None)
        self._stepper = Stepper(
            model=model,
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            scaler=self.grad_scaler,
            device=self.device,
            mixed_precision=self.mixed_precision,
            accumulation=self.gradient_accumulation_steps,
            grad_clip=self.grad_clip,
            no_sync=no_sync if self.no_sync_accumulate and self.gradient_accumulation_steps > 1 else None,
            agreement=self._agreement,
        )
        if self.exit_policy is None:  # the first hook that asks for exit signals (CheckpointingHook)
            self.exit_policy = next(
                (p for h in self.hooks if isinstance(p := getattr(h, "exit_policy", None), ExitPolicy) and p.signals),
                None,
            )
        self._decide_signals()
        if self.exit_policy is not None:
            if not self._signals.installed_any:
                self.audit.warning("signals_not_installed", reason="train() is not running in the main thread")
            if self.world_size > 1 and self._agreement is None:
                self._signal_agreement = SignalAgreement()
                self._pending_signal = self._signal_agreement.result
        if self._agreement is not None:  # the signal rides on its all-reduce, with or without a policy
            agreement = self._agreement
            self._pending_signal = lambda: agreement.signal
        self._data_resume: tuple[str, dict[str, Any], dict[str, Any] | None] | None = None
        self._batches = 0
        self._epoch_rng: dict[str, Any] | None = None
        self._bind_callbacks()
        return self._preempted_before_training() or self.built

    def _bind_callbacks(self) -> None:
        """Bind the trainer's bookkeeping first, then each hook's overridden methods, in list order."""
        m = self._machine
        self._before_optimizer_step = [
            partial(h.on_before_optimizer_step, self) for h in self.hooks if overrides(h, "on_before_optimizer_step")
        ]
        self._checkpoint_askers = [
            partial(h.wants_checkpoint, self) for h in self.hooks if overrides(h, "wants_checkpoint")
        ]
        self._stop_askers = [partial(h.wants_stop, self) for h in self.hooks if overrides(h, "wants_stop")]
        for hook in self.hooks:
            for name, bindings in fsm.SEED_TRANSITION_HOOKS.items():
                if overrides(hook, name):
                    for kind, trigger, source in bindings:
                        fsm.bind(m, kind, (trigger, source), partial(getattr(hook, name), self))
            for name, (kind, state) in fsm.SEED_STATE_HOOKS.items():
                if overrides(hook, name):
                    callback = partial(getattr(hook, name), self)
                    if state == fsm.EXIT:
                        fsm.bind(m, kind, state, partial(self._guarded, callback), before=self._finish_exit)
                    else:
                        fsm.bind(m, kind, state, callback)
            for name, kind, state in fsm.state_hook_names():
                method = getattr(hook, name, None)
                if method is None:
                    continue
                if state == fsm.EXIT:  # EXIT always completes: hook failures are recorded, then raised
                    fsm.bind(m, kind, state, partial(self._guarded, partial(method, self)), before=self._finish_exit)
                else:
                    fsm.bind(m, kind, state, partial(method, self))
        m.compile_events(self, self._events.transition_recorder)

    def _run_restore(self) -> Callable[[], bool]:
        # Hooks (the checkpoint hook) restored state in on_enter_restore; RNG states are back
        # before the iterator exists, so a shuffling loader draws the same order it drew before.
        resumed = self.step > 0
        self.audit.info("restore", resumed=resumed, from_step=self.step)
        if self.step >= self.max_steps:  # resumed from a finished run: nothing left to do
            self.exit_reason, self.exit_code = "completed", 0
            return self.finish  # a signal now is recorded in EXIT: the run is complete, no requeue
        if self._data_resume is not None:
            mode, saved, rng_state = self._data_resume
            resumed_data = data_state.resume(cast(Iterable[Any], self.data_loader), mode, saved)
            self._data_iter, self._batches = resumed_data.iterator, resumed_data.batches
            self._epoch_rng = resumed_data.epoch_rng
            # How the position was found and what it cost: a replay grows with the position.
            self.audit.info(
                "data_resumed",
                mode=resumed_data.mode,
                why=resumed_data.why,
                epoch=self.epoch,
                batches=resumed_data.batches,
                positioned=resumed_data.positioned,
                seconds=round(resumed_data.seconds, 6),
            )
            if rng_state is not None:
                rng.restore(rng_state)
        else:
            self._data_iter = self._new_iterator()
        # Checked last: a signal while the checkpoint loaded or the data was positioned counts.
        return self._preempted_before_training() or self.restored

    def _begin_step(self) -> None:
        self.step += 1
        self.step_info = {}
        self._micro = 0
        self._retries = 0
        # New lists each step: a hook may keep the previous step's until its interval ends.
        self._losses: list[torch.Tensor] = []
        self._records: list[Any] = []
        self._data_times: list[float] = []
        self._step_start = time.perf_counter()
        if self._signal_agreement is not None:  # overlaps the step's work; waited for in _after_step
            self._signal_agreement.start(self._signals.pending)

    def _run_step(self) -> Callable[[], bool]:
        return self.micro

    def _run_accumulate(self) -> Callable[[], bool]:
        t0 = time.perf_counter()
        batch = self._next_batch()
        if batch is _EXHAUSTED:
            return self._data_ran_out()
        self._data_times.append(time.perf_counter() - t0)
        last = self._micro + 1 == self.gradient_accumulation_steps
        loss, records = self._stepper.micro(self.forward, batch, last)
        if loss is None:  # on this rank; with loss_none_agreement, on any: then every rank skips it
            agreement = self._agreement
            ranks = agreement.none_ranks() if agreement is not None else [self.rank]
            self.loss_none_skips += 1  # this rank skipped it, whichever rank returned None
            if self._warn_loss_none and self.rank in ranks:
                warnings.warn(
                    _LOSS_NONE_AGREED if agreement is not None else _LOSS_NONE_ALONE,
                    LossNoneWarning,
                    stacklevel=user_stacklevel(),  # the user's train() call
                )
            self.audit.debug("loss_none", micro=self._micro, ranks=ranks)
            return self.micro
        self._micro += 1
        self._losses.append(loss)
        self._records.append(records)
        if not last:
            return self.micro
        stepper = self._stepper
        finite, grad_norm = stepper.check_and_clip()
        if not finite and not stepper.scaler_enabled:
            return self.non_finite
        if not finite:
            self.audit.warning(
                "non_finite",
                what="scaler_skip",
                retry=0,
                max=0,
                scale=self.grad_scaler.get_scale() if self.grad_scaler else None,
            )
        info = self.step_info
        if grad_norm is not None:
            info["grad_norm"] = grad_norm
        for callback in self._before_optimizer_step:
            callback()
        stepper.apply(finite)
        # trainloop's layout: per micro-batch lists (detached losses, records, data times; no
        # averaging here, so no kernel and no sync), the step's time and its retry count.
        info["loss"] = self._losses
        info["records"] = self._records
        info["data_time"] = self._data_times
        info["step_time"] = time.perf_counter() - self._step_start
        info["non_finite_grad_retry_count"] = info["non_finite_grad_retries"] = self._retries
        return self._after_step()

    def _after_step(self) -> Callable[[], bool]:
        # The askers first: one of them may run work (ValidationHook evaluates here) during which a
        # signal can arrive; read after them, it is honoured at this step (with one rank).
        stop = any(ask() for ask in self._stop_askers) if self._stop_askers else False
        pending = self._pending_signal()
        if pending:
            self._agree_signal(pending)
        elif stop or self.step >= self.max_steps:
            self.exit_reason, self.exit_code = ("stopped" if stop else "completed"), 0
        if self._checkpoint_askers and any(ask() for ask in self._checkpoint_askers):
            return self.save
        return self.finish if self.exit_reason else self.stepped

    def _report_signals(self) -> None:
        for arrival in self._signals.take_new():
            self.audit.warning(
                "signal_received",
                signal=signal.Signals(arrival.signum).name,
                received_at=arrival.at,
                at_step=arrival.step,
                at_state=arrival.state,
            )

    def _agree_signal(self, signum: int) -> None:
        """All ranks saw ``signum`` pending at this step: checkpoint (if a hook wants), then EXIT."""
        self._preempted_by(signum)
        self.audit.info("signal_agreed", signal=signal.Signals(signum).name, agreed_step=self.step)

    def _preempted_by(self, signum: int) -> None:
        self._report_signals()
        policy = self.exit_policy
        self.exit_reason = "preempted"
        self.exit_code = policy.exit_code(signum) if policy is not None else 128 + signum

    def _decide_signals(self) -> None:
        """The exit policy is known (or BUILD failed before it was): act on the signals it names;
        a held signal it does not name gets its old disposition back and, if it came meanwhile, is
        raised again here, after the trail says so (it may end the process at once)."""
        if self._signals.acting is not None:
            return
        policy = self.exit_policy
        for arrival, how in self._signals.decide(policy.signals if policy is not None else ()):
            name = signal.Signals(arrival.signum).name
            self.audit.warning(
                "signal_passed_on", signal=name, received_at=arrival.at, at_state=arrival.state, disposition=how
            )
            signal.raise_signal(arrival.signum)

    def _preempted_before_training(self) -> Callable[[], bool] | None:
        """A signal during BUILD or RESTORE: nothing worth saving exists yet; leave by ``preempt``.

        With several ranks they agree first (one blocking all-reduce, at the end of BUILD and of
        RESTORE only), so a signal that reached one rank alone stops every rank here: a rank
        leaving alone would strand the others in their next collective, and only rank 0 requeues.
        """
        pending = self._signals.pending
        if self.world_size > 1 and self.exit_policy is not None:
            pending = agree_now(pending)
        if not pending:
            return None
        self._preempted_by(pending)
        return self.preempt

    def _data_ran_out(self) -> Callable[[], bool]:
        """``max_epochs`` epochs are done: the step that began has no data, so it never happens.

        Gradients of any micro-batches it already ran are dropped (like ``drop_last``), and
        ``trainer.step`` goes back to the last completed step, which CHECKPOINT then saves.
        """
        self._stepper.discard()
        self._pending_signal()  # the step's signal all-reduce is waited for: the run is complete anyway
        self.exit_reason, self.exit_code = "completed", 0
        self.audit.info("data_exhausted", epochs=self.max_epochs, dropped_micro_batches=self._micro)
        self.step -= 1  # after the event, which belongs to the step that began; see fsm.STEP_TAKEN_BACK
        return self.exhausted

    def _run_retry(self) -> Callable[[], bool]:
        self._stepper.discard()
        limit = self.max_non_finite_grad_retries
        if self._retries >= limit:
            if limit == 0:
                raise RuntimeError(
                    f"Step {self.step}: gradients are non-finite and retries are disabled "
                    f"(max_non_finite_grad_retries={limit}); set it to a positive integer to re-run "
                    f"the step on fresh micro-batches, or enable mixed_precision='fp16' with a grad scaler."
                )
            raise RuntimeError(
                f"Step {self.step}: gradients were non-finite on {self._retries + 1} attempts "
                f"({self._retries} retries, max_non_finite_grad_retries={limit}); stopping instead of "
                f"stepping non-finite values into the weights. Lower the learning rate, set grad_clip, "
                f"or check the data."
            )
        self._retries += 1
        self.audit.warning("non_finite", what="gradients", retry=self._retries, max=limit, scale=None)
        self._micro = 0
        self._losses = []  # the retried micro-batches' data times stay: they were spent in this step
        self._records = []
        return self.retry

    def _run_checkpoint(self) -> Callable[[], bool]:
        # The checkpoint hook saved in on_enter_checkpoint; leave for good or for the next step.
        return self.finish if self.exit_reason else self.resume

    def _finish_exit(self) -> None:
        self._decide_signals()  # BUILD failed before the policy was known: held signals are passed on
        iterator, self._data_iter = self._data_iter, None
        self._guarded(partial(close_iterator, iterator))
        # A failure in EXIT's own work is raised at the end (status 1), unless an exception is
        # already on its way out of train(): that one decides the status, and _fail recorded it.
        if self.exit_reason is None or (self._exit_errors and self._failure is None):
            self.exit_reason, self.exit_code = "failed", 1
        self._report_signals()
        if self.exit_reason == "preempted" and self.rank == 0:
            self._requeue()
        self.audit.info("exit", reason=self.exit_reason, code=self.exit_code)

    def _requeue(self) -> None:
        """After the checkpoint is durable (hooks' on_after_train waited for it): requeue the job."""
        policy, job = self.exit_policy, self.slurm
        if policy is None or job is None or policy.requeue is False:
            return
        if policy.requeue == "auto" and not slurm.is_batch_job(job.job_id):
            return
        if policy.max_requeues is not None and job.restart_count >= policy.max_requeues:
            self.audit.error(
                "requeue",
                command=None,
                ok=False,
                message=f"not requeued: SLURM_RESTART_COUNT={job.restart_count} reached max_requeues="
                f"{policy.max_requeues}",
            )
            return
        result = slurm.requeue(job)
        self._requeued = result.ok
        log = self.audit.info if result.ok else self.audit.error
        log("requeue", command=" ".join(result.command), ok=result.ok, message=result.message)

    def _guarded(self, callback: Callable[[], Any]) -> None:
        """Run an EXIT callback; a failure is recorded and raised after EXIT's work is done."""
        try:
            callback()
        except Exception as exc:
            self.audit.error(
                "exception",
                type=type(exc).__name__,
                message=str(exc),
                traceback="".join(traceback.format_exception(exc)),
            )
            self._exit_errors.append(exc)

    # ---------------------------------------------------------------- data
    def _new_iterator(self) -> Iterator[Any]:
        data_state.set_epoch(self.data_loader, self.epoch)
        # Once per epoch: the random state that decides this epoch's order, for exact resume.
        self._epoch_rng = data_state.epoch_start(self.data_loader)
        self._batches = 0
        return iter(self.data_loader)  # type: ignore[arg-type]

    def data_state(self) -> dict[str, Any]:
        """This rank's data position (epoch, batches drawn, epoch random state, loader state)."""
        return data_state.capture(self.data_loader, self.epoch, self._batches, self._epoch_rng)

    def resume_data(self, mode: str, saved: dict[str, Any], rng_state: dict[str, Any] | None) -> None:
        """Ask RESTORE to position the data iterator as ``saved`` says, then restore ``rng_state``."""
        self._data_resume = (mode, saved, rng_state)

    def _next_batch(self) -> Any:
        try:
            batch = next(self._data_iter)  # type: ignore[arg-type]
            self._batches += 1
            return batch
        except StopIteration:
            pass
        if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
            return _EXHAUSTED  # the iterator stays open at its end: a checkpoint records that position
        close_iterator(self._data_iter, epoch_end=True)
        self.epoch += 1
        self.audit.debug("epoch", epoch=self.epoch)
        self._data_iter = self._new_iterator()
        try:
            batch = next(self._data_iter)
            self._batches += 1
            return batch
        except StopIteration:
            raise RuntimeError(
                "build_data_loader() returned an iterable that yields no batches when iterated again "
                f"(epoch {self.epoch}). Return a re-iterable such as a DataLoader or list, not a "
                "one-shot iterator or generator object, or make the iterable infinite."
            ) from None

    # ---------------------------------------------------------------- state and helpers
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler, step, epoch, and each hook's ``on_state_dict``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = self._built_model_and_optimizer("state_dict")
        model_state, optim_state = get_state_dict(model, optimizer, options=self.state_dict_options)
        state: dict[str, Any] = {
            "model": model_state,
            "optimizer": optim_state,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "step": self.step,
            "epoch": self.epoch,
        }
        for hook in self.hooks:
            hook.on_state_dict(self, state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        model, optimizer = self._built_model_and_optimizer("load_state_dict")
        # The scheduler before the optimizer: a scheduler's load may write its view of the
        # learning rates into the param groups, and the optimizer's saved groups (lr,
        # initial_lr) must be the last word, or a resumed run trains at the wrong rate.
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        options = self.state_dict_options
        if options is not None and options.full_state_dict and not state["optimizer"].get("state"):
            # An optimizer that keeps no tensor state (SGD without momentum): torch's
            # set_state_dict cannot scatter a full optimizer state dict into it (it asserts
            # "Expected device to be set", torch 2.13); its param groups are all there is to load.
            set_model_state_dict(model, state["model"], options=options)
            saved_groups = state["optimizer"]["param_groups"]
            for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
                group.update({key: value for key, value in saved.items() if key != "params"})
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.step = int(state["step"])
        self.epoch = int(state.get("epoch", 0))
        for hook in self.hooks:
            hook.on_load_state_dict(self, state)

    def _built_model_and_optimizer(self, method: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.model is None or self.optimizer is None:
            raise RuntimeError(
                f"{method}() needs the built model and optimizer; they exist once train() has run BUILD "
                f"(call it from a hook, or after train())."
            )
        return self.model, self.optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap(model)

    @property
    def unwrapped_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("unwrapped_model is available once build_model() ran (after train() starts).")
        return unwrap(self.model)

    def log(self, records: dict[str, Any], dry_run: bool = False) -> None:
        for hook in self.hooks:
            hook.on_log(self, records, dry_run)

    log_scalars = log  # the other published spelling

    def log_images(self, records: dict[str, Any], dry_run: bool = False) -> None:
        for hook in self.hooks:
            hook.on_log_images(self, records, dry_run)


def _exit_status(exc: BaseException) -> tuple[str, int]:
    """The exit reason, and the status the process ends with once ``exc`` leaves ``train()``
    uncaught: the trail's exit code is the one the shell sees.

    Python re-raises an uncaught KeyboardInterrupt by killing itself with SIGINT (the shell sees
    128 + 2); it exits with a SystemExit's code (None: 0; an int, modulo 256 as the OS keeps it;
    anything else is printed and gives 1); any other exception gives 1."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 128 + signal.SIGINT
    if isinstance(exc, SystemExit):
        code = exc.code
        status = 0 if code is None else int(code) & 0xFF if isinstance(code, int) else 1
        return ("failed" if status else "stopped"), status
    return "failed", 1


def _share_run_id(run_id: str, attempt: int) -> tuple[str, int]:
    """Rank 0's run id and attempt on every rank: one small broadcast at start.

    A fixed-size tensor, not ``broadcast_object_list``: no size exchange, no pickle. Run ids are
    12 hex digits (48 bits); one that is not (an edited trail) is replaced by a fresh one first.
    """
    import torch.distributed as dist

    try:
        number = int(run_id, 16) if len(run_id) == 12 else -1
    except ValueError:
        number = -1
    if number < 0:
        run_id = new_run_id()
        number = int(run_id, 16)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    shared = torch.tensor([number, attempt], dtype=torch.int64, device=device)
    dist.broadcast(shared, src=0)
    number, attempt = (int(v) for v in shared.tolist())
    return f"{number:012x}", attempt


def _torchelastic() -> dict[str, Any] | None:
    """torchrun's attempt: which restart this is (0 for the first launch) of how many allowed."""
    from trainfsm.distributed import elastic_restart

    restart = elastic_restart()
    if restart is None:
        return None
    env = os.environ
    maximum = env.get("TORCHELASTIC_MAX_RESTARTS", "")
    return {
        "restart_count": restart,
        "max_restarts": int(maximum) if maximum.isdigit() else None,
        "run_id": env.get("TORCHELASTIC_RUN_ID"),
    }


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _version() -> str:
    from trainfsm import __version__

    return __version__
