"""Two torchrun agents on this machine stand for two nodes: kill, signal or lose one of them.

Each trial starts two ``torchrun --nnodes 2 --rdzv-backend c10d`` agents on one endpoint, the first
with ``--rdzv-conf is_host=true`` (it serves the rendezvous store, as the endpoint's node does on a
real cluster) and the second with ``is_host=false``, each running ``examples/ddp.py`` (the
documented script, ``init_distributed`` and its default ``CheckpointingHook``) on ``--nproc``
workers. Then one of these faults, at a random moment of training:

``kill``    SIGKILL one worker, on either node (alternating, so rank 0's node and the other are hit
            about equally often); ``--max-restarts 2``. Passes when both agents exit 0 within
            a minute of the kill beyond the run's own remaining time, the final parameters equal an
            uninterrupted run's, every rank's trail has the restarted group (``torchelastic.group``
            2), ``trainfsm audit`` shows the restart and ``trainfsm trace`` names the killed rank.
``startup`` SIGKILL one worker in its first 3 s (imports, the group forming, BUILD, RESTORE);
            passes like ``kill``, the completed attempt being one group on every rank.
``signal``  SIGTERM or SIGUSR1 (alternating) to ONE agent, both started with
            ``--signals-to-handle`` as the docs say. Passes when every rank of both nodes agrees
            on one step, rank 0 saves it once, every worker exits with the preemption code, both
            agents end within a minute, and relaunching both resumes from that step bit-exact.
``lose``    SIGKILL one agent with all its workers (a node lost). Passes when the other node's
            workers end within their process-group timeout plus a minute and its agent ends within
            its rendezvous join timeout plus a minute, and relaunching both resumes from the newest
            complete checkpoint bit-exact.

``--pace fast`` steps take 30 ms (a survivor fails at once in its next collective); ``--pace slow``
steps take 2.5 s (the survivor is still computing when the other node's agent rejoins, and its own
agent stops it with SIGTERM to restart the group). ``--nnodes 1:2`` runs elastic membership.

    python tests/faults/two_nodes.py --fault kill --pace slow --trials 20

prints one line per trial and ends with "N passed, N failed"; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.launch import ROOT, alive, events, free_port, start_logged, torchrun_argv
from tests.faults.elastic_restart import workers as children
from tests.helpers import ledger_problem

EXAMPLE = ROOT / "examples" / "ddp.py"
#: torchrun's default forwarded signals plus SIGUSR1 (SLURM's usual warning), as the guide says.
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: steps, checkpoint interval, seconds per step.
PACES: dict[str, tuple[int, int, float]] = {"fast": (40, 10, 0.03), "slow": (8, 2, 2.5)}
#: The workers' process-group timeout (``examples/ddp.py --timeout``) and the agents' rendezvous
#: join timeout: a lost node is given up on after these.
GROUP_TIMEOUT, JOIN_TIMEOUT = 30, 25
#: How long after the fault a trial may take beyond the run's own remaining time.
GRACE = 60.0
#: How long both agents may take to end after one of them was signalled: the step, the agreement,
#: one save and the exit (shorter than JOIN_TIMEOUT: no agent may sit out its rendezvous timeout).
SIGNAL_GRACE = 15.0


@dataclass
class Agents:
    """Two torchrun agents (node 0 hosts the rendezvous store) and their logs."""

    workspace: Path
    directory: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    known: set[int] = field(default_factory=set)  # every worker pid seen, reaped at the end

    def log(self, node: int) -> Path:
        return self.directory / f"agent{node}.log"

    def output(self) -> str:
        return "\n".join(f"---- agent {n}\n{self.log(n).read_text(errors='replace')[-2500:]}" for n in (0, 1))

    def workers(self, node: int) -> list[int]:
        pids = children(self.procs[node].pid)
        self.known.update(pids)
        return pids

    def wait(self, deadline: float) -> list[int | None]:
        """Both agents' exit codes, None for one still running at ``deadline`` (then killed)."""
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        codes = [proc.poll() for proc in self.procs]
        self.reap()
        return codes

    def reap(self) -> None:
        """Kill both agents and every worker they started (workers run in sessions of their own)."""
        for node, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.workers(node)
        for pid in {*(p.pid for p in self.procs), *self.known}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=30)


