"""Exit signals in-process: what the machine does for a signal in each state, and what it leaves."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import TinyTrainer, ignored_here, read_events
from trainfsm import BaseHook, CheckpointingHook
from trainfsm.preemption.slurm import SlurmJob, detect, requeue, valid_job_id

USR1 = signal.SIGUSR1


def _kill_self(sig: signal.Signals = USR1) -> None:
    os.kill(os.getpid(), sig)


class SignalAt(BaseHook):
    """Sends a signal to this process from inside a given state (or after a given step)."""

    def __init__(self, state: str | None = None, step: int | None = None, sig: signal.Signals = USR1, times: int = 1):
        self.state, self.at_step, self.sig, self.times = state, step, sig, times

    def _fire(self) -> None:
        for _ in range(self.times):
            _kill_self(self.sig)
        self.state = self.at_step = None  # once

    def on_enter_restore(self, trainer: Any) -> None:
        if self.state == "RESTORE":
            self._fire()

    def on_enter_checkpoint(self, trainer: Any) -> None:
        if self.state == "CHECKPOINT":
            self._fire()

    def on_before_step(self, trainer: Any) -> None:
        if self.at_step is not None and trainer.step == self.at_step:
            self._fire()


def outline(workspace: Path) -> list[str]:
    names = []
    for e in read_events(workspace):
        if e["event"] == "transition":
            names.append(f"{e['trigger']}:{e['source']}>{e['dest']}")
        elif e["event"] in ("signal_received", "signal_agreed"):
            names.append(f"{e['event']}:{e['signal']}")
        elif e["event"] == "checkpoint_saved":
            names.append(f"saved:{e['saved_step']}")
        elif e["event"] == "exit":
            names.append(f"exit:{e['reason']}:{e['code']}")
    return names


def trainer(tmp_path: Path, *hooks: BaseHook, steps: int = 6, **kwargs: Any) -> TinyTrainer:
    checkpoint = CheckpointingHook(interval=100, exit_signals=[USR1, signal.SIGTERM, signal.SIGINT], **kwargs)
    return TinyTrainer(max_steps=steps, workspace=tmp_path, hooks=[checkpoint, *hooks])


def test_a_signal_mid_run_checkpoints_at_the_end_of_the_step_and_exits_128_plus_signal(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        trainer(tmp_path, SignalAt(step=3)).train()
    assert info.value.code == 128 + USR1
    names = outline(tmp_path)
    agreed = names.index("signal_agreed:SIGUSR1")
    assert names[agreed - 1] == "signal_received:SIGUSR1"
    assert names[agreed + 1 :] == [
        "save:ACCUMULATE>CHECKPOINT",
        "saved:3",
        "finish:CHECKPOINT>EXIT",
        "exit:preempted:138",
    ]
    received = next(e for e in read_events(tmp_path) if e["event"] == "signal_received")
    assert (received["at_step"], received["at_state"]) == (3, "STEP")
    assert (tmp_path / "checkpoints" / "3" / "manifest.json").is_file()


def test_the_resumed_run_finishes_with_the_same_parameters(tmp_path: Path) -> None:
    straight = TinyTrainer(max_steps=6, workspace=tmp_path / "a")
    straight.train()
    with pytest.raises(SystemExit):
        trainer(tmp_path / "b", SignalAt(step=3)).train()
    resumed = trainer(tmp_path / "b")
    resumed.train()
    assert resumed.step == 6
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):  # type: ignore[union-attr]
        assert torch.equal(a, b)


def test_a_signal_during_build_exits_without_saving(tmp_path: Path) -> None:
    class SignalInBuild(TinyTrainer):
        def build_model(self) -> Any:
            _kill_self()
            return super().build_model()

    run = SignalInBuild(max_steps=4, workspace=tmp_path)
    run.set_exit_signals([USR1])
    with pytest.raises(SystemExit) as info:
        run.train()
    assert info.value.code == 138
    assert outline(tmp_path) == ["signal_received:SIGUSR1", "preempt:BUILD>EXIT", "exit:preempted:138"]
    assert not (tmp_path / "checkpoints").exists()


def test_with_set_exit_signals_a_signal_it_does_not_name_keeps_its_handler_all_along(tmp_path: Path) -> None:
    # The policy is known as train() begins, so nothing else is held: the user's SIGTERM handler
    # runs when SIGTERM comes (step 3), as it would without trainfsm, not never.
    steps: list[int] = []
    run = TinyTrainer(max_steps=5, workspace=tmp_path, hooks=[SignalAt(step=3, sig=signal.SIGTERM)])

    def users_handler(signum: int, frame: Any) -> None:
        steps.append(run.step)

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        run.set_exit_signals([USR1])
        run.train()
        assert signal.getsignal(signal.SIGTERM) is users_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert steps == [3] and run.exit_reason == "completed"
    assert "signal_received:SIGTERM" not in outline(tmp_path)


def test_a_signal_during_restore_exits_without_saving(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        trainer(tmp_path, SignalAt(state="RESTORE")).train()
    assert outline(tmp_path) == [
        "built:BUILD>RESTORE",
        "signal_received:SIGUSR1",
        "preempt:RESTORE>EXIT",
        "exit:preempted:138",
    ]
    assert not (tmp_path / "checkpoints").exists()


class AsksExitPending(BaseHook):
    """Reads ``trainer.exit_pending`` in RESTORE, before and after a signal to this process."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_enter_restore(self, trainer: Any) -> None:
        self.seen.append(trainer.exit_pending)
        _kill_self()
        self.seen.append(trainer.exit_pending)


