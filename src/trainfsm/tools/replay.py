"""One rank's attempt replayed against the machine's table: ``Replay`` folds the attempt's records
into a ``RankAttempt`` (what the rank did) and records a ``Problem`` for each line that breaks a rule.

The rules (rows of the table, the step numbers, the state each event was written in) are those of
``trainfsm.tools.audit``, which reads the trail, runs one replay per (attempt, rank) and compares
the replays across ranks and attempts. What a replay gives (``Problem``, ``RankAttempt``) is in
``trainfsm.tools.rank_attempt``; the stall watchdog's events are folded by ``trainfsm.tools.stall_replay``.
"""

from __future__ import annotations

from typing import Any, Final

from trainfsm import machine as fsm
from trainfsm.tools import stall_replay
from trainfsm.tools.rank_attempt import Problem, RankAttempt
from trainfsm.trail.reader import Record
from trainfsm.trail.schema import BY, EVENT_FIELDS, EXIT_REASONS

#: The machine's table as the trainer runs it: (trigger, source, dest) rows.
_TABLE: Final = frozenset(fsm.transition_rows())

#: Triggers that leave ACCUMULATE with the optimizer step applied (or skipped by the scaler).
_STEP_DONE: Final = frozenset({"stepped", "save", "finish"})
#: Events that may follow ``exit``: a signal that came while the process waited to end (its
#: ``exit_wait``, SLURM's kill after a requeue) is recorded, not lost.
AFTER_EXIT: Final = frozenset({"signal_received"})

__all__ = ["AFTER_EXIT", "Problem", "RankAttempt", "Replay"]


