"""A SLURM batch job for a test's own process, without a cluster: ``SLURM_JOB_ID`` and a stand-in
``scontrol`` on PATH that says the job ends when the test wants, and logs every call (the real
cluster's tests are in tests/slurm/).

Besides the job's end, a test can set what a preemption by another job changes (issue 47):
``set_job`` (``JobState``, ``Restarts``, ``PreemptTime``, ``Partition``, by SLURM's field names),
``preempt`` (SLURM chose the job: ``PreemptTime`` now, the end moved to the grace time's end),
``add_partition`` (its ``PreemptMode`` and ``GraceTime`` for ``show partition``), ``set_kill_wait``
(``show config``), and ``requeue_fails`` (``scontrol requeue`` answers as SLURM does once it has
requeued the job itself). The shapes of the lines are those of SLURM 22.05.8 on the project's cluster.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

SCONTROL = r"""#!/bin/sh
# A stand-in for SLURM's scontrol. Every call is logged ($FAKE_SLURM/calls; with its time: call_times).
#   show job -o ID        EndTime from $FAKE_SLURM/end, the other fields from $FAKE_SLURM/job/<Field>
#                         (JobState RUNNING, Restarts 0, PreemptTime None, no Partition unless set);
#                         times in epoch seconds when SLURM_TIME_FORMAT=%s, else SLURM's default local time
#   show partition -o P   PreemptMode and GraceTime from $FAKE_SLURM/partition/P; an error if there is none
#   show config           KillWait from $FAKE_SLURM/killwait, if there is one
#   requeue ID            logged ($FAKE_SLURM/requeued) and SIGTERM follows, as from SLURM; with
#                         $FAKE_SLURM/requeue_error it fails with that message instead, after copying
#                         $FAKE_SLURM/requeue_then/* over the job's fields (SLURM requeued the job itself)
# With $FAKE_SLURM/down present every call fails as scontrol does when slurmctld does not answer.
echo "$SLURM_TIME_FORMAT|$*" >>"$FAKE_SLURM/calls"
echo "$(date +%s.%N) $SLURM_TIME_FORMAT|$*" >>"$FAKE_SLURM/call_times"
if [ -e "$FAKE_SLURM/down" ]; then
  echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2
  exit 1
fi
when() {  # an epoch time as this scontrol's caller asked for it; words (None, Unknown) as they are
  case "$1" in
  '' | *[!0-9]*) echo "$1" ;;
  *) if [ "$SLURM_TIME_FORMAT" = "%s" ]; then echo "$1"; else date -d "@$1" +%Y-%m-%dT%H:%M:%S; fi ;;
  esac
}
field() {  # field NAME DEFAULT
  if [ -e "$FAKE_SLURM/job/$1" ]; then cat "$FAKE_SLURM/job/$1"; else echo "$2"; fi
}
case "$1 $2" in
"show job")
  end=$(when "$(cat "$FAKE_SLURM/end")")
  preempt=$(when "$(field PreemptTime None)")
  partition=$(field Partition "")
  echo "JobId=$4 JobName=fake JobState=$(field JobState RUNNING) Reason=None Requeue=1" \
    "Restarts=$(field Restarts 0) BatchFlag=1 TimeLimit=00:01:00 StartTime=0 EndTime=$end Deadline=N/A" \
    "PreemptEligibleTime=0 PreemptTime=$preempt${partition:+ Partition=$partition}"
  ;;
"show partition")
  if [ ! -e "$FAKE_SLURM/partition/$4" ]; then
    echo "Partition $4 not found" >&2
    exit 1
  fi
  echo "PartitionName=$4 AllowGroups=ALL Default=NO $(cat "$FAKE_SLURM/partition/$4") State=UP TotalCPUs=10"
  ;;
"show config")
  echo "Configuration data as of $(date +%Y-%m-%dT%H:%M:%S)"
  echo "KillOnBadExit           = 0"
  if [ -e "$FAKE_SLURM/killwait" ]; then echo "KillWait                = $(cat "$FAKE_SLURM/killwait") sec"; fi
  echo "LaunchType              = launch/slurm"
  ;;