def test_exit_pending_says_in_restore_that_a_signal_came_and_the_run_will_leave(tmp_path: Path) -> None:
    asks = AsksExitPending()
    run = trainer(tmp_path, asks)
    assert run.exit_pending is False  # before train()
    with pytest.raises(SystemExit):
        run.train()
    assert asks.seen == [False, True]
    assert outline(tmp_path)[-2:] == ["preempt:RESTORE>EXIT", "exit:preempted:138"]


def test_a_signal_during_a_checkpoint_write_lets_the_write_finish(tmp_path: Path) -> None:
    run = TinyTrainer(
        max_steps=6,
        workspace=tmp_path,
        hooks=[SignalAt(state="CHECKPOINT"), CheckpointingHook(interval=2, keep_previous=1, exit_signals=[USR1])],
    )
    with pytest.raises(SystemExit):
        run.train()
    names = outline(tmp_path)
    assert names.index("saved:2") < names.index("signal_agreed:SIGUSR1")
    assert names[-3:] == ["saved:3", "finish:CHECKPOINT>EXIT", "exit:preempted:138"]
    for step in ("2", "3"):
        assert (tmp_path / "checkpoints" / step / "manifest.json").is_file()


def test_two_signals_in_a_row_are_one_preemption(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        trainer(tmp_path, SignalAt(step=2, times=2)).train()
    names = outline(tmp_path)
    assert names.count("signal_received:SIGUSR1") == 2
    assert names.count("signal_agreed:SIGUSR1") == 1
    assert names.count("saved:2") == 1 and info.value.code == 138


def test_sigterm_exits_with_143_and_a_custom_code_is_honoured(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        trainer(tmp_path / "a", SignalAt(step=2, sig=signal.SIGTERM)).train()
    assert info.value.code == 143
    with pytest.raises(SystemExit) as info:
        trainer(tmp_path / "b", SignalAt(step=2), exit_code=0).train()
    assert info.value.code == 0


def test_a_second_sigint_stops_at_once(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)  # Python's handler, or SIG_IGN in a background job
    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path, SignalAt(step=2, sig=signal.SIGINT, times=2)).train()
    assert signal.getsignal(signal.SIGINT) is before  # restored on the way out


def test_exit_wait_waits_and_a_further_signal_cuts_it_short(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(SystemExit):
        trainer(tmp_path / "a", SignalAt(step=1), exit_wait=0.3).train()
    assert time.monotonic() - started >= 0.3

    class SignalDuringWait(BaseHook):
        def on_after_train(self, trainer: Any) -> None:
            import threading

            threading.Timer(0.2, _kill_self, args=(signal.SIGTERM,)).start()

    started = time.monotonic()
    with pytest.raises(SystemExit):
        trainer(tmp_path / "b", SignalAt(step=1), SignalDuringWait(), exit_wait=30).train()
    assert time.monotonic() - started < 10


def test_handlers_are_installed_by_train_and_restored_at_exit(tmp_path: Path) -> None:
    before = signal.getsignal(USR1)
    CheckpointingHook(interval=1, exit_signals=[USR1])  # constructing installs nothing
    assert signal.getsignal(USR1) is before
    seen: list[Any] = []

    class Look(BaseHook):
        def on_before_step(self, trainer: Any) -> None:
            seen.append(signal.getsignal(USR1))

    trainer(tmp_path, Look(), steps=2).train()
    assert seen and all(h is not before and callable(h) for h in seen)
    assert signal.getsignal(USR1) is before


def test_handlers_are_restored_after_a_failure(tmp_path: Path) -> None:
    before = signal.getsignal(USR1)
    run = TinyTrainer(
        max_steps=3,
        workspace=tmp_path,
        script={2: ValueError("boom")},
        hooks=[CheckpointingHook(interval=10, exit_signals=[USR1])],
    )
    with pytest.raises(ValueError):
        run.train()
    assert signal.getsignal(USR1) is before


def test_trainer_level_signals_without_a_checkpoint_hook_exit_preempted(tmp_path: Path) -> None:
    run = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[SignalAt(step=2)])
    run.set_exit_signals([USR1], exit_code=3)
    with pytest.raises(SystemExit) as info:
        run.train()
    assert info.value.code == 3
    assert outline(tmp_path)[-3:] == ["signal_agreed:SIGUSR1", "finish:ACCUMULATE>EXIT", "exit:preempted:3"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"signals": ["USR1"]}, "exit_signals must be signal.Signals"),
        ({"signals": [USR1], "exit_code": -1}, "exit_code must be '128\\+signal' or an int in 0..255"),
        ({"signals": [USR1], "exit_wait": "soon"}, "exit_wait must be seconds >= 0"),
        ({"signals": [USR1], "requeue": "yes"}, "requeue must be True, False or 'auto'"),
        ({"signals": [USR1], "max_requeues": -2}, "max_requeues must be an int >= 0 or None"),
    ],
)
def test_bad_exit_signal_settings_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyTrainer(max_steps=1).set_exit_signals(**kwargs)


