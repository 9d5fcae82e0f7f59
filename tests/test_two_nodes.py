"""Past one node: two torchrun agents on this machine (c10d rendezvous, one of them hosting the
store) stand for two nodes. A worker killed on either node, one node signalled alone, one node
lost, and elastic membership; and the number every node's workers agree on for a restarted group.

The trials are ``tests/faults/two_nodes.py``'s (a few of each here; the script runs more).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launch import ROOT, events
from tests.faults import two_nodes
from tests.helpers import ledger_problem
from trainfsm.tools import audit

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="torchrun, /proc and prctl: Linux"),
    pytest.mark.distributed,
]


# ---------------------------------------------------------------- the group's number
@pytest.fixture
def store() -> Any:
    """A TCPStore server standing for torchrun's agent store, whose keys outlive every group."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)


def client(server: Any) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def join(server: Any, rank: int, world: int, results: dict[int, Any], delay: float = 0.0, timeout: float = 10) -> None:
    from trainfsm.distributed import _join_group

    time.sleep(delay)
    try:
        results[rank] = _join_group(client(server), rank, world, timedelta(seconds=timeout))
    except Exception as exc:
        results[rank] = exc


def form(
    server: Any, world: int, delays: dict[int, float], timeout: float = 10, absent: tuple[int, ...] = ()
) -> dict[int, Any]:
    """One group of ``world`` ranks joining the store, rank r after ``delays[r]`` seconds; the
    ``absent`` ranks never come (they died before they joined)."""
    results: dict[int, Any] = {}
    threads = [
        threading.Thread(target=join, args=(server, r, world, results, delays.get(r, 0.0), timeout))
        for r in range(world)
        if r not in absent
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_the_first_group_of_a_launch_is_number_1_on_every_rank(store: Any) -> None:
    assert form(store, 3, {}) == {0: 1, 1: 1, 2: 1}


@pytest.mark.parametrize("rank0_late", [0.0, 0.3], ids=["rank 0 first", "rank 0 last"])
def test_a_restarted_group_agrees_on_a_new_number_whichever_rank_arrives_first(store: Any, rank0_late: float) -> None:
    assert form(store, 2, {}) == {0: 1, 1: 1}
    # Rank 1 of the new group reads the counter while it still says 1 (the old group's number),
    # whose keys are all still there: it must still end up in group 2, as rank 0 does.
    assert form(store, 2, {0: rank0_late}) == {0: 2, 1: 2}
    assert form(store, 2, {1: 0.3}) == {0: 3, 1: 3}


def test_a_group_that_never_formed_leaves_nothing_the_next_group_could_mistake_for_its_own(store: Any) -> None:
    assert form(store, 2, {}) == {0: 1, 1: 1}
    # Group 2's rank 1 died before it joined: rank 0 gives up after its timeout.
    alone = form(store, 2, {}, timeout=0.5, absent=(1,))
    assert isinstance(alone[0], Exception)
    # Group 3: rank 1 reads 2 (an abandoned number, with rank 0's keys in it) and follows to 3.
    assert form(store, 2, {0: 0.3}) == {0: 3, 1: 3}


def test_a_rank_waiting_for_rank_0_gives_up_at_the_timeout_with_a_message_that_says_so(store: Any) -> None:
    results = form(store, 2, {}, timeout=0.5, absent=(0,))
    assert isinstance(results[1], RuntimeError)
    assert "is rank 0 running?" in str(results[1]) and "init_distributed's timeout" in str(results[1])


GROUP_SCRIPT = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from trainfsm.distributed import elastic_group, init_distributed
layout = init_distributed("gloo", timeout=timedelta(seconds=15))
flag = torch.tensor([layout.rank + 1])
dist.all_reduce(flag)
print(elastic_group(), int(flag), flush=True)
dist.destroy_process_group()
"""


def run_group(store: Any, restart_counts: tuple[int, int], out: Path) -> list[tuple[int, str]]:
    """Two worker processes as torchrun starts them (the agent's store, each with its agent's
    ``TORCHELASTIC_RESTART_COUNT``); their exit codes and outputs."""
    procs = []
    for rank, count in enumerate(restart_counts):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT=str(count),
            TORCHELASTIC_RUN_ID="test",
            OMP_NUM_THREADS="1",
        )
        log = out / f"rank{rank}.{count}.txt"
        with open(log, "wb") as file:
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, "-c", GROUP_SCRIPT],
                        cwd=ROOT,
                        env=env,
                        stdout=file,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    log,
                )
            )
    results = []
    for proc, log in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        results.append((proc.returncode, log.read_text(errors="replace")))
    return results


def test_workers_whose_agents_counted_different_restarts_still_form_one_new_group(store: Any, tmp_path: Path) -> None:
    # The first group, then the group after one restart, as two agents launch it: the agent whose
    # worker died counts a restart (1), the other restarted its healthy worker without counting (0).
    first = run_group(store, (0, 0), tmp_path)
    assert [code for code, _ in first] == [0, 0], first
    assert [out.split()[-2:] for _, out in first] == [["1", "3"], ["1", "3"]]
    second = run_group(store, (1, 0), tmp_path)
    assert [code for code, _ in second] == [0, 0], second
    assert [out.split()[-2:] for _, out in second] == [["2", "3"], ["2", "3"]]


# ---------------------------------------------------------------- two agents
class References(dict):
    """The uninterrupted two-node run of a pace (final parameters, training time), launched the first
    time a trial asks for that pace: the fast tier uses only the fast pace, and a reference run costs
    about as much as a trial."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, pace: str) -> tuple[dict[str, Any], float]:
        self[pace] = two_nodes.reference(self.factory.mktemp(pace), pace, 1)
        return self[pace]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The uninterrupted two-node runs, one per pace, each run when first needed."""
    return References(tmp_path_factory)


def trial(fault: str, pace: str, index: int, tmp_path: Path, straight: Any, nnodes: str = "2") -> None:
    expected, duration = straight[pace]
    problem = two_nodes.TRIALS[fault](tmp_path, expected, duration, pace, random.Random(index), index, nnodes=nnodes)
    assert problem == ""


# Slow steps on node 1: test_a_survivor_stopped_by_its_agent_for_a_restart_... below.
@pytest.mark.faults
@pytest.mark.parametrize(
    ("pace", "node"),
    [pytest.param("fast", 0, marks=pytest.mark.slow), ("fast", 1), pytest.param("slow", 0, marks=pytest.mark.slow)],
    ids=["fast, node 0 (store host)", "fast, node 1", "slow, node 0 (store host)"],
)
def test_a_worker_killed_on_either_node_restarts_both_and_the_run_completes_bit_exact(
    pace: str, node: int, tmp_path: Path, straight: Any
) -> None:
    trial("kill", pace, node, tmp_path, straight)


@pytest.mark.faults
@pytest.mark.parametrize("node", [pytest.param(0, marks=pytest.mark.slow), 1], ids=["node 0 (store host)", "node 1"])
def test_a_worker_killed_while_starting_up_or_in_build_restarts_both_into_one_group_and_completes_exactly(
    node: int, tmp_path: Path, straight: Any
) -> None:
    trial("startup", "fast", node, tmp_path, straight)


@pytest.mark.faults
@pytest.mark.slow
def test_with_two_workers_per_node_a_killed_worker_restarts_all_four_ranks_into_one_group(tmp_path: Path) -> None:
    """Four ranks, two per agent: the restart forms one group of four whatever each agent counted,
    and ends with the uninterrupted run's parameters bit for bit: the restarted DDP starts with the
    bucket layout the uninterrupted run had (``trainfsm.ddp_buckets``; with more than two ranks a
    sum's order follows the layout)."""
    expected, duration = two_nodes.reference(tmp_path / "reference", "fast", 2)
    problem = two_nodes.kill_trial(tmp_path / "trial", expected, duration, "fast", random.Random(1), 1, nproc=2)
    assert problem == ""


@pytest.mark.faults
@pytest.mark.parametrize(
    # Both in the full tier (22 s each): in the fast tier a signal to torchrun reaches every rank in
    # tests/test_torchrun_preemption.py and tests/test_distributed_signals.py.
    "index",
    [pytest.param(0, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)],
    ids=["SIGTERM to node 0", "SIGUSR1 to node 1"],
)
def test_a_signal_to_one_agent_stops_every_rank_of_both_nodes_at_one_saved_step_and_they_resume_bit_exact(
    index: int, tmp_path: Path, straight: Any
) -> None:
    trial("signal", "fast", index, tmp_path, straight)


@pytest.mark.faults
@pytest.mark.parametrize(
    "node", [0, pytest.param(1, marks=pytest.mark.slow)], ids=["node 0 (store host) lost", "node 1 lost"]
)
def test_a_lost_node_ends_the_other_within_its_timeouts_and_a_relaunch_resumes_bit_exact(
    node: int, tmp_path: Path, straight: Any
) -> None:
    trial("lose", "fast", node, tmp_path, straight)


@pytest.mark.faults
@pytest.mark.slow
def test_under_elastic_membership_a_killed_worker_restarts_both_nodes_and_completes_bit_exact(
    tmp_path: Path, straight: Any
) -> None:
    trial("kill", "fast", 1, tmp_path, straight, nnodes="1:2")


@pytest.mark.faults
@pytest.mark.slow
def test_under_elastic_membership_the_node_left_after_a_loss_trains_on_alone(tmp_path: Path) -> None:
    """``--nnodes 1:2``: when node 1 is lost for good, node 0's agent forms a group of one and its
    worker resumes from the last complete checkpoint at world size 1, at the saved global position
    with the global batch kept (64: accumulation 1 at 2 ranks, 2 at 1), and completes, each sample
    once (the data ledger, across the change of size); not an uninterrupted two-node run's bits."""
    agents = two_nodes.launch(tmp_path / "ws", tmp_path, "fast", nnodes="1:2", extra=("--global-batch-size", "64"))
    try:
        two_nodes.training(agents, 2)
        deadline = time.monotonic() + 60
        while not any(e["event"] == "checkpoint_saved" for e in events(agents.workspace, 0)):  # a save to go on from
            assert time.monotonic() < deadline, agents.output()
            time.sleep(0.02)
        for pid in [*agents.workers(1), agents.procs[1].pid]:
            os.kill(pid, signal.SIGKILL)
        codes = agents.wait(time.monotonic() + 120)
    finally:
        agents.reap()
    assert codes[0] == 0, agents.output()
    starts = [e for e in events(agents.workspace, 0) if e["event"] == "run_start"]
    assert [(e["world_size"], e["torchelastic"]["group"]) for e in starts] == [(2, 1), (1, 2)]
    assert two_nodes.last_attempt(agents.workspace, 0)[-1]["reason"] == "completed"
    [resumed] = [e for e in events(agents.workspace, 0) if e["event"] == "data_resumed"]
    assert (resumed["from_world_size"], resumed["exact"], resumed["approximate"]) == (2, True, None)
    assert resumed["batches"] == resumed["global"]["samples"] // 32  # its own share: all of it, alone
    layouts = [e for e in events(agents.workspace, 0) if e["event"] == "data_layout"]
    assert [(e["world_size"], e["accumulation"]) for e in layouts] == [(2, 1), (1, 2)]
    assert ledger_problem(agents.workspace) == ""  # each sample once across the change, from the trail
    assert audit.audit([agents.workspace]).ledger[0].startswith("all ranks, world size 2 → 1: ")


@pytest.mark.faults
@pytest.mark.slow
def test_a_survivor_stopped_by_its_agent_for_a_restart_records_a_restart_stop_not_a_preemption(
    tmp_path: Path, straight: Any
) -> None:
    """Slow steps: the survivor is still in its step when the killed worker's agent rejoins, so its
    own agent stops it with SIGTERM; it can no longer agree with the dead peer, so it saves
    nothing and says why (``restart_stop``) instead of checkpointing as for a preemption."""
    expected, duration = straight["slow"]
    agents = two_nodes.launch(tmp_path / "ws", tmp_path, "slow")
    try:
        two_nodes.training(agents, 2)
        time.sleep(0.2)  # early in the first 2.5 s step: its agent stops it long before the step ends
        (victim,) = agents.workers(1)
        os.kill(victim, signal.SIGKILL)
        codes = agents.wait(time.monotonic() + duration + 60)
    finally:
        agents.reap()
    assert codes == [0, 0], agents.output()
    first = [e for e in events(agents.workspace, 0) if e["attempt"] == 0]
    names = [e["event"] for e in first]
    assert "restart_stop" in names, names
    assert names.index("collective_failed") < names.index("restart_stop")
    assert next(e for e in first if e["event"] == "restart_stop")["signal"] == "SIGTERM"
    assert "signal_agreed" not in names and first[-1]["event"] == "exit"
    assert (first[-1]["reason"], first[-1]["code"]) == ("failed", 1)
    import torch

    assert two_nodes.same(torch.load(agents.workspace / "final.pt"), expected)


@pytest.mark.faults
@pytest.mark.slow
def test_the_rank_preempted_by_the_other_nodes_signal_stops_its_own_agent_at_exit(tmp_path: Path) -> None:
    agents = two_nodes.launch(tmp_path / "ws", tmp_path, "fast", forward=True)
    try:
        two_nodes.training(agents, 2)
        agents.procs[0].send_signal(signal.SIGUSR1)
        signalled = time.monotonic()
        codes = agents.wait(signalled + 60)
        took = time.monotonic() - signalled
    finally:
        agents.reap()
    assert None not in codes and took < two_nodes.SIGNAL_GRACE, (codes, took)
    node1 = two_nodes.last_attempt(agents.workspace, 1)
    stop = next(e for e in node1 if e["event"] == "launcher_stop")
    assert (stop["signal"], stop["at"]) == ("SIGTERM", "process exit")
    assert "signal_received" not in [e["event"] for e in node1]  # it learned of the signal by agreement
    node0 = two_nodes.last_attempt(agents.workspace, 0)
    assert "launcher_stop" not in [e["event"] for e in node0]  # its agent got the signal itself
    assert "got signal: 15" in two_nodes.Agents.log(agents, 1).read_text()