def launch(
    workspace: Path,
    directory: Path,
    pace: str,
    nproc: int = 1,
    nnodes: str = "2",
    max_restarts: int = 2,
    forward: bool = False,
    extra: tuple[str, ...] = (),
) -> Agents:
    steps, interval, seconds = PACES[pace]
    port = free_port()
    agents = Agents(workspace, directory)
    directory.mkdir(parents=True, exist_ok=True)
    for node, host in enumerate(("true", "false")):
        command = [
            *torchrun_argv(),
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=two-nodes-{port}",
            f"--rdzv-conf=is_host={host},join_timeout={JOIN_TIMEOUT},last_call_timeout=2",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
            *([f"--signals-to-handle={FORWARDED}"] if forward else []),
            str(EXAMPLE),
            "--workspace",
            str(workspace),
            "--steps",
            str(steps),
            "--interval",
            str(interval),
            "--step-seconds",
            str(seconds),
            "--timeout",
            str(GROUP_TIMEOUT),
            *extra,
        ]
        agents.procs.append(start_logged(command, agents.log(node)))
        if node == 0:
            time.sleep(0.3)  # the store's host first, as on a cluster where the head node starts it
    return agents


def training(agents: Agents, ranks: int, timeout: float = 120) -> None:
    """Wait until every rank of the newest attempt has restored (is training)."""
    deadline = time.monotonic() + timeout
    while True:
        trails = [events(agents.workspace, r) for r in range(ranks)]
        if all(t and any(e["event"] == "restore" for e in t if e["attempt"] == t[-1]["attempt"]) for t in trails):
            return
        if time.monotonic() > deadline or any(p.poll() is not None for p in agents.procs):
            raise RuntimeError(f"the group never started training:\n{agents.output()}")
        time.sleep(0.05)


def last_attempt(workspace: Path, rank: int) -> list[dict[str, Any]]:
    trail = events(workspace, rank)
    return [e for e in trail if e["attempt"] == trail[-1]["attempt"]] if trail else []


def same(final: dict[str, Any], expected: dict[str, Any]) -> bool:
    import torch

    return final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)


def reference(directory: Path, pace: str, nproc: int) -> tuple[dict[str, Any], float]:
    """An uninterrupted two-node run: its final parameters and its training time."""
    import torch

    agents = launch(directory / "workspace", directory, pace, nproc)
    codes = agents.wait(time.monotonic() + 300)
    if codes != [0, 0]:
        raise RuntimeError(f"the uninterrupted run failed ({codes}):\n{agents.output()}")
    trail = events(agents.workspace, 0)
    start = next(e["ts"] for e in trail if e["event"] == "restore")
    end = next(e["ts"] for e in trail if e["event"] == "exit")
    return torch.load(agents.workspace / "final.pt"), end - start


# ---------------------------------------------------------------- the faults
def kill_trial(
    directory: Path, expected: dict[str, Any], duration: float, pace: str, rng: random.Random, index: int, **kw: Any
) -> str:
    """SIGKILL one worker of node ``index % 2``; "" when the trial passed, else what went wrong."""
    import torch

    from trainfsm.tools import audit, trace
    from trainfsm.tools.report import group_restart

    nproc = kw.get("nproc", 1)
    agents = launch(directory / "workspace", directory, pace, **kw)
    try:
        training(agents, 2 * nproc)
        started = time.monotonic()
        time.sleep(rng.uniform(0.0, 0.8 * duration))
        node = index % 2
        pids = agents.workers(node)
        if not pids:
            return f"no worker to kill on node {node}"
        victim = rng.choice(pids)
        rank = worker_rank(victim)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        codes = agents.wait(killed_at + duration + GRACE)
        # What the kill cost: the time to the end, less what the run had left to train then.
        LAST.update(killed_rank=rank, beyond=time.monotonic() - killed_at - (duration - (killed_at - started)))
    finally:
        agents.reap()
    if codes != [0, 0]:
        return f"agents exited {codes} (rank {rank} killed):\n{agents.output()}"
    final = torch.load(agents.workspace / "final.pt")
    if not same(final, expected):
        return f"final parameters differ from the uninterrupted run (rank {rank} killed)"
    stopped = [r for r in range(2 * nproc) if any(e["event"] == "restart_stop" for e in events(agents.workspace, r))]
    LAST.update(restart_stop=stopped)
    for r in range(2 * nproc):
        starts = [e for e in events(agents.workspace, r) if e["event"] == "run_start"]
        groups = [(e["torchelastic"] or {}).get("group") for e in starts]
        if groups[:1] != [1] or 2 not in groups:
            return f"rank {r}: run_start groups {groups}, expected the first group and the restarted one"
    report = audit.audit([agents.workspace])
    text = audit.render(report)
    if "torchrun restart 1" not in text:
        return f"the audit does not show the restart:\n{text}"
    restarted = next(a for a in report.attempts if a.attempt == 1)
    seen = {r.rank: group_restart(r.torchelastic) for r in restarted.ranks}
    if seen != dict.fromkeys(range(2 * nproc), 1):
        return f"the audit's attempt 1 should be torchrun's restart 1 on every rank: {seen}"
    story = trace.render(trace.trace([agents.workspace]))
    if f"cause: killed: rank {rank} in " not in story:
        return f"the trace does not name the killed rank {rank}:\n{story}"
    return ledger_problem(agents.workspace)


