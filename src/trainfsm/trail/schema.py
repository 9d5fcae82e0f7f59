"""The audit trail's schema: what the runtime writes and the offline tools read.

One JSON object per line, per rank, in ``WORKSPACE/logs/events.rank{R}.jsonl`` (rotated into
segments: ``trainfsm.trail.files``). Every event carries ``ts`` (seconds since the epoch),
``event``, ``rank``, ``step``, ``state``, ``run_id`` and ``attempt``; ``EVENT_FIELDS`` lists each
event's own fields. The writer is ``trainfsm.trail.writer``, the reader ``trainfsm.trail.reader``, what
the console says of each event ``trainfsm.trail.sentences``. No torch and no structlog here: the
offline commands import this.
"""

from __future__ import annotations

import uuid
from typing import Any, Final

from trainfsm.machine import ExitReason

#: 4: the data ledger across world sizes (``data_layout``, ``data_resumed``'s ``from_world_size``,
#: ``global``, ``exact``, ``approximate`` and ``rng``, ``checkpoint_saved.data.global``,
#: ``epoch.fingerprint``, ``batch_fingerprint`` at exiting saves); 3: the data ledger
#: (``checkpoint_saved.data``, ``checkpoint_loaded.checksum``, ``data_resumed.from_step``,
#: ``batch_fingerprint``); 2: routine steps are written as compact ``steps`` records (1: every
#: transition verbatim). The readers take all four; ``trainfsm audit``
#: says that it cannot check the ledger of attempts written without it.
FORMAT_VERSION: Final = 4
READABLE_FORMATS: Final = (1, 2, 3, 4)


def _names(fields: str) -> tuple[str, ...]:
    return tuple(fields.split())


#: Event name -> the fields it adds to the common ones (a long list as one string of names).
EVENT_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "run_start": ("format", "versions", "world_size", "max_steps", "config", "signals", "torchelastic", "trail"),
    "transition": ("trigger", "source", "dest"),
    # Routine steps first..step (``step`` is the last), each ``micro`` micro-batches long: ``ts`` is
    # the last step's end, ``dt`` each step's duration in integer microseconds (from the previous
    # step's end; the first's from its own start, which is ``ts`` less the sum of ``dt``).
    "steps": ("first", "micro", "dt"),
    "restore": ("resumed", "from_step"),
    "data_layout": _names(
        "order why world_size rank batch_size length seed shuffle epoch_batches global_batch accumulation epoch_samples"
    ),
    "epoch": ("epoch", "fingerprint"),
    "data_resumed": _names(
        "mode why epoch batches positioned seconds from_step from_world_size global exact approximate rng"
    ),
    "batch_fingerprint": ("after", "from_step", "epoch", "batches", "fingerprint"),
    "data_exhausted": ("epochs", "dropped_micro_batches"),
    "metrics": ("values",),
    "loss_none": ("micro", "ranks"),
    "non_finite": ("what", "retry", "max", "scale"),
    "oom": ("micro", "phase", "rows", "pieces", "piece_rows", "replays", "retry", "max", "ranks", "message"),
    "checkpoint_saved": _names(
        "path saved_step bytes seconds checksum kept asynchronous sharded direct_io chosen_by rates data"
    ),
    "checkpoint_loaded": ("path", "from_step", "sharded", "format", "checksum"),
    "checkpoint_not_loaded": ("reason",),
    "ddp_buckets": ("action", "module", "fingerprint", "passes", "rebuilt", "same_order", "exact", "reason"),
    "checkpoint_skipped": ("path", "reason"),
    "checkpoint_foreign": ("found",),
    "checkpoint_not_newest": ("path", "from_step", "newest", "newest_step"),
    "checkpoint_pruned": ("paths",),
    "checkpoint_tmp_removed": ("names",),
    "checkpoint_tmp_completed": ("names",),
    "checkpoint_store_ready": ("seconds", "direct_io", "chosen_by", "rates"),
    "checkpoint_room_reserved": ("bytes", "allocated", "seconds", "complete"),
    "checkpoint_failed": ("type", "message"),
    "signal_received": ("signal", "received_at", "at_step", "at_state"),
    "signal_agreed": ("signal", "agreed_step", "reason", "step_ended_at"),
    "deadline": _names(
        "end_time decided_at left needed steps step_seconds save_seconds save_measured write_seconds exit_seconds "
        "margin"
    ),
    "job_end": _names("end_time read_at after applied kill_start kill_wait kill_at job_state restarts"),
    "preempted": ("preempt_time", "grace_end", "grace_time", "mode", "read_at", "noticed_at"),
    "signal_passed_on": ("signal", "received_at", "at_state", "disposition"),
    "signals_not_installed": ("reason",),
    "launcher_stop": ("pid", "signal", "at"),
    "restart_stop": ("signal",),
    "requeue": ("command", "ok", "message", "requeued_by"),
    "wandb_run": ("wandb_id", "continued", "mode"),
    "early_stop": ("monitor", "best", "best_step", "bad_evaluations", "patience"),
    "cuda_memory_unavailable": ("device",),
    "collective_failed": ("note", "trails"),
    "group_outlives_destroy": ("cause",),
    "stall": ("micro", "seconds", "budget", "report", "action", "doing", "collective", "hook", "stack", "by"),
    "stall_cleared": ("seconds", "reports", "stalled_state", "stalled_step", "by"),
    "exception": ("type", "message", "traceback"),
    "exit": ("reason", "code"),
}