def test_slurm_job_is_detected_from_the_environment() -> None:
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_ARRAY_JOB_ID": "1200",
        "SLURM_ARRAY_TASK_ID": "7",
        "SLURM_RESTART_COUNT": "2",
        "SLURMD_NODENAME": "node1",
        "SLURM_PROCID": "0",
    }
    job = detect(env)
    assert job == SlurmJob("1234", "1200", "7", 2, "node1", "0")
    assert job.requeue_id == "1200_7"
    assert detect({}) is None


def test_malformed_job_ids_never_reach_a_command_line() -> None:
    assert valid_job_id("123") and valid_job_id("123_4")
    for bad in ("", "12;rm -rf /", "12 13", "$(id)", "12_", "_3", "-1"):
        assert not valid_job_id(bad)
    result = requeue(SlurmJob("12;touch /tmp/x", None, None, 0, None, None))
    assert not result.ok and "malformed" in result.message and result.command[-1] == "<invalid>"


def test_a_missing_scontrol_is_a_clear_result(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = requeue(SlurmJob("42", None, None, 0, None, None))
    assert not result.ok and "scontrol is not on PATH" in result.message


def test_run_start_records_the_slurm_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    TinyTrainer(max_steps=1, workspace=tmp_path).train()
    start = read_events(tmp_path)[0]
    assert start["slurm"]["job_id"] == "77" and start["slurm"]["restart_count"] == 1


def _preempted_in_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restarts: str, **policy: Any) -> dict:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    monkeypatch.setenv("PATH", str(tmp_path / "no-scontrol-here"))
    run = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[SignalAt(step=2)])
    run.set_exit_signals([USR1], **policy)
    with pytest.raises(SystemExit) as info:
        run.train()
    assert info.value.code == 138
    events = read_events(tmp_path)
    names = [e["event"] for e in events]
    assert names.index("requeue") < names.index("exit")  # decided before the exit is recorded
    return next(e for e in events if e["event"] == "requeue")


def test_a_failed_requeue_is_an_error_event_and_the_exit_still_happens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requeue = _preempted_in_slurm(tmp_path, monkeypatch, "0", requeue=True)
    assert requeue["ok"] is False and "scontrol is not on PATH" in requeue["message"]
    assert requeue["command"] == "scontrol requeue 4242"


def test_max_requeues_stops_a_job_from_requeueing_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requeue = _preempted_in_slurm(tmp_path, monkeypatch, "3", requeue=True, max_requeues=3)
    assert requeue["ok"] is False and "reached max_requeues=3" in requeue["message"]


def test_requeue_auto_outside_a_batch_job_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[SignalAt(step=2)])
    run.set_exit_signals([USR1])  # requeue="auto": scontrol cannot confirm a batch job here
    with pytest.raises(SystemExit):
        run.train()
    assert not [e for e in read_events(tmp_path) if e["event"] == "requeue"]


def test_a_run_preempted_before_any_checkpoint_starts_fresh_next_time(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        trainer(tmp_path, SignalAt(state="RESTORE")).train()
    again = trainer(tmp_path)
    again.train()
    events = [e for e in read_events(tmp_path) if e["attempt"] == 1]
    restore = next(e for e in events if e["event"] == "restore")
    assert (restore["resumed"], restore["from_step"]) == (False, 0)
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "completed" and again.step == 6


def test_run_start_records_a_signal_blocked_and_pending_when_train_began(tmp_path: Path) -> None:
    USR2 = signal.SIGUSR2
    old = signal.signal(USR2, lambda signum, frame: None)  # delivered at the unblock, harmlessly
    signal.pthread_sigmask(signal.SIG_BLOCK, [USR2])
    try:
        signal.pthread_kill(threading.get_ident(), USR2)  # to this thread: other threads may not block it
        TinyTrainer(max_steps=1, workspace=tmp_path).train()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [USR2])
        signal.signal(USR2, old)
    start = read_events(tmp_path)[0]
    assert start["event"] == "run_start"
    assert start["signals"] == {"ignored": ignored_here(), "blocked": ["SIGUSR2"], "pending": ["SIGUSR2"]}


