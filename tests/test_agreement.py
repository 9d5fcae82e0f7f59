"""The agreement's helpers, in one process: which errors get the failed-collective note, and what it says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from trainfsm.collectives import collective_note, is_collective_error, trails

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9932. "
    "This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError(GLOO_CLOSED), True),
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (dist.DistBackendError("NCCL error: remote process exited"), True),
        (RuntimeError("injected failure on rank 1 at step 2"), False),
        (ValueError("Connection closed by peer"), False),  # not a RuntimeError: the user's own
    ],
)
def test_collective_errors_are_told_from_the_users_own(error: BaseException, expected: bool) -> None:
    assert is_collective_error(error) is expected


def test_note_for_two_ranks_names_the_other_ranks_trail(tmp_path: Path) -> None:
    note = collective_note(0, 2, 7, "ACCUMULATE", tmp_path / "logs")
    assert note.startswith("trainfsm: rank 0 of 2 failed in a collective at step 7 (ACCUMULATE): rank 1 probably")
    assert note.endswith(f"The cause is in its trail {tmp_path / 'logs' / 'events.rank1.jsonl'} "
                         "(the first 'exception' event) and output.")  # fmt: skip
    assert trails(tmp_path / "logs", 1, 2) == [str(tmp_path / "logs" / "events.rank0.jsonl")]


def test_note_for_more_ranks_points_at_every_trail_and_without_a_workspace_at_the_output(tmp_path: Path) -> None:
    note = collective_note(3, 8, 1, "CHECKPOINT", tmp_path)
    assert ": another rank probably raised an exception or died." in note
    assert f"The cause is in the other ranks' trails {tmp_path / 'events.rank*.jsonl'} (the first" in note
    assert trails(tmp_path, 3, 8) == [str(tmp_path / "events.rank*.jsonl")]
    assert collective_note(0, 2, 1, "STEP", None).endswith(
        "The cause is in its output (no workspace, so no trail files)."
    )
    assert trails(None, 0, 2) is None


def test_host_flags_use_the_default_group_with_gloo_and_one_gloo_group_under_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainfsm import collectives as agreement

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert agreement.host_group() is None  # "cpu:gloo,cuda:gloo": the default group takes CPU tensors
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
        monkeypatch.setattr(agreement, "_HOST_GROUPS", {})
        group = agreement.host_group()
        assert group is not None and dist.get_backend(group) == "gloo"
        assert agreement.host_group() is group  # created once, reused by the next trainer
    finally:
        dist.destroy_process_group()


def test_the_step_end_signal_agreement_runs_on_the_host_group_with_a_cpu_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL the default group's flag would live on the GPU, and reading it after the optimizer
    step would be a second device sync per step: the agreement uses the gloo host group instead."""
    import signal

    from trainfsm import collectives

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")  # no CPU backend
        monkeypatch.setattr(collectives, "_HOST_GROUPS", {})
        real, calls = dist.all_reduce, []

        def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
            calls.append((group, tensor.device.type))
            return real(tensor, op=op, group=group, async_op=async_op)

        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        agreement = collectives.SignalAgreement()
        agreement.start(int(signal.SIGUSR1))
        assert agreement.result() == signal.SIGUSR1
        agreement.start(0)
        assert agreement.result() == 0
        host = collectives.host_group()
        assert host is not None and dist.get_backend(host) == "gloo"
        assert calls == [(host, "cpu"), (host, "cpu")]
    finally:
        dist.destroy_process_group()