requeue*)
  if [ -e "$FAKE_SLURM/requeue_error" ]; then
    if [ -d "$FAKE_SLURM/requeue_then" ]; then cp "$FAKE_SLURM"/requeue_then/* "$FAKE_SLURM/job/"; fi
    echo "$(cat "$FAKE_SLURM/requeue_error") for job $2" >&2
    exit 1
  fi
  echo "$2" >>"$FAKE_SLURM/requeued"
  # SLURM then sends the job SIGTERM, 4-14 ms after the requeue (measured on the project's
  # cluster): here 20 ms after, from the background, and only to a caller that catches it (SigCgt
  # bit 14), as a trainer whose exit signals name SIGTERM does: the test's own process must not die of it.
  caller=$PPID
  caught=$(awk '/^SigCgt:/ { print $2 }' "/proc/$caller/status")
  if [ $(( (0x$caught >> 14) & 1 )) = 1 ]; then (sleep 0.02; kill -TERM "$caller") >/dev/null 2>&1 & fi
  ;;
esac
"""

#: What ``scontrol requeue`` says of a job SLURM has requeued itself (SLURM 22.05.8, followed by
#: " for job ID"): under ``PreemptMode=REQUEUE`` the trainer's own requeue always meets it.
PENDING_EXECUTION = "Job is pending execution"


class FakeSlurm:
    """A SLURM batch job 4242 for this process: SLURM_JOB_ID and an ``scontrol`` on PATH."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = directory
        for sub in ("bin", "job", "partition"):
            (directory / sub).mkdir(parents=True)
        scontrol = directory / "bin" / "scontrol"
        scontrol.write_text(SCONTROL)
        scontrol.chmod(0o755)
        monkeypatch.setenv("PATH", f"{directory / 'bin'}:{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_SLURM", str(directory))
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)

    def end_in(self, seconds: float) -> float:
        """The job ends ``seconds`` from now (whole seconds, as SLURM says it); returns the end."""
        return self.end_at(time.time() + seconds)

    def end_at(self, when: float) -> float:
        """The job ends at ``when`` (epoch seconds, rounded down to SLURM's whole seconds); returns the end."""
        end = math.floor(when)
        _write(self.dir / "end", str(end))
        return float(end)

    def set_job(self, **fields: str | int | float | None) -> None:
        """``show job`` says these fields from now on, by SLURM's names: ``JobState``, ``Restarts``,
        ``PreemptTime`` (epoch seconds), ``Partition``; None: the field as it was at the start."""
        for name, value in fields.items():
            path = self.dir / "job" / name
            if value is None:
                path.unlink(missing_ok=True)
            else:
                _write(path, str(math.floor(value)) if isinstance(value, float) else str(value))

    def preempt(self, grace_time: int) -> float:
        """SLURM chooses the job for preemption now: ``PreemptTime`` now and the job's end moved to
        it plus ``grace_time``, as SLURM does at once; the job goes on RUNNING. Returns PreemptTime."""
        now = float(math.floor(time.time()))
        self.end_at(now + grace_time)  # first: a read in between must not see a PreemptTime with the old end
        self.set_job(PreemptTime=now)
        return now

    def add_partition(self, name: str, preempt_mode: str, grace_time: int) -> None:
        """A partition ``show partition -o NAME`` knows (the job is in it once ``set_job(Partition=NAME)``)."""
        _write(self.dir / "partition" / name, f"GraceTime={grace_time} PreemptMode={preempt_mode}")

    def set_kill_wait(self, seconds: int | None) -> None:
        """``show config`` says ``KillWait = SECONDS sec``; None: it says no KillWait at all."""
        path = self.dir / "killwait"
        if seconds is None:
            path.unlink(missing_ok=True)
        else:
            _write(path, str(seconds))

    def requeue_fails(self, message: str = PENDING_EXECUTION, **then: str | int) -> None:
        """From now on ``scontrol requeue`` fails with ``message`` (" for job ID" added, as SLURM does)
        and no SIGTERM follows; ``then``: the job's fields (``set_job``) as SLURM has them from that
        call on, e.g. ``JobState="PENDING", Restarts=1`` for a job SLURM requeued meanwhile."""
        (self.dir / "requeue_error").write_text(message)
        if then:
            later = self.dir / "requeue_then"
            later.mkdir(exist_ok=True)
            for name, value in then.items():
                (later / name).write_text(str(value))

    def controller_down(self, down: bool = True) -> None:
        """From now on every ``scontrol`` call fails (``down``), or answers again."""
        flag = self.dir / "down"
        if down:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def calls(self) -> list[str]:
        path = self.dir / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def call_times(self) -> list[tuple[float, str]]:
        """``calls()`` with the time of each (epoch seconds)."""
        path = self.dir / "call_times"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(float(at), call) for at, call in (line.split(" ", 1) for line in lines)]

    def requeued(self) -> list[str]:
        """The job ids of the requeues that succeeded."""
        path = self.dir / "requeued"
        return path.read_text().splitlines() if path.exists() else []


def _write(path: Path, text: str) -> None:
    """``path`` holds ``text`` at once: the stand-in ``scontrol`` runs on other threads' reads
    meanwhile and must never see the file empty half-way through a write."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)
