"""A SLURM batch job for a test's own process, without a cluster: ``SLURM_JOB_ID`` and a stand-in
``scontrol`` on PATH that says the job ends when the test wants, and logs every call (the real
cluster's tests are in tests/slurm/)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

SCONTROL = """#!/bin/sh
# A stand-in for SLURM's scontrol: "show job -o ID" prints EndTime from $FAKE_SLURM/end (epoch seconds
# when SLURM_TIME_FORMAT=%s, else SLURM's default local time), "requeue ID" is logged and SIGTERM
# follows, as from SLURM. Every call is logged too.
# With $FAKE_SLURM/down present it fails as scontrol does when slurmctld does not answer.
echo "$SLURM_TIME_FORMAT|$*" >>"$FAKE_SLURM/calls"
if [ -e "$FAKE_SLURM/down" ]; then
  echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2
  exit 1
fi
case "$1" in
show)
  end=$(cat "$FAKE_SLURM/end")
  [ "$SLURM_TIME_FORMAT" = "%s" ] || end=$(date -d "@$end" +%Y-%m-%dT%H:%M:%S)
  echo "JobId=$4 JobName=fake JobState=RUNNING BatchFlag=1 TimeLimit=00:01:00 StartTime=0 EndTime=$end"
  ;;
requeue)
  echo "$2" >>"$FAKE_SLURM/requeued"
  # SLURM then sends the job SIGTERM; here only to a caller that catches it (SigCgt bit 14), as a
  # trainer whose exit signals name SIGTERM does: the test's own process must not die of it.
  caught=$(awk '/^SigCgt:/ { print $2 }' "/proc/$PPID/status")
  if [ $(( (0x$caught >> 14) & 1 )) = 1 ]; then kill -TERM "$PPID"; fi
  ;;
esac
"""


class FakeSlurm:
    """A SLURM batch job 4242 for this process: SLURM_JOB_ID and an ``scontrol`` on PATH."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = directory
        (directory / "bin").mkdir(parents=True)
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
        (self.dir / "end").write_text(str(end))
        return float(end)

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

    def requeued(self) -> list[str]:
        path = self.dir / "requeued"
        return path.read_text().splitlines() if path.exists() else []