def test_train_hands_every_held_signal_back_as_it_was(tmp_path: Path) -> None:
    mine = lambda signum, frame: None  # noqa: E731
    old = signal.signal(signal.SIGUSR2, mine)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
        trainer(tmp_path).train()
        after = {s: signal.getsignal(s) for s in before}
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert after == before


class AtStep(BaseHook):
    def __init__(self, step: int, sig: signal.Signals) -> None:
        self.at, self.sig = step, sig

    def on_before_step(self, trainer: Any) -> None:
        if trainer.step == self.at:
            _kill_self(self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, USR1])
def test_the_default_checkpoint_hook_saves_and_exits_128_plus_signal(tmp_path: Path, sig: signal.Signals) -> None:
    run = TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[CheckpointingHook(interval=100), AtStep(3, sig)])
    with pytest.raises(SystemExit) as info:
        run.train()
    assert info.value.code == 128 + sig
    names = outline(tmp_path)
    assert names[names.index(f"signal_agreed:{sig.name}") :] == [
        f"signal_agreed:{sig.name}",
        "save:ACCUMULATE>CHECKPOINT",
        "saved:3",
        "finish:CHECKPOINT>EXIT",
        f"exit:preempted:{128 + sig}",
    ]


def test_exit_signals_empty_handles_none(tmp_path: Path) -> None:
    hook = CheckpointingHook(interval=100, exit_signals=[])
    run = TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[hook])
    run.train()
    assert hook.exit_signals == () and run.exit_policy is None
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_resume_and_a_preemption_save_are_said_on_stderr_without_any_logging_set_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    silent = logging.getLogger("trainfsm.tests.silent")  # no handler anywhere on its way up
    silent.propagate = False
    hooks = [CheckpointingHook(interval=2), AtStep(3, USR1)]
    with pytest.raises(SystemExit):
        TinyTrainer(max_steps=6, workspace=tmp_path, hooks=hooks, logger=silent).train()
    # (the signal_received warning reaches stderr through Python's last-resort handler too)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trainfsm: ")]
    assert notices == [f"trainfsm: preempted: checkpoint 3 saved ({tmp_path / 'checkpoints' / '3'}); exiting 138"]
    TinyTrainer(max_steps=6, workspace=tmp_path, hooks=[CheckpointingHook(interval=2)], logger=silent).train()
    assert capsys.readouterr().err.splitlines() == [
        f"trainfsm: resumed from checkpoint 3 ({tmp_path / 'checkpoints' / '3'})"
    ]


def test_no_notice_on_stderr_when_the_logger_already_shows_the_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = logging.getLogger("trainfsm.tests.shown")
    shown.propagate = False
    shown.setLevel(logging.INFO)
    shown.addHandler(logging.StreamHandler(sys.stdout))
    try:
        TinyTrainer(max_steps=2, workspace=tmp_path, hooks=[CheckpointingHook(interval=2)], logger=shown).train()
        TinyTrainer(max_steps=4, workspace=tmp_path, hooks=[CheckpointingHook(interval=2)], logger=shown).train()
    finally:
        shown.handlers.clear()
    captured = capsys.readouterr()
    assert "trainfsm:" not in captured.err
    assert "Resuming from checkpoint 2 (attempt 1)" in captured.out  # the resume, as the console says it


def test_a_ctrl_c_while_the_machine_is_set_up_is_recorded_as_the_runs_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT is not an exit signal here (a KeyboardInterrupt, as in trainloop). One that lands
    after the trail opened, while the machine compiles, is held until the machine can record it:
    the trail has the failure's transition, the exception and the exit (found by the SIGINT fault
    trial, which once hit this window)."""
    from trainfsm import machine

    compile_events = machine.TrainMachine.compile_events

    def interrupted(self: Any, *args: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # delivered by now, unless held
        compile_events(self, *args)

    monkeypatch.setattr(machine.TrainMachine, "compile_events", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # tests start with SIGINT ignored
    try:
        trainer = TinyTrainer(max_steps=3, workspace=tmp_path)
        trainer.set_exit_signals([signal.SIGTERM])
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        signal.signal(signal.SIGINT, previous)
    events = read_events(tmp_path)
    assert [e["event"] for e in events] == ["run_start", "exception", "transition", "exit"]
    assert (events[1]["type"], events[2]["trigger"], events[2]["dest"]) == ("KeyboardInterrupt", "fail", "EXIT")