class Replay:
    """Folds one rank's events of one attempt into a ``RankAttempt``, recording problems on the way.

    ``state`` and ``step`` are the machine's state and the trainer's step as the replay has them;
    each event is checked against them, then applied.
    """

    def __init__(self, first: Record, problems: list[Problem], origin: str = "") -> None:
        self.origin = origin  # the rank trail (all its segments) the attempt was read from
        self.result = RankAttempt(rank=first.rank, attempt=first.attempt, file=first.file, started_at=first.ts)
        self.problems = problems
        self.state = fsm.BUILD
        self.step = 0

    def problem(self, kind: str, record: Record, message: str) -> None:
        self.problems.append(Problem(kind, message, record.file, record.line, record.rank, record.attempt))

    def feed(self, record: Record) -> None:
        result = self.result
        if result.exit is not None and record.name not in AFTER_EXIT:
            self.problem("malformed", record, f"{record.name} after the exit event of attempt {record.attempt}")
        if result.events:
            result.previous_at = result.ended_at  # a killed attempt: how long since the record before
        result.events += 1
        result.ended_at = record.ts
        result.end_line = record.line
        name = record.name
        if name == "steps":
            self._steps(record)
        elif name == "transition":
            self._transition(record)
        else:
            if BY not in record.data:  # another thread's (the watchdog's): where the trainer was, not the replay
                self._check_position(record)
            handler = _HANDLERS.get(record.name)
            if handler is not None:
                handler(self, record)
        result.end_state, result.end_step = self.state, self.step

    # ---------------------------------------------------------------- checks
    def _check_step(self, record: Record) -> None:
        if record.step == self.step or self.state == fsm.RESTORE:
            self.step = record.step  # RESTORE: the restored checkpoint's step arrives here
            return
        expected = self.step
        missing = f" (step {expected} missing)" if record.step == expected + 1 else ""
        self.problem("gap", record, f"step jumps from {expected} to {record.step}{missing}")
        self.step = record.step

    def _check_position(self, record: Record) -> None:
        self._check_step(record)
        if record.state != self.state:
            self.problem(
                "state_mismatch",
                record,
                f"{record.name} was written in {record.state}, but the replay is in {self.state} "
                f"(a transition line is missing?)",
            )
            self.state = record.state

    # ---------------------------------------------------------------- transitions
    def _transition(self, record: Record) -> None:
        data = record.data
        trigger, source, dest = data["trigger"], data["source"], data["dest"]
        if source != self.state:
            self.problem(
                "illegal_transition",
                record,
                f"{trigger}: {source} -> {dest} taken while the machine was in {self.state}",
            )
        elif (trigger, source, dest) not in _TABLE:
            self.problem("illegal_transition", record, f"{trigger}: {source} -> {dest} is not a row of the machine")
        if trigger in fsm.STEP_TAKEN_BACK:
            self._step_never_happened()
        self._check_step(record)
        if record.state != dest:
            self.problem("state_mismatch", record, f"a transition to {dest} written in state {record.state}")
        self._count(trigger, source, dest)
        self.state = dest
        if dest == fsm.STEP:  # the trainer advances its step on entering STEP, after this line
            self.step += 1
            if self.result.first_step is None:
                self._check_first_step(record)
                self.result.first_step = self.step

    def _steps(self, record: Record) -> None:
        self.steps(record.data, record.file, record.line, counted=True)

    def steps(self, data: dict[str, Any], file: str, line: int, counted: bool = False) -> None:
        """A compact run of routine steps first..step: each is ``fsm.ROUTINE_START``, ``micro - 1``
        x ``fsm.ROUTINE_NEXT``, ``fsm.ROUTINE_END``, replayed at once (they are rows of the table,
        checked at import), so auditing costs the same per record however many steps it holds.
        Called with the record's dict straight from the reader (``counted``: ``feed`` did the
        bookkeeping already); a ``Record`` is made only to point a problem at the line."""
        result = self.result
        if not counted:
            if result.exit is not None:
                self.feed(Record(file, line, data))  # says what is wrong, then replays it
                return
            if result.events:
                result.previous_at = result.ended_at
            result.events += 1
            result.ended_at = data["ts"]
            result.end_line = line
        first, last, micro = data["first"], data["step"], data["micro"]
        if self.state != fsm.STEP or first != self.step or data["state"] != fsm.STEP:
            self._steps_problems(Record(file, line, data), first, last)
        count = last - first + 1
        result.micro_batches += count * micro
        result.data.drew_steps(count * micro)
        result.steps_done += count
        result.last_step = last
        self.state = fsm.STEP
        self.step = last + 1
        if result.first_step is None:  # a trail that begins mid-attempt
            result.first_step = first
        result.end_state, result.end_step = fsm.STEP, self.step

    def _steps_problems(self, record: Record, first: int, last: int) -> None:
        if self.state != fsm.STEP:
            trigger, source, dest = fsm.ROUTINE_START
            self.problem(
                "illegal_transition",
                record,
                f"{trigger}: {source} -> {dest} (routine steps {first}-{last}) taken while the machine was in "
                f"{self.state}",
            )
        if first != self.step:
            missing = f" (step {self.step} missing)" if first == self.step + 1 else ""
            self.problem("gap", record, f"step jumps from {self.step} to {first}{missing}")
        if record.state != fsm.STEP:
            self.problem("state_mismatch", record, f"routine steps ending in STEP written in state {record.state}")

    def _step_never_happened(self) -> None:
        """A trigger of ``fsm.STEP_TAKEN_BACK`` (``max_epochs`` ran out): the step that began is taken back."""
        self.step -= 1
        if self.result.first_step == self.step + 1:
            self.result.first_step = None

    def _check_first_step(self, record: Record) -> None:
        base = self.result.resumed_from_step or 0
        if self.step != base + 1:
            where = f"the checkpoint of step {base}" if base else "a fresh start"
            self.problem("gap", record, f"the first step is {self.step}, but after {where} it must be {base + 1}")

    def _count(self, trigger: str, source: str, dest: str) -> None:
        result = self.result
        if dest == fsm.ACCUMULATE:
            result.micro_batches += 1
            result.data.drew(first_of_try=source == fsm.STEP or trigger == "retry")
        if source == fsm.ACCUMULATE and trigger in _STEP_DONE:
            result.steps_done += 1
            result.last_step = self.step
        if dest == fsm.CHECKPOINT:
            result.checkpoint_steps.append(self.step)
            result.data.entering_checkpoint(self.step)

    # ---------------------------------------------------------------- other events
    def _run_start(self, record: Record) -> None:
        data = record.data
        self.result.run_id = str(data.get("run_id", ""))  # also marks that run_start was seen
        self.result.world_size = data.get("world_size")
        self.result.format = data.get("format") if isinstance(data.get("format"), int) else None
        elastic = data.get("torchelastic")
        self.result.torchelastic = elastic if isinstance(elastic, dict) else None
        slurm = data.get("slurm")
        if isinstance(slurm, dict) and slurm.get("end_time") is not None:
            self.result.timing["job_end_at_start"] = slurm["end_time"]

    def _restore(self, record: Record) -> None:
        data = record.data
        result = self.result
        resumed = bool(data.get("resumed"))
        from_step = data.get("from_step")
        result.start = "resume" if resumed else "launch"
        result.resumed_from_step = from_step if resumed else None
        result.data.restored(resumed, from_step, record.line)
        loaded = [entry["step"] for entry in result.loaded]
        if loaded and loaded[-1] != from_step:
            self.problem("gap", record, f"restore says from_step {from_step}, the checkpoint loaded was {loaded[-1]}")
        elif not resumed and from_step:
            self.problem("gap", record, f"a fresh start (resumed=false) at step {from_step}")

    def _checkpoint_saved(self, record: Record) -> None:
        data = record.data
        self.result.saved.append(
            {
                "step": data.get("saved_step"),
                "path": data.get("path"),
                "kept": data.get("kept"),
                "asynchronous": data.get("asynchronous"),
                "bytes": data.get("bytes"),
                "checksum": data.get("checksum"),
                "data": data.get("data"),
                "ts": record.ts,
            }
        )

    def _checkpoint_loaded(self, record: Record) -> None:
        data = record.data
        self.result.loaded.append(
            {
                "step": data.get("from_step"),
                "path": data.get("path"),
                "checksum": data.get("checksum"),
                "format": data.get("format"),
            }
        )

    def _checkpoint_not_loaded(self, record: Record) -> None:
        self.result.not_loaded = True

    def _data_resumed(self, record: Record) -> None:
        self.result.data.resumed(record, self.result.loaded[-1] if self.result.loaded else {})

    def _data_layout(self, record: Record) -> None:
        self.result.data.layout = dict(record.data)

    def _epoch(self, record: Record) -> None:
        self.result.data.epoch(record)

    def _data_exhausted(self, record: Record) -> None:
        self.result.data.exhausted(record.step)

    def _batch_fingerprint(self, record: Record) -> None:
        self.result.data.fingerprint(record)

    def _checkpoint_skipped(self, record: Record) -> None:
        self.result.skipped.append({"path": record.data.get("path"), "reason": record.data.get("reason")})

    def _checkpoint_failed(self, record: Record) -> None:
        self.result.failed.append({"type": record.data.get("type"), "message": record.data.get("message")})

    def _non_finite(self, record: Record) -> None:
        if record.data.get("what") == "scaler_skip":
            self.result.scaler_skips.append(record.step)
            self.result.data.not_trained_try(record.step, "the fp16 grad scaler skipped the step")
        else:
            self.result.retries.append({"step": record.step, "retry": record.data.get("retry")})
            why = "non-finite gradients: the step ran again on the next micro-batches"
            self.result.data.not_trained_try(record.step, why)

    def _oom(self, record: Record) -> None:
        """Out of memory: RETRY runs the step's kept micro-batches again (``replays``), not drawn."""
        self.result.ooms.append({"step": record.step, **{k: record.data.get(k) for k in ("pieces", "phase", "micro")}})
        self.result.data.replaying(int(record.data.get("replays") or 0))

    def _loss_none(self, record: Record) -> None:
        result = self.result
        result.loss_none += 1
        result.loss_none_at.append(f"step {record.step} micro {record.data.get('micro')}")
        result.data.loss_none(record.step)

    def _signal_received(self, record: Record) -> None:
        data = record.data
        self.result.received.append(
            {
                "rank": record.rank,
                "signal": data.get("signal"),
                "at_step": data.get("at_step"),
                "at_state": data.get("at_state"),
                "ts": data.get("received_at", record.ts),
            }
        )

    def _signal_agreed(self, record: Record) -> None:
        self.result.agreed = {
            "signal": record.data.get("signal"),
            "step": record.data.get("agreed_step"),
            "reason": record.data.get("reason", "signal"),
        }
        self.result.timing.update(
            agreed_at=record.ts,
            step_ended_at=record.data.get("step_ended_at"),
            cause=record.data.get("reason", "signal"),
        )

    def _deadline(self, record: Record) -> None:
        data = record.data
        figures = {key: data.get(key) for key in EVENT_FIELDS["deadline"]}
        self.result.timing["deadline"] = {"step": record.step, **figures}

    def _job_end(self, record: Record) -> None:
        data = record.data  # only the fields there: a trail written before ``kill_at`` has none of its own
        self.result.timing["job_end"] = {key: data[key] for key in EVENT_FIELDS["job_end"] if key in data}

    def _preempted(self, record: Record) -> None:
        self.result.timing["preempted"] = {key: record.data.get(key) for key in EVENT_FIELDS["preempted"]}

    def _exception(self, record: Record) -> None:
        data = record.data
        self.result.exceptions.append(
            {
                "rank": record.rank,
                "type": data.get("type"),
                "message": data.get("message"),
                "file": record.file,
                "line": record.line,
            }
        )

    def _requeue(self, record: Record) -> None:
        data = record.data
        self.result.requeue = {
            "ok": data.get("ok"),
            "command": data.get("command"),
            "message": data.get("message"),
            "requeued_by": data.get("requeued_by", "trainer" if data.get("ok") else None),
        }
        self.result.requeue_line = record.line

    def _exit(self, record: Record) -> None:
        reason = record.data.get("reason")
        if reason not in EXIT_REASONS:
            self.problem("malformed", record, f"unknown exit reason {reason!r} (known: {', '.join(EXIT_REASONS)})")
        self.result.exit = {"reason": reason, "code": record.data.get("code")}
        self.result.exit_line = record.line
        self.result.timing["exit_at"] = record.ts

    def _ddp_buckets(self, record: Record) -> None:
        data = record.data
        action = data.get("action")
        if action == "not_primed":
            self.result.buckets_problem = f"not primed: {data.get('reason')}"
        elif action == "checked" and not data.get("exact"):
            self.result.buckets_problem = "DDP did not rebuild its buckets as primed"
        elif action == "checked" and data.get("same_order") is False:
            self.result.buckets_problem = "the gradients became ready in another order than in the saved run"