def startup_trial(
    directory: Path, expected: dict[str, Any], duration: float, pace: str, rng: random.Random, index: int, **kw: Any
) -> str:
    """SIGKILL one worker of node ``index % 2`` at a random moment of its first 3 s: its imports,
    ``init_distributed`` (the group forming), BUILD or RESTORE, before or after its trail begins."""
    import torch

    nproc = kw.get("nproc", 1)
    agents = launch(directory / "workspace", directory, pace, **kw)
    try:
        node = index % 2
        deadline = time.monotonic() + 60
        while not agents.workers(node):
            if time.monotonic() > deadline:
                return f"no worker appeared on node {node}:\n{agents.output()}"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 3.0))
        victim = rng.choice(agents.workers(node))
        reached = [e["event"] for e in last_attempt(agents.workspace, worker_rank(victim))]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        codes = agents.wait(killed_at + duration + GRACE + 30)
        LAST.update(killed_in=reached[-1] if reached else "start-up (no trail yet)")
    finally:
        agents.reap()
    if codes != [0, 0]:
        return f"agents exited {codes} (killed in {LAST.get('killed_in')}):\n{agents.output()}"
    if not same(torch.load(agents.workspace / "final.pt"), expected):
        return "final parameters differ from the uninterrupted run"
    groups = {r: last_attempt(agents.workspace, r)[0]["torchelastic"]["group"] for r in range(2 * nproc)}
    # One number on every rank; 1 again when the kill came before rank 0 had taken one.
    if len(set(groups.values())) != 1:
        return f"the completed attempt's groups per rank: {groups}, expected one group"
    return ledger_problem(agents.workspace)


