"""The ``slurm_cluster`` fixture: a real one-node SLURM cluster for the test session.

``bash tests/slurm/cluster.sh start`` (which installs slurm and munge with apt-get when missing) starts it
once, and ``cluster.sh stop`` stops it when the last session using it ends: under ``make test-all`` two
pytest-xdist workers run the SLURM modules side by side (``test_job_end.py``, whose jobs wait out time
limits, apart from the rest: ``pytest_xdist_make_scheduler`` in tests/conftest.py), and a worker that is
done must not stop the cluster under the other. The sessions using it are listed (their process ids) in
a file beside the cluster's state, under a lock. A cluster that was already up before any session is used
and left running. When the cluster cannot start (not root, no apt-get, a daemon fails), the
tests that use it are skipped with the reason, or fail with the daemons' logs when ``TRAINFSM_REQUIRE_SLURM=1``
(CI sets it). Tests here are marked ``slurm``, so ``pytest -m slurm`` selects them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

CLUSTER_SH = Path(__file__).with_name("cluster.sh")

#: States a job does not leave by itself (``scontrol requeue`` aside).
FINAL_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}
)


@dataclass
class SlurmCluster:
    """A running cluster: ``env`` is the environment its clients need, ``state_dir`` holds its config and logs."""

    env: dict[str, str]
    state_dir: Path

    def run(
        self, *cmd: str, env: Mapping[str, str] | None = None, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (``scontrol requeue 7``) with the cluster's environment plus ``env``."""
        result = subprocess.run(
            cmd,
            env={**self.env, **(env or {})},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{shlex.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def sbatch(
        self,
        script: str | os.PathLike[str],
        *args: str,
        options: Collection[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Submit ``script`` with its ``args``: ``sbatch --parsable OPTIONS SCRIPT ARGS``; returns the job id.

        The job inherits the cluster's environment plus ``env`` (sbatch exports the submitter's environment)
        and, without ``--chdir`` in ``options``, runs in this process's working directory.
        """
        out = self.run("sbatch", "--parsable", *options, os.fspath(script), *args, env=env).stdout.strip()
        job_id = out.split(";")[0]  # "JOBID" or "JOBID;CLUSTER"
        if not re.fullmatch(r"\d+", job_id):
            raise AssertionError(f"sbatch printed {out!r}, not a job id")
        return job_id

    def scontrol_show(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields: ``{"JobState": "RUNNING", "Restarts": "0", "ExitCode": "0:0", ...}``."""
        line = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout.strip()
        keys = list(re.finditer(r"(?:^|\s)([A-Za-z][\w/:]*)=", line))
        ends = [key.start() for key in keys[1:]] + [len(line)]
        return {key.group(1): line[key.end() : end] for key, end in zip(keys, ends, strict=False)}

    def wait_state(self, job_id: str, states: str | Collection[str], timeout: float = 60) -> dict[str, str]:
        """Poll until the job's ``JobState`` is one of ``states``; return its fields.

        Fails at once when the job reaches another final state, and after ``timeout`` seconds, with the job's
        record and the daemons' logs.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            job = self.scontrol_show(job_id)
            state = job.get("JobState")
            if state in wanted:
                return job
            if state in FINAL_STATES or time.monotonic() > deadline:
                how = "ended" if state in FINAL_STATES else f"is still {state} after {timeout:g}s"
                raise AssertionError(f"job {job_id} {how}, not {sorted(wanted)}: {job}\n{self.logs()}")
            time.sleep(0.1)

    def scancel(self, job_id: str, *args: str) -> None:
        """``scancel ARGS JOBID``, e.g. ``scancel(job, "--batch", "--signal=USR1")``."""
        self.run("scancel", *args, job_id)

    def logs(self, lines: int = 20) -> str:
        """The last ``lines`` lines of each daemon's log and output, for failure messages."""
        parts = []
        for log in sorted((self.state_dir / "log").glob("*")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"---- {log}\n" + "\n".join(tail))
        return "\n".join(parts)


def _cluster_sh(command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER_SH), command],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The session's SLURM cluster (see the module doc); skips the test, or fails it in CI, when it cannot start."""

    def unavailable(reason: str, details: str = "") -> NoReturn:
        if os.environ.get("TRAINFSM_REQUIRE_SLURM") == "1":
            pytest.fail(f"TRAINFSM_REQUIRE_SLURM=1, but {reason}\n{details}".rstrip(), pytrace=False)
        pytest.skip(reason)

    if sys.platform != "linux" or os.geteuid() != 0:
        unavailable("the SLURM test cluster needs Linux and root")
    with _users() as users:
        if not users["sessions"]:  # the first session (of those alive) decides who stops it
            users["ours"] = _cluster_sh("status").returncode != 0
        start = _cluster_sh("start", timeout=900)  # a no-op when it is up
        if start.returncode == 0:
            users["sessions"].append(os.getpid())
    if start.returncode != 0:
        last = start.stderr.strip().splitlines()[-1:] or [f"exit code {start.returncode}"]
        unavailable(f"cluster.sh start: {re.sub(r'^cluster.sh [0-9:]+: ', '', last[0])}", start.stderr)

    # Only SLURM_CONF from cluster.sh: no SLURM_*/SBATCH_* of an outer job (CI inside SLURM) may leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
    for line in _cluster_sh("env").stdout.splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            key, _, value = words[1].partition("=")
            env[key] = value
    yield SlurmCluster(env=env, state_dir=Path(env["SLURM_CONF"]).parent.parent)

    with _users() as users:
        users["sessions"].remove(os.getpid())
        if not users["sessions"] and users["ours"]:
            stop = _cluster_sh("stop", timeout=120)
            assert stop.returncode == 0, f"cluster.sh stop failed:\n{stop.stderr}"


#: The sessions using the cluster: ``{"ours": started by a session (so the last one stops it),
#: "sessions": [process ids]}``, beside the cluster's state directory (cluster.sh's default).
USERS = Path(os.environ.get("TRAINFSM_SLURM_DIR", "/tmp/trainfsm-slurm") + ".users.json")


@contextmanager
def _users() -> Iterator[dict[str, Any]]:
    """The sessions using the cluster, read and written under an exclusive lock; sessions whose
    process is gone (a worker killed by pytest-timeout) are dropped."""
    with open(USERS.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            users = json.loads(USERS.read_text()) if USERS.exists() else {}
        except ValueError:
            users = {}
        users = {"ours": bool(users.get("ours")), "sessions": [p for p in users.get("sessions", []) if _alive(p)]}
        yield users
        USERS.write_text(json.dumps(users))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