_HANDLERS: Final = {
    "run_start": Replay._run_start,
    "restore": Replay._restore,
    "checkpoint_saved": Replay._checkpoint_saved,
    "checkpoint_loaded": Replay._checkpoint_loaded,
    "checkpoint_skipped": Replay._checkpoint_skipped,
    "checkpoint_failed": Replay._checkpoint_failed,
    "non_finite": Replay._non_finite,
    "oom": Replay._oom,
    "loss_none": Replay._loss_none,
    "signal_received": Replay._signal_received,
    "signal_agreed": Replay._signal_agreed,
    "deadline": Replay._deadline,
    "job_end": Replay._job_end,
    "preempted": Replay._preempted,
    "exception": Replay._exception,
    "requeue": Replay._requeue,
    "exit": Replay._exit,
    "checkpoint_not_loaded": Replay._checkpoint_not_loaded,
    "data_resumed": Replay._data_resumed,
    "data_layout": Replay._data_layout,
    "epoch": Replay._epoch,
    "data_exhausted": Replay._data_exhausted,
    "batch_fingerprint": Replay._batch_fingerprint,
    "stall": stall_replay.stall,
    "stall_cleared": stall_replay.stall_cleared,
    "collective_failed": stall_replay.collective_failed,
    "ddp_buckets": Replay._ddp_buckets,
}