def worker_rank(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


def signal_trial(
    directory: Path, expected: dict[str, Any], duration: float, pace: str, rng: random.Random, index: int, **kw: Any
) -> str:
    """SIGTERM or SIGUSR1 to one agent only; then relaunch both."""
    import torch

    nproc = kw.get("nproc", 1)
    sig = (signal.SIGTERM, signal.SIGUSR1)[index % 2]
    node = (index // 2) % 2
    agents = launch(directory / "workspace", directory, pace, forward=True, **kw)
    try:
        training(agents, 2 * nproc)
        time.sleep(rng.uniform(0.0, 0.6 * duration))
        signalled_at = time.monotonic()
        agents.procs[node].send_signal(sig)
        codes = agents.wait(signalled_at + SIGNAL_GRACE)
    finally:
        agents.reap()
    if None in codes:
        return (
            f"an agent still ran {SIGNAL_GRACE:.0f} s after {sig.name} reached agent {node}: {codes}\n{agents.output()}"
        )
    agreed, exits = set(), set()
    for r in range(2 * nproc):
        mine = last_attempt(agents.workspace, r)
        agreed |= {e["agreed_step"] for e in mine if e["event"] == "signal_agreed"}
        exits |= {(e["reason"], e["code"]) for e in mine if e["event"] == "exit"}
        if not any(e["event"] == "exit" for e in mine):
            return f"rank {r} has no exit event:\n{agents.output()}"
    if len(agreed) != 1 or exits != {("preempted", 128 + sig)}:
        return f"ranks agreed on {agreed} and exited {exits}, expected one step and preempted {128 + sig}"
    (step,) = agreed
    saved = [e["saved_step"] for e in last_attempt(agents.workspace, 0) if e["event"] == "checkpoint_saved"]
    if saved[-1:] != [step] or saved.count(step) != 1:
        return f"rank 0 saved {saved}, expected step {step} once"
    again = launch(agents.workspace, directory, pace, forward=True, **kw)
    codes = again.wait(time.monotonic() + duration + GRACE + 60)
    if codes != [0, 0]:
        return f"the relaunch exited {codes}:\n{again.output()}"
    loaded = [e.get("from_step") for e in last_attempt(agents.workspace, 0) if e["event"] == "checkpoint_loaded"]
    if loaded != [step]:
        return f"the relaunch loaded {loaded}, expected step {step}"
    if not same(torch.load(agents.workspace / "final.pt"), expected):
        return "final parameters differ from the uninterrupted run"
    return ledger_problem(agents.workspace)


def lose_trial(
    directory: Path, expected: dict[str, Any], duration: float, pace: str, rng: random.Random, index: int, **kw: Any
) -> str:
    """SIGKILL one agent and its workers (the node is lost); then relaunch both."""
    import torch

    nproc = kw.get("nproc", 1)
    node = index % 2
    agents = launch(directory / "workspace", directory, pace, **kw)
    try:
        training(agents, 2 * nproc)
        time.sleep(rng.uniform(0.0, 0.8 * duration))
        survivors = agents.workers(1 - node)
        lost_at = time.monotonic()
        for pid in [*agents.workers(node), agents.procs[node].pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while any(alive(pid) for pid in survivors) and time.monotonic() < lost_at + GROUP_TIMEOUT + GRACE:
            time.sleep(0.1)
        if any(alive(pid) for pid in survivors):
            return f"node {1 - node}'s workers still ran {GROUP_TIMEOUT + GRACE:.0f} s after node {node} was lost"
        codes = agents.wait(lost_at + GROUP_TIMEOUT + JOIN_TIMEOUT + GRACE)
    finally:
        agents.reap()
    if codes[1 - node] is None:
        return f"node {1 - node}'s agent still ran {GROUP_TIMEOUT + JOIN_TIMEOUT + GRACE:.0f} s after the loss"
    complete = (agents.workspace / "checkpoints").glob("*/manifest.json")
    newest = max((int(p.parent.name) for p in complete if p.parent.name.isdigit()), default=None)
    again = launch(agents.workspace, directory, pace, **kw)
    codes = again.wait(time.monotonic() + duration + GRACE + 60)
    if codes != [0, 0]:
        return f"the relaunch exited {codes}:\n{again.output()}"
    loaded = [e.get("from_step") for e in last_attempt(agents.workspace, 0) if e["event"] == "checkpoint_loaded"]
    if loaded != ([newest] if newest is not None else []):
        return f"the relaunch loaded {loaded}, expected the newest complete checkpoint {newest}"
    if not same(torch.load(agents.workspace / "final.pt"), expected):
        return "final parameters differ from the uninterrupted run"
    return ledger_problem(agents.workspace)


TRIALS = {"kill": kill_trial, "startup": startup_trial, "signal": signal_trial, "lose": lose_trial}
#: What the last trial measured, for its line: the killed rank, the seconds beyond the run's own.
LAST: dict[str, Any] = {}


def run_trials(
    fault: str,
    pace: str,
    trials: int,
    seed: int,
    nproc: int = 1,
    nnodes: str = "2",
    verbose: bool = True,
    base: Path | None = None,
) -> tuple[int, int, list[str]]:
    """(passed, failed, one line per trial)."""
    rng = random.Random(seed)
    lines: list[str] = []
    passed = failed = 0
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        expected, duration = reference(Path(tmp) / "reference", pace, nproc)
        for index in range(trials):
            started = time.monotonic()
            LAST.clear()
            problem = TRIALS[fault](
                Path(tmp) / f"trial{index}", expected, duration, pace, rng, index, nproc=nproc, nnodes=nnodes
            )
            passed += not problem
            failed += bool(problem)
            line = f"trial {index} [{fault}, {pace}, nnodes {nnodes}, {nproc}/node]: " + (
                f"passed in {time.monotonic() - started:.1f} s" if not problem else "FAILED: " + problem
            )
            if "killed_rank" in LAST:
                line += f" (rank {LAST['killed_rank']} killed; {LAST['beyond']:.1f} s beyond the run's own time)"
            if "killed_in" in LAST:
                line += f" (killed in: {LAST['killed_in']})"
            if LAST.get("restart_stop"):
                line += f" (stopped by its agent for the restart: rank {LAST['restart_stop']})"
            lines.append(line)
            if verbose:
                print(line, flush=True)
    return passed, failed, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=tuple(TRIALS), default="kill")
    parser.add_argument("--pace", choices=tuple(PACES), default="fast")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=1, help="workers per agent")
    parser.add_argument("--nnodes", default="2", help="2, or 1:2 for elastic membership")
    args = parser.parse_args()
    passed, failed, _ = run_trials(args.fault, args.pace, args.trials, args.seed, args.nproc, args.nnodes)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
