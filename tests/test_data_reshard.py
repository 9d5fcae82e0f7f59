"""A run resumed on another number of ranks trains every sample of every epoch exactly once (issue 49).

``tests/distributed/reshard_worker.py``: 100 samples that carry their index, a ``DistributedSampler``
with shuffle, per-rank batches of 2, ``global_batch_size=24`` (accumulation 3 at 4 ranks, 6 at 2,
4 at 3; an epoch is 4 optimizer steps, 96 samples: the last 4 of each epoch's order are dropped at
any world size). Preempted (SIGUSR1, an agreed save) at 4 ranks in epoch 0, resumed at 2 and
preempted in epoch 1, resumed at 3 to the end. The indices each rank trained are recorded in
``forward``; what a resumed attempt redid after the checkpoint it resumed from is not counted
for the attempt that did it first (the checkpoint keeps the state before it).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import ROOT, Ranks, events, finish_logged, free_port, start_logged, torchrun_argv
from tests.helpers import ledger_problem
from trainfsm.tools import audit, inspect_checkpoint

WORKER = ROOT / "tests" / "distributed" / "reshard_worker.py"
SAMPLES, GLOBAL, STEPS = 100, 24, 8  # two epochs of 4 steps


def epoch_order(epoch: int, n: int = SAMPLES) -> list[int]:
    """``DistributedSampler(seed=0)``'s order of ``epoch``: the same at any world size."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()


def torchrun(workspace: Path, ranks: int, *args: str, timeout: float = 240) -> int | None:
    command = [*torchrun_argv(), "--rdzv-backend", "static", "--master-port", str(free_port())]
    command += ["--nproc-per-node", str(ranks), "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1", str(WORKER)]
    process = start_logged([*command, "--workspace", str(workspace), *args], workspace.parent / "torchrun.log")
    return finish_logged(process, timeout)


def in_process(workspace: Path, ranks: int, *args: str, timeout: float = 240) -> dict[int, int | None]:
    """The same ranks without torchrun (each signals itself): the cheaper launch of the fast tier."""
    argv = [sys.executable, str(WORKER), "--workspace", str(workspace), "--self-signal", *args]
    with Ranks(lambda rank: argv, workspace.parent / f"logs{ranks}", world=ranks) as started:
        outcome = started.wait(timeout)
    assert not outcome.hung, outcome.describe()
    return outcome.codes


def trained(workspace: Path) -> dict[int, Counter[int]]:
    """Per epoch, how many times each sample index was trained by a step the run kept."""
    starts = {e["attempt"]: e["from_step"] for e in events(workspace, 0) if e["event"] == "data_resumed"}
    counts: dict[int, Counter[int]] = {}
    for path in sorted((workspace / "trained").glob("rank*.attempt*.jsonl")):
        attempt = int(path.stem.split("attempt")[1])
        kept_until = min((step for a, step in starts.items() if a > attempt), default=None)
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if kept_until is None or row["step"] <= kept_until:
                counts.setdefault(row["epoch"], Counter()).update(row["indices"])
    return counts


