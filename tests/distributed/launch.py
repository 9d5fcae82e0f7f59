"""Start real gloo ranks as child processes, wait for them with a deadline, read their trails.

``Ranks`` starts one process per rank with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), one thread each, and this repository on PYTHONPATH. ``wait`` reports
which ranks ended with which exit code and which were still running at the deadline (killed
then, and named in ``hung``). Leaving the ``with`` block kills whatever is left, so a failing
test leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


@dataclass
class Outcome:
    codes: dict[int, int | None]
    hung: list[int]
    stderr: dict[int, str]
    seconds: dict[int, float] = field(default_factory=dict)  # from wait()'s start to each rank's end

    def describe(self) -> str:
        parts = [f"codes={self.codes} hung={self.hung} seconds={self.seconds}"]
        parts += [f"---- rank {rank} stderr (tail)\n{text[-3000:]}" for rank, text in self.stderr.items()]
        return "\n".join(parts)


class Ranks:
    """``world`` processes running ``argv(rank)``; a context manager that never leaks one."""

    def __init__(
        self,
        argv: Callable[[int], Sequence[str]],
        logs: Path,
        world: int = 2,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._err_paths: list[Path] = []
        logs.mkdir(parents=True, exist_ok=True)
        for rank in range(world):
            # stderr goes to a file, not a pipe: a chatty rank must not block on a full pipe.
            err_path = logs / f"stderr.rank{rank}.txt"
            self._err_paths.append(err_path)
            with open(err_path, "wb") as err:
                self.procs.append(
                    subprocess.Popen(
                        list(argv(rank)),
                        cwd=ROOT,
                        env=rank_env(rank, world, self.port, env),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,  # its own process group: killed as a whole below
                    )
                )

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.kill_all()

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[rank]
        if proc.poll() is None:  # only a live leader: its group id is still the one created here
            with contextlib.suppress(ProcessLookupError):  # it may have exited since poll()
                os.killpg(proc.pid, sig)  # the rank's own process group (pgid == its pid)

    def kill_all(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.kill(rank)
            proc.wait(timeout=30)

    def stderr(self, rank: int) -> str:
        return self._err_paths[rank].read_text(errors="replace")

    def wait(self, timeout: float, ranks: Iterable[int] | None = None) -> Outcome:
        """Wait up to ``timeout`` seconds for every rank (or for ``ranks``); then kill those still
        running and report them as ``hung`` (or, when ``ranks`` is given, kill the others quietly)."""
        start = time.monotonic()
        deadline = start + timeout
        waited = set(range(len(self.procs)) if ranks is None else ranks)
        ended: dict[int, float] = {}
        while not waited <= ended.keys() and time.monotonic() < deadline:
            for rank, proc in enumerate(self.procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = round(time.monotonic() - start, 2)
            time.sleep(0.02)
        hung = [rank for rank, proc in enumerate(self.procs) if proc.poll() is None and rank in waited]
        self.kill_all()
        codes = {rank: (None if rank in hung else proc.returncode) for rank, proc in enumerate(self.procs)}
        return Outcome(codes, hung, {r: self.stderr(r) for r in range(len(self.procs))}, ended)


def run_worker(
    scenario: str,
    out: Path,
    timeout: float,
    *args: str,
    world: int = 2,
    ranks: Iterable[int] | None = None,
    worker: Path = WORKER,
) -> Outcome:
    """Run ``tests/distributed/worker.py SCENARIO --out OUT ARGS`` (or another ``worker`` script) on
    ``world`` ranks; wait for all of them, or for ``ranks`` only (the others are killed once those ended)."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(worker), scenario, "--out", str(out), *args]
    with Ranks(lambda rank: argv, out, world=world) as started:
        return started.wait(timeout, ranks)


def torchrun_argv() -> list[str]:
    """torchrun as a user runs it: the console script beside this interpreter, else the module."""
    launcher = Path(sys.executable).with_name("torchrun")
    return [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]


def start_logged(
    command: Sequence[str], log: Path, cwd: Path = ROOT, preexec_fn: Callable[[], None] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``command`` (torchrun and its workers) in a session of its own, its output appended to
    ``log`` (a file: nobody reads a pipe while a test waits), with no SLURM or torchelastic variables
    inherited, one OpenMP thread, and this repository importable. Reap it with
    ``tests.faults.elastic_restart.reap`` (its workers run in sessions of their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )


def finish_logged(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for a ``start_logged`` process; its exit code, or None when it ran past ``timeout``.
    Its whole tree is reaped either way (workers run in sessions of their own)."""
    from tests.faults.elastic_restart import reap

    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        reap(process, set())


def run_command(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``argv`` (e.g. torchrun and its workers) in its own process group; (exit code, output).
    At the deadline the whole group is killed and the code is None."""
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}, **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(
        list(argv),
        cwd=ROOT,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group started above: torchrun and its workers
        output, _ = proc.communicate()
        return None, output.decode(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers that outlived their launcher, if any


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---------------------------------------------------------------- audit trails
def events(workspace: Path, rank: int) -> list[dict[str, Any]]:
    """Rank ``rank``'s trail; a line cut off by a kill is skipped."""
    from trainfsm.trail.reader import TrailError, read_events  # a line cut off by a kill is skipped

    try:
        return list(read_events(workspace, rank))
    except TrailError:  # no trail yet
        return []


def summary(trail: Iterable[Mapping[str, Any]], attempt: int | None = None) -> dict[str, Any]:
    """What every rank must agree on: the transitions with their steps, the retries, the steps
    checkpointed (CHECKPOINT entered: every rank takes ``save``, only rank 0 writes the files),
    and the exit."""
    mine = [e for e in trail if attempt is None or e["attempt"] == attempt]
    transitions = [(e["step"], e["trigger"], e["source"], e["dest"]) for e in mine if e["event"] == "transition"]
    return {
        "transitions": transitions,
        "steps": sorted({step for step, *_ in transitions}),
        "retries": [(e["step"], e["retry"]) for e in mine if e["event"] == "non_finite"],
        "checkpoint_steps": [step for step, trigger, *_ in transitions if trigger == "save"],
        "exit": [(e["step"], e["reason"], e["code"]) for e in mine if e["event"] == "exit"],
    }


def audit_problems(workspace: Path) -> list[tuple[str, int | None, int | None]]:
    """``trainfsm audit``'s problems with the run's trails: (kind, rank, attempt); [] when consistent
    (its checks include ``rank_disagreement``: steps, retries, checkpoint steps, exit per attempt)."""
    from trainfsm.tools.audit import audit

    return [(p.kind, p.rank, p.attempt) for p in audit([workspace]).problems]


def run_problems(workspace: Path) -> list[tuple[str, int | None, int | None]]:
    """How ``trainfsm audit`` says the run did not end well: (kind, rank, attempt) of its run
    problems (``killed``, ``failed``, ...: about the last attempt only); [] when it ended well."""
    from trainfsm.tools.audit import audit

    return [(p.kind, p.rank, p.attempt) for p in audit([workspace]).run_problems]


def killed_ranks(workspace: Path) -> dict[int, list[int]]:
    """Attempt -> the ranks ``trainfsm audit`` reports killed (no exit event), for attempts with any."""
    from trainfsm.tools.audit import audit

    attempts = audit([workspace]).attempts
    return {a.attempt: [k["rank"] for k in a.killed_at()] for a in attempts if a.killed}
