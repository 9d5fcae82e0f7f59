"""FSDP2 (``fully_shard``) at 3 and 4 ranks under real torchrun: stopped by SIGUSR1 at torchrun or
SIGKILLed at a random moment, then relaunched, it ends with the model and optimizer state of an
uninterrupted run of the same world size, bit for bit.

With two ranks every element of a reduced gradient is a sum of two terms, which add the same
either way round, so only three ranks or more can show a resume that sums in another order (as
DDP's bucket rebuild does: docs/guides/distributed.md). FSDP2 reduce-scatters each parameter
group in the same order at every step and keeps no layout to rebuild; these trials check what
that promises. They are ``tests/faults/fsdp_ranks.py``'s (a 1.09 M-parameter model, each rank
holding a real shard, sharded DCP checkpoints); more of them, and full checkpoints, by hand:
``python tests/faults/fsdp_ranks.py --ranks 4 --fault kill --trials 20 [--checkpoint full]``.

Each trial trains the uninterrupted run first, in the first launch's processes (a fresh trainer
from step 0 in its own workspace): one launch fewer than a separate reference, and a process
that has trained before can only add differences, not hide them.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

from tests.faults import fsdp_ranks

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="torchrun and /proc: Linux"),
    pytest.mark.distributed,
    pytest.mark.faults,
]

#: Few, short steps: the fast tier's trial is two launches of four ranks on two cores.
FOUR = fsdp_ranks.Job(ranks=4, steps=12, interval=3, step_seconds=0.02)
THREE = dataclasses.replace(FOUR, ranks=3)


@pytest.mark.slow  # FSDP2 needed no change to be exact; the fast tier's multi-rank trial is DDP's (test_ddp_buckets.py)
def test_four_fsdp2_ranks_stopped_by_sigusr1_at_torchrun_resume_bit_exact(tmp_path: Path) -> None:
    outcome = fsdp_ranks.trial(tmp_path, None, FOUR, "signal", random.Random(48), 0)
    assert not outcome.problem, outcome.line(0)


@pytest.mark.slow
def test_three_fsdp2_ranks_stopped_by_sigusr1_at_torchrun_resume_bit_exact(tmp_path: Path) -> None:
    outcome = fsdp_ranks.trial(tmp_path, None, THREE, "signal", random.Random(49), 0)
    assert not outcome.problem, outcome.line(0)


@pytest.mark.slow
def test_four_fsdp2_ranks_one_sigkilled_after_a_checkpoint_resume_bit_exact(tmp_path: Path) -> None:
    """Trial 0 of the script's kill trials: one worker SIGKILLed, torchrun stops the others."""
    outcome = fsdp_ranks.trial(tmp_path, None, FOUR, "kill", random.Random(50), 0)
    assert not outcome.problem, outcome.line(0)