#: The field of an event written by another thread while the trainer's thread was stuck (the
#: stall watchdog's ``stall``, ``stall_cleared``, and with ``stall_action="exit"`` its ``requeue``
#: and ``exit``): ``"by": "watchdog"``. Such an event may come before transitions the trainer's
#: thread had recorded but not yet written, so the audit does not check its step and state against
#: its replay (they are the trainer's, read by the watchdog).
BY: Final = "by"
WATCHDOG: Final = "watchdog"

#: The fields every event carries -> what they mean (the reference page is built from this).
COMMON_FIELDS: Final[dict[str, str]] = {
    "ts": "seconds since the epoch",
    "event": "the event's name",
    "rank": "the process's rank (0 without `torch.distributed`)",
    "step": "the trainer's step when it happened (the step being run, once STEP was entered)",
    "state": "the machine's state when it happened (for a transition: the state it entered)",
    "run_id": "the same for every launch of one run (read back from the trail on resume)",
    "attempt": "0 for the first launch, +1 per resume",
}

#: Event name -> (its fields, explained; when it is written). The docs' event reference is built
#: from this and ``EVENT_FIELDS``; ``tests/test_events.py`` checks that both name the same events.
EVENT_DOCS: Final[dict[str, tuple[str, str]]] = {
    "run_start": (
        "`format` (2; 1 for trails before `steps` records), `trail` (`form`, `flush_seconds`, `segment_bytes`), "
        "`versions`, `world_size`, `max_steps`, `config`, `slurm` (job id, array task, restart count, node, "
        "rank, `end_time`: the job's end in epoch seconds as SLURM had it, read by rank 0, null on other ranks "
        "or without a time limit, `partition`, its `preempt_mode` and `grace_time` (seconds), and "
        "`preempt_time` when SLURM had chosen the job for preemption already, all read by rank 0; or null), "
        "`signals` (`ignored`, `blocked`, `pending`: of SIGHUP, SIGINT, "
        "SIGTERM, SIGUSR1, SIGUSR2 and the trainer's own exit signals, when `train()` began), `torchelastic` "
        "(torchrun's `restart_count` as this node's agent counts it, `max_restarts`, `run_id`, and `group`: the "
        "number of the group `init_distributed` joined, the same on every node, 1 for the first; or null)",
        "`train()` starts",
    ),
    "transition": (
        "`trigger`, `source`, `dest`",
        'every transition of the machine that is not part of a routine step (with `trail_form="full"`: every one)',
    ),
    "steps": (
        "`first`, `micro`, `dt`; `step` is the last of the run, `state` STEP, `ts` the last step's end",
        "routine steps `first`..`step`, each of `micro` micro-batches, written as one record; `dt`: each "
        "step's duration in integer microseconds (the first from its own start, the rest from the previous "
        "step's end)",
    ),
    "restore": ("`resumed`, `from_step`", "RESTORE begins: fresh start or resumed"),
    "data_layout": (
        "`order` (`distributed`: the loader draws from a `DistributedSampler` of this rank and world size, so "
        "rank r's micro-batch k of an epoch holds positions (k*B + j)*W + r, j < B, of the epoch's order; "
        "`unknown`: `why`), `world_size` (W), `rank`, `batch_size` (B, per rank), `length` (N, samples), "
        "`seed`, `shuffle`, `epoch_batches` (this rank's micro-batches per epoch), `global_batch` "
        "(`global_batch_size` or null), `accumulation`, `epoch_samples` (positions trained per epoch by all ranks)",
        "RESTORE begins, just before `restore` (each rank, DEBUG): how this rank's micro-batches map onto each "
        "epoch's order of samples",
    ),
    "epoch": (
        "`epoch`, `fingerprint` (of its first batch, as `batch_fingerprint`'s)",
        "a new epoch's first batch was drawn (DEBUG; the first epoch's too)",
    ),
    "data_resumed": (
        "`mode` (`state`, `sampler`, `skip`, `none`), `why`, `epoch`, `batches` (of the epoch already used, "
        "this rank's micro-batches), `positioned` (batches skipped at the sampler or replayed), `seconds`, "
        "`from_step` (the checkpoint's step), `from_world_size` (the saving run's; null if unknown), `global` "
        "(`{epoch, samples}`: the position in the epoch's order it continues from, or null), `exact` (false: "
        "the position is an approximation the user accepted, `approximate` says why), `rng` (whose random "
        "streams this rank continues: its own, an old rank's, or seeded for a rank the saving run lacked)",
        "RESTORE put the data iterator back where the checkpoint was",
    ),
    "batch_fingerprint": (
        "`after` (`save` or `resume`), `from_step` (the checkpoint's step), `epoch`, "
        "`batches` (the position after drawing it), `fingerprint` (a hash of the batch's contents; `batches` and "
        "`fingerprint` null: at an exiting save, the batch did not come within `EXIT_DRAW_SECONDS`, 1 s)",
        "the first batch drawn after a save (when the run leaves after it, drawn then and not trained), after "
        "a resume (each rank): the data ledger checks that a resumed run draws the batch the saving run "
        "would have drawn next (and names where it began when not, from the `epoch` events)",
    ),
    "data_exhausted": (
        "`epochs`, `dropped_micro_batches`",
        "`max_epochs` epochs are done: the run ends (`exhausted`)",
    ),
    "metrics": (
        "`values` (`train/loss`, `train/lr/<group>`, `train/grad_norm`, ..., `train/<record>`: `LoggingHook`'s "
        "records with keys joined by `/`)",
        "`LoggingHook`'s interval averages (DEBUG)",
    ),
    "loss_none": (
        "`micro`, `ranks`",
        "`forward` returned `loss=None` (on the rank(s) in `ranks`): every rank skipped the micro-batch",
    ),
    "non_finite": (
        "`what`, `retry`, `max`, `scale`",
        'non-finite gradients: `what="gradients"` (a RETRY) or `"scaler_skip"` (fp16, with the scale that overflowed)',
    ),
    "oom": (
        "`micro`, `phase` (`forward` or `backward`), `rows` (the failed piece's samples), `pieces` (per drawn "
        "micro-batch from now on), `piece_rows`, `replays` (kept micro-batches the retry runs again, not drawn), "
        "`retry`, `max` (`max_oom_retries`), `ranks` (with DDP over several ranks: those that ran out; `micro` and "
        "`phase` are null on the others), `message`",
        "out of device memory in a micro-batch: the step runs again from its first micro-batch, each split in two "
        "(RETRY by `oom`); the split stays for the rest of the run",
    ),
    "checkpoint_saved": (
        "`path`, `saved_step`, `bytes`, `seconds`, `checksum` (of the manifest), `kept`, `asynchronous` "
        "(+ `blocked_seconds`), `sharded`, `direct_io` (its files went past the page cache), `chosen_by` and "
        "`rates` (why its largest file was written that way, as in `checkpoint_store_ready`; `chosen_by` may "
        "also be `saves`: the faster by earlier files of its size, or `trying the other way`: for one file; "
        "`rates.saves` are of files of its size), `data` (the data "
        "positions saved: `{epoch, batches}` when every rank's is the same, else `{ranks: [[epoch, batches], "
        "...]}`; null when unknown)",
        "a checkpoint is durable",
    ),
    "checkpoint_loaded": (
        "`path`, `from_step`, `sharded`, `format` (`trainfsm`, or `trainloop`: a checkpoint trainloop wrote), "
        "`checksum` (its manifest's, as `checkpoint_saved` recorded it; null for trainloop's)",
        "RESTORE loaded a checkpoint",
    ),
    "ddp_buckets": (
        "`action`: `recorded` (the order in which the gradients became ready at the backward DDP rebuilds its "
        "buckets from, known: `fingerprint` of the layout it gives), `primed` (RESTORE took the resumed DDP "
        "through `passes` zero backwards in the checkpoint's order, so that it rebuilds the saved layout, "
        "`fingerprint`, at its first forward), `checked` (after the first real backward that followed: "
        "`rebuilt` as it had to, `same_order`: the gradients became ready in the saved order, `exact`), or "
        "`not_primed` (`reason`: the model changed, or torch lacks what priming needs; the resume is not "
        'bit-exact with more than two ranks). `module`: the DDP\'s path in the model (`""`: the model itself). '
        "Fields an action does not set are null",
        "a DDP model with several ranks: once per attempt (`recorded` or `primed` then `checked`), from "
        "`trainfsm.ddp_buckets`; `recorded` and a `checked` that found nothing wrong are DEBUG (the trail only), "
        "a failed `checked` and `not_primed` are warnings",
    ),
    "checkpoint_not_loaded": (
        "`reason` (`load=None`)",
        "RESTORE did not look for a checkpoint because `CheckpointingHook(load=None)` said so: a fresh start "
        "the data ledger does not count as lost work",
    ),
    "checkpoint_foreign": (
        "`found` (directory name -> `trainloop` or `unknown`)",
        "RESTORE found step directories trainfsm did not write: never replaced or pruned (rank 0)",
    ),
    "checkpoint_not_newest": (
        "`path`, `from_step`, `newest`, `newest_step`",
        'a named checkpoint (`load="best"`, a path) loaded while a newer complete one exists (rank 0)',
    ),
    "checkpoint_skipped": (
        "`path`, `reason`",
        '`load="latest"` passed over an incomplete or corrupt checkpoint',
    ),
    "checkpoint_pruned": ("`paths`", "old checkpoints deleted after a save"),
    "checkpoint_tmp_removed": ("`names`", "leftovers of an interrupted save deleted in RESTORE"),
    "checkpoint_tmp_completed": (
        "`names`",
        "checkpoints an interrupted save left complete but not yet renamed into place (a re-saved step's new "
        "copy among them), renamed into place in RESTORE instead of deleted",
    ),
    "checkpoint_store_ready": (
        "`seconds`, `direct_io` (the way a file of a size not saved yet will be written: past the page cache "
        "or through it; each file's way is chosen by its size when it is saved), "
        "`chosen_by` (`measurement`, `direct_io=True`, `direct_io=False`, or `O_DIRECT refused`: the file system "
        "refused it), `rates` (GB/s measured on the checkpoint's file system: `probe` and, later, `saves`, each "
        "with `page_cache` and `o_direct`, null where not measured; null when forced)",
        "RESTORE prepared the store's writer (its thread and staging buffers, the serializer's imports, the "
        "way to write), so that the first save does none of it (DEBUG)",
    ),
    "checkpoint_room_reserved": (
        "`bytes` (written), `allocated` (allocated without writing), `seconds`, `complete` (false: an exit "
        "signal stopped it, and the run leaves at RESTORE's end)",
        "RESTORE took the room of the checkpoints the run holds at once (keep_previous + 2 sets of files as "
        "large as a save's model and optimizer state), less what the checkpoints on disk and the files kept "
        "for recycling hold: written on a fresh start, so that the first saves write over allocated blocks as "
        "later saves write over pruned checkpoints' files; allocated without writing on a restart; a disk "
        "without room for the run's checkpoints fails here (DEBUG)",
    ),
    "checkpoint_failed": (
        "`type`, `message`",
        "an asynchronous save failed (the run then fails: at the next step, or for a sharded save at the "
        "next checkpoint or EXIT)",
    ),
    "signal_received": (
        "`signal`, `received_at`, `at_step`, `at_state`",
        "an exit signal arrived (logged at the next safe point, not in the handler; one that came during "
        "EXIT's last lines or `exit_wait` follows the `exit` event, the one event that may)",
    ),
    "signal_agreed": (
        "`signal`, `agreed_step`, `reason` (`signal`; `deadline`: the job's end, not a signal, and `signal` "
        "is the exit policy's first, whose exit code the run takes; `preemption`: SLURM chose the job for "
        "preemption, seen by rank 0 in the job's `PreemptTime`), `step_ended_at` (epoch seconds: when "
        "this rank's step ended, before the ranks agreed; null on a rank that had nothing pending itself)",
        "all ranks agreed a signal is pending: checkpoint at this step, then EXIT",
    ),
    "deadline": (
        "`end_time` (the job's end, epoch seconds), `decided_at`, `left` (seconds to the end then), `needed` "
        "(what the way out takes: `steps` x `step_seconds` + `save_seconds` + `write_seconds` + `exit_seconds` + "
        "`margin`), `steps`, `step_seconds` (the slowest recent step), `save_seconds` (the slowest save of the "
        "attempt, or an estimate from the state's bytes when `save_measured` is false), `save_measured`, "
        "`write_seconds` (with `async_save`: the slowest background write, which EXIT waits for, plus what a "
        "write in flight still has to write; 0 for synchronous saves), `exit_seconds`, `margin` (`job_end_margin`)",
        "under SLURM with a time limit, rank 0's watchdog found the time left too short for the way out and "
        "raised the preemption's pending signal (`trainfsm.preemption.deadline`); written at the step's end, "
        "just before `signal_agreed` (reason `deadline`)",
    ),
    "job_end": (
        "`end_time` (SLURM's `EndTime`, epoch seconds, or null when SLURM did not say), `read_at`, `after` "
        "(`signal`, `deadline` or `preemption`), the deadline that applied: `applied` (`grace_time`: preempted, "
        "in its grace time; `kill_wait`: SLURM's kill had begun at the signal, a requeue, cancel or time limit; "
        "`time_limit`: a signal ahead of the time limit), `kill_start` (when SLURM's SIGTERM comes or came), "
        "`kill_wait` (the cluster's `KillWait`), `kill_at` (`kill_start` + `kill_wait`: when SIGKILL may "
        "come), and `job_state`, `restarts` as read",
        "a preempted run under SLURM: the job as SLURM has it after the signal, read by rank 0, written in EXIT "
        "before the requeue; `trainfsm audit` reports the margin left at exit against `kill_at`",
    ),
    "preempted": (
        "`preempt_time` (when SLURM chose the job for preemption), `grace_end` (its `EndTime` then: "
        "`preempt_time` + the grace time), `grace_time`, `mode` (the partition's `PreemptMode`), `read_at` "
        "(when rank 0 read it), `noticed_at` (when the trainer took it)",
        "rank 0 saw a `PreemptTime` in the job (SLURM signals an `exec python` batch job only when the grace "
        "time is over): the run leaves as on the exit policy's first signal; written before `signal_agreed` "
        "(reason `preemption`), or in EXIT when a signal had already taken the run out",
    ),
    "signals_not_installed": (
        "`reason`",
        "`train()` runs outside the main thread, where Python cannot install signal handlers: exit signals "
        "keep their own behaviour for this run",
    ),
    "signal_passed_on": (
        "`signal`, `received_at`, `at_state`, `disposition` (`default`, `ignored`, `handler`)",
        "a signal held in BUILD that the exit policy does not name: it gets its old disposition back and is "
        "raised again (`default` may end the process right after this event)",
    ),
    "launcher_stop": (
        "`pid`, `signal`, `at`",
        "EXIT, preempted by a signal that reached another rank but not this one, under torchrun: this rank "
        "sends its agent (`pid`) `signal` as its process ends (`at`), so that the agent, which received no "
        "signal, stops too instead of restarting its workers into a group that cannot form again",
    ),
    "restart_stop": (
        "`signal`",
        "under torchrun, a collective failed while `signal` was pending on this rank: the agent stopped this "
        "healthy worker to restart the group after a peer died (not a preemption: no checkpoint; the "
        "restarted group resumes from the last complete one); follows `collective_failed`",
    ),
    "requeue": (
        "`command`, `ok`, `message`, `requeued_by` (`trainer`: its `scontrol requeue` did; `slurm`: SLURM had "
        "requeued the job itself, a preemption under `PreemptMode=REQUEUE`, which the job's `Restarts` shows; "
        "null: not requeued)",
        "rank 0 ran `scontrol requeue` (or why it did not, or found SLURM had) after the checkpoint was durable",
    ),
    "wandb_run": (
        "`wandb_id`, `continued`, `mode`",
        "`WandbHook` started its wandb run (`continued`: the id kept in the workspace was resumed)",
    ),
    "early_stop": (
        "`monitor`, `best`, `best_step`, `bad_evaluations`, `patience`",
        "`EarlyStoppingHook` ran out of patience: checkpoint, then EXIT with reason `stopped`",
    ),
    "cuda_memory_unavailable": (
        "`device`",
        "`CudaMaxMemoryHook` on a trainer that does not run on CUDA (also a `CudaMemoryUnavailableWarning`)",
    ),
    "collective_failed": (
        "`note`, `trails`",
        "several ranks: this rank's error looks like a failed collective; `note` (also added to the error) "
        "says what most likely happened, `trails` which trail to read",
    ),
    "group_outlives_destroy": (
        "`cause`",
        "BUILD: torch holds the default process group (trainfsm was imported after it was created), so the "
        "process may abort at exit; also a `GroupOutlivesDestroyWarning`",
    ),
    "stall": (
        "`micro` (the micro-batch in flight), `seconds` (since the rank's last transition), `budget` (the "
        "state's, `stall_timeout`), `report` (1, then 2, 3, ... at 2x, 4x, ... the budget), `action` "
        "(`record` or `exit`), `doing` (what the rank's main thread is in, innermost first: \"the step-end "
        'signal agreement (all-reduce)", "the data loader\'s next()", "a checkpoint file write, in a '
        "checkpoint save, in hook CheckpointingHook.on_enter_checkpoint\"; null when none of the trainer's "
        "own code is on the stack: the user's), `collective` (the wait for every rank it is in, or null), "
        "`hook` (the hook method it is in, or null), `stack` (the main thread's innermost frames, "
        "`file:line function`, outermost first), `by` (`watchdog`)",
        "the stall watchdog: the rank made no transition for longer than its budget (`trainfsm.watchdog`); "
        "written from the watchdog's thread and flushed at once",
    ),
    "stall_cleared": (
        "`seconds` (how long the rank was stuck), `reports` (stall events written), `stalled_state`, "
        "`stalled_step` (where it was stuck), `by` (`watchdog`)",
        "a rank that was reported stalled made a transition again",
    ),
    "exception": ("`type`, `message`, `traceback`", "an exception, before `fail` takes the machine to EXIT"),
    "exit": (
        "`reason` (`completed`, `preempted`, `failed`, `stopped`, `interrupted`, `stalled`), `code`: the "
        "status the process exits with (the shell's `$?`): 130 for Ctrl-C (`interrupted`: Python ends "
        "itself with SIGINT), a `SystemExit`'s own code (`stopped` when 0), 75 for `stalled` (the stall "
        'watchdog ended the process, `stall_action="exit"`: written by its thread, with `by` and `repeats`, '
        "the attempt before when it stalled in the same state at the same step, so the job is not requeued, "
        "else null)",
        "the last event of a launch",
    ),
}


#: The ``exit`` event's reasons (``trainer.exit_reason``).
EXIT_REASONS: Final = tuple(reason.value for reason in ExitReason)


def transition_event(
    ts: float, step: int, trigger: str, source: str, dest: str, common: dict[str, Any]
) -> dict[str, Any]:
    """A transition as the trail holds it (``common``: rank, run_id, attempt)."""
    return {
        "ts": ts,
        "event": "transition",
        **common,
        "step": step,
        "state": dest,
        "trigger": trigger,
        "source": source,
        "dest": dest,
    }


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