def assert_each_sample_once(workspace: Path, epochs: int = 2) -> None:
    counts = trained(workspace)
    assert sorted(counts) == list(range(epochs))
    for epoch, seen in counts.items():
        twice = sorted(i for i, n in seen.items() if n > 1)
        expected = set(epoch_order(epoch)[: (SAMPLES // GLOBAL) * GLOBAL])
        assert twice == [], f"epoch {epoch}: trained more than once: {twice}"
        assert set(seen) == expected, f"epoch {epoch}: never trained {sorted(expected - set(seen))}"


def resumed(workspace: Path) -> list[dict[str, Any]]:
    return [e for e in events(workspace, 0) if e["event"] == "data_resumed"]


def test_4_then_2_ranks_train_each_sample_of_both_epochs_once(tmp_path: Path) -> None:
    """The fast tier's case (two launches); the slow one adds a third size, 3, and what it shows."""
    workspace = tmp_path / "ws"
    assert set(in_process(workspace, 4, "--preempt-at", "2").values()) == {138}
    assert set(in_process(workspace, 2).values()) == {0}
    assert_each_sample_once(workspace)
    assert ledger_problem(workspace) == ""
    assert audit.audit([workspace]).ledger[0].startswith("all ranks, world size 4 → 2: ")
    [first] = resumed(workspace)
    assert (first["from_world_size"], first["exact"]) == (4, True)
    assert first["global"] == {"epoch": 0, "samples": first["from_step"] * GLOBAL}


@pytest.mark.slow  # ~30 s: nine processes
def test_4_then_2_then_3_ranks_train_each_sample_of_both_epochs_once(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    assert set(in_process(workspace, 4, "--preempt-at", "2").values()) == {138}
    assert set(in_process(workspace, 2, "--preempt-at", "6").values()) == {138}
    assert set(in_process(workspace, 3).values()) == {0}
    assert_each_sample_once(workspace)
    assert ledger_problem(workspace) == ""  # `trainfsm audit` proves it from the trail alone
    assert audit.audit([workspace]).ledger[0].startswith("all ranks, world size 4 → 2 → 3: ")
    first, second = resumed(workspace)
    assert (first["from_world_size"], first["exact"], first["approximate"]) == (4, True, None)
    assert first["global"] == {"epoch": 0, "samples": first["from_step"] * GLOBAL}
    assert first["batches"] == first["global"]["samples"] // (2 * 2)  # this rank's own micro-batches at 2 ranks
    assert (second["from_world_size"], second["exact"]) == (2, True)
    assert second["global"] == {"epoch": 1, "samples": (second["from_step"] - 4) * GLOBAL}
    layouts = [e for e in events(workspace, 0) if e["event"] == "data_layout"]
    assert [(e["world_size"], e["accumulation"], e["epoch_samples"]) for e in layouts] == [
        (4, 3, 96),
        (2, 6, 96),
        (3, 4, 96),
    ]
    shown = inspect_checkpoint.render(inspect_checkpoint.inspect(workspace / "checkpoints" / str(STEPS)))
    assert "global: 96 samples into epoch 1's order (DistributedSampler seed 0, 100 samples, 3 rank(s)" in shown


@pytest.mark.slow
def test_without_the_global_position_the_planted_resume_trains_samples_twice(tmp_path: Path) -> None:
    """The control: every new rank resuming old rank 0's own position (trainfsm before issue 49)."""
    workspace = tmp_path / "ws"
    assert set(in_process(workspace, 4, "--preempt-at", "2").values()) == {138}
    assert set(in_process(workspace, 2, "--plant", "rank0").values()) == {0}
    counts = trained(workspace)
    twice = sorted(index for index, n in counts[0].items() if n > 1)
    assert twice
    report = audit.audit([workspace])  # and the audit names them, from the trail alone
    [problem] = [p.message for p in report.run_problems if p.kind == "ledger" and "trained twice" in p.message]
    assert f"{len(twice)} positions of its order trained twice" in problem
    named = re.search(r"the dataset's samples ([\d, ]+) and (\d+) more", problem)
    assert named is not None, problem
    shown = [int(x) for x in named.group(1).split(", ")]
    assert set(shown) <= set(twice) and len(shown) + int(named.group(2)) == len(twice)


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["dataloader", "stateful", "async saves"])
def test_under_torchrun_4_then_2_then_3_ranks_train_each_sample_once(loader: str, tmp_path: Path) -> None:
    """``async saves``: the DataLoader, its checkpoints written on the background thread (interval 1)."""
    workspace = tmp_path / "ws"
    options = ["--micro-seconds", "0.05"]
    options += {
        "dataloader": ["--loader", "dataloader"],
        "stateful": ["--loader", "stateful", "--workers", "2"],
        "async saves": ["--async-save", "--interval", "1"],
    }[loader]
    assert torchrun(workspace, 4, "--preempt-at", "2", *options) != 0
    assert torchrun(workspace, 2, "--preempt-at", "6", *options) != 0
    assert torchrun(workspace, 3, *options) == 0
    assert_each_sample_once(workspace)
    assert [(e["from_world_size"], e["exact"]) for e in resumed(workspace)] == [(4, True), (2, True)]
    assert ledger_problem(workspace) == ""
