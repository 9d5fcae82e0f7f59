"""What one rank's trouble does to the others, on 2 real gloo ranks with DDP.

- A NaN loss on one rank: the all-reduced gradients are NaN on every rank, so both retry the same
  step, and their audit trails agree on steps, retries, checkpoint steps and exit.
- ``loss=None`` on one rank (after calling the model, as the other ranks do): the ranks agree
  before backward, so every rank skips that micro-batch: same transitions, same data positions,
  the same parameters as a run where every rank skipped it. Also with a model whose forward
  broadcasts buffers.
- ``loss=None`` on one rank without calling a model whose forward has collectives: the others wait
  in theirs; both fail at the process-group timeout, and the error of the rank that returned
  None says why.
- An exception on one rank: a peer that exits is noticed at once (gloo: connection closed); one
  that stays alive is noticed at the process-group timeout. Either way every rank ends, non-zero,
  and the others' error carries a note naming the failed rank's trail (also a ``collective_failed``
  event in their trails).
- SIGKILL of one rank of ``examples/ddp.py``: the other exits with the example's message within
  the process-group timeout, and a restart of both resumes from the last complete checkpoint.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import (
    ROOT,
    Outcome,
    Ranks,
    audit_problems,
    events,
    killed_ranks,
    run_problems,
    run_worker,
    summary,
)
from tests.distributed.worker import LOSS_NONE_AT, reference
from trainfsm.tools.trace import render, trace

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux"),
    pytest.mark.distributed,
    pytest.mark.faults,
]

WORLD = 2
PG_TIMEOUT = 3.0  # seconds; the scenarios that fail set it short so that the suite stays fast
SLACK = 10.0  # process start-up and teardown on a loaded 2-core machine
# gloo's errors: a collective reached the timeout ("Timed out waiting 3000ms for recv operation to
# complete", or "Application timeout caused pair closure" on the rank whose pair the timeout closed),
# or the peer's socket closed ("Connection closed by peer", "Connection reset by peer").
TIMED_OUT = re.compile(rf"Timed out waiting {int(PG_TIMEOUT * 1000)}ms|Application timeout caused pair closure")
PEER_GONE = re.compile("Connection (closed|reset) by peer")
# A failed rank exits 1 (its exception), or -6 when gloo's threads abort the interpreter as it shuts
# down after a timed-out collective ("terminate called without an active exception"): either way it
# recorded its exception and exit first.
FAILED = (1, -6)


def _trails(workspace: Path) -> list[list[dict[str, Any]]]:
    return [events(workspace, rank) for rank in range(WORLD)]


def _first(trail: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(e for e in trail if e["event"] == name)


def _one_rank(
    tmp_path: Path, action: str, *args: str, ranks: tuple[int, ...] = (0, 1)
) -> tuple[Outcome, list[list[dict[str, Any]]]]:
    argv = ("--action", action, "--pg-timeout", str(PG_TIMEOUT), *args)
    outcome = run_worker("one_rank", tmp_path, 60, *argv, ranks=ranks)
    assert not outcome.hung, f"rank(s) {outcome.hung} still running after 60 s\n{outcome.describe()}"
    return outcome, _trails(tmp_path / "run")


@pytest.fixture(scope="module")
def finishing_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch, runs both ranks finish: ``nan``, ``loss_none``, ``loss_none_everywhere`` (worker.py ddp_faults)."""
    out = tmp_path_factory.mktemp("ddp_faults")
    outcome = run_worker("ddp_faults", out, 90)
    assert outcome.codes == {0: 0, 1: 0} and not outcome.hung, outcome.describe()
    return out, [torch.load(out / f"ddp_faults.rank{rank}.pt") for rank in range(WORLD)]


def test_nan_loss_on_one_rank_makes_every_rank_retry_the_same_step_with_agreeing_trails(
    finishing_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, results = finishing_run
    trails = _trails(out / "nan")
    summaries = [summary(trail) for trail in trails]
    assert summaries[0]["retries"] == [(2, 1)]  # rank 1's NaN, all-reduced into rank 0's gradients
    assert summaries[0]["checkpoint_steps"] == [2, 4, 5]
    assert summaries[0]["exit"] == [(5, "completed", 0)]
    assert summaries[0] == summaries[1]  # same transitions at the same steps, same retries, same exit
    assert len({e["run_id"] for trail in trails for e in trail}) == 1  # one run: rank 0's id on every rank
    assert audit_problems(out / "nan") == []
    # Only rank 0 writes the files: rank 1's trail shows the CHECKPOINT steps (above), not the saves.
    saved = [[e["saved_step"] for e in trail if e["event"] == "checkpoint_saved"] for trail in trails]
    assert saved == [[2, 4, 5], []]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["nan"]["params"], results[1]["nan"]["params"], strict=True))


def test_loss_none_on_one_rank_makes_every_rank_skip_that_micro_batch(
    finishing_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, both = finishing_run
    trails = _trails(out / "loss_none" / "run")
    results = [result["loss_none"] for result in both]
    assert [r["warnings"] for r in results] == [[], ["LossNoneWarning"]]  # only the rank that returned None
    # Forward call 3 is step 2's first micro-batch; both ranks record the skip, naming rank 1.
    skips = [[(e["step"], e["micro"], e["ranks"]) for e in trail if e["event"] == "loss_none"] for trail in trails]
    assert skips == [[(2, 0, [1])], [(2, 0, [1])]]
    summaries = [summary(trail) for trail in trails]
    assert summaries[0] == summaries[1]  # the same transitions, micro-batch by micro-batch
    by_step = {n: [t[1:] for t in summaries[0]["transitions"] if t[0] == n] for n in (2, 3)}
    micro, more, stepped = (
        ("micro", "STEP", "ACCUMULATE"),
        ("micro", "ACCUMULATE", "ACCUMULATE"),
        ("stepped", "ACCUMULATE", "STEP"),
    )
    assert by_step[2] == [micro, more, more, stepped]  # the skipped micro-batch, its replacement, micro-batch 1
    assert by_step[3] == [micro, more, stepped]
    assert summaries[0]["exit"] == [(4, "completed", 0)]
    assert audit_problems(out / "loss_none" / "run") == []


def test_loss_none_on_one_rank_gives_the_parameters_of_a_run_where_every_rank_skipped(
    finishing_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, both = finishing_run
    one = [result["loss_none"]["params"] for result in both]
    everywhere = [result["loss_none_everywhere"]["params"] for result in both]
    for a, b, c, d in zip(*one, *everywhere, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    # ... which is SGD on every rank's batches but the third (index 2), skipped everywhere.
    expected = reference(4, 2, WORLD, 0.1, skipped=frozenset({LOSS_NONE_AT - 1}))
    for got, want in zip(one[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_loss_none_on_one_rank_after_a_forward_with_buffers_is_skipped_by_both(tmp_path: Path) -> None:
    # DDP broadcasts buffers in forward; checkpoints every 2 steps compare the ranks' skip counts.
    outcome, trails = _one_rank(tmp_path, "none_after_forward", "--norm", "--agree", "--interval", "2")
    assert outcome.codes == {0: 0, 1: 0}, outcome.describe()
    assert [e["saved_step"] for e in trails[0] if e["event"] == "checkpoint_saved"] == [2, 4]  # both skipped it
    assert [[(e["step"], e["ranks"]) for e in t if e["event"] == "loss_none"] for t in trails] == [[(2, [1])]] * 2
    assert summary(trails[0]) == summary(trails[1])
    assert summary(trails[0])["exit"] == [(4, "completed", 0)]


@pytest.mark.slow
def test_loss_none_on_one_rank_without_calling_a_model_with_buffers_fails_both_at_the_timeout(
    tmp_path: Path,
) -> None:
    # Rank 0's DDP forward broadcasts buffers; rank 1 never calls its model, so it waits in the
    # agreement while rank 0 waits in the broadcast: a deadlock that only the timeout ends.
    outcome, trails = _one_rank(tmp_path, "none", "--norm", "--agree")
    assert outcome.codes[0] in FAILED and outcome.codes[1] in FAILED, outcome.describe()
    errors = [_first(trail, "exception") for trail in trails]
    assert all(TIMED_OUT.search(e["message"]) or PEER_GONE.search(e["message"]) for e in errors), errors
    assert "this rank's forward returned loss=None just before" in errors[1]["traceback"]
    assert "call the wrapped model on every rank, then return None" in errors[1]["traceback"]
    for rank, trail in enumerate(trails):
        assert _first(trail, "collective_failed")["trails"] == [
            str(tmp_path / "run" / "logs" / f"events.rank{1 - rank}.jsonl")
        ]
        assert (_first(trail, "exit")["reason"], _first(trail, "exit")["step"]) == ("failed", 2)
    waited = _first(trails[0], "exit")["ts"] - _first(trails[0], "run_start")["ts"]
    assert PG_TIMEOUT - 1 <= waited <= PG_TIMEOUT + SLACK


@pytest.mark.slow
def test_loss_none_on_one_rank_without_agreement_fails_every_rank_at_the_next_checkpoint(tmp_path: Path) -> None:
    # The default (the trainloop contract): ranks do not agree on loss=None. Rank 1 skips step 2's
    # micro-batch alone, so its next gradient all-reduce pairs with rank 0's; the checkpoint of
    # step 2 compares the ranks' skip counts and refuses, on both ranks, before anything is written.
    outcome, trails = _one_rank(tmp_path, "none", "--interval", "2")
    assert outcome.codes == {0: 1, 1: 1}, outcome.describe()
    errors = [_first(trail, "exception") for trail in trails]
    for error in errors:
        assert error["type"] == "RuntimeError"
        assert error["message"].startswith(
            "step 2: the ranks skipped different numbers of micro-batches for loss=None in this launch "
            "(rank 0: 0, rank 1: 1)"
        )
        assert "pass loss_none_agreement=True to the trainer" in error["message"]
    assert [(_first(t, "exit")["reason"], _first(t, "exit")["step"]) for t in trails] == [("failed", 2)] * 2
    assert not (tmp_path / "run" / "checkpoints" / "2").exists()
    assert [e["ranks"] for e in trails[1] if e["event"] == "loss_none"] == [[1]]


BOUND = 2.0  # seconds from rank 1's exception to rank 0's exit when rank 1's process exits


def test_exception_on_one_rank_that_exits_fails_the_other_at_once_with_a_note(tmp_path: Path) -> None:
    # A long process-group timeout: rank 0 must not need it.
    outcome, trails = _one_rank(tmp_path, "raise", "--pg-timeout", "60")
    assert outcome.codes[0] in FAILED and outcome.codes[1] == 1, outcome.describe()
    raised = _first(trails[1], "exception")
    assert raised["message"] == "injected failure on rank 1 at step 2"
    assert [e["event"] for e in trails[1]].count("collective_failed") == 0  # rank 1's own error: no note
    peer, note = _first(trails[0], "exception"), _first(trails[0], "collective_failed")
    assert peer["type"] == "RuntimeError" and PEER_GONE.search(peer["message"]), peer["message"]
    rank1_trail = str(tmp_path / "run" / "logs" / "events.rank1.jsonl")
    assert note["trails"] == [rank1_trail]
    assert note["note"].startswith("trainfsm: rank 0 of 2 failed in a collective at step 2 (ACCUMULATE): rank 1 ")
    assert f"The cause is in its trail {rank1_trail} (the first 'exception' event) and output." in note["note"]
    assert note["note"] in peer["traceback"] and note["note"] in outcome.stderr[0]  # add_note: under the traceback
    assert _first(trails[0], "exit")["ts"] - raised["ts"] < BOUND
    assert [_first(t, "exit")["reason"] for t in trails] == ["failed", "failed"]
    assert audit_problems(tmp_path / "run") == []  # both ranks failed at the same step, same exit
    story = render(trace([tmp_path / "run"]))
    assert story.splitlines()[1].startswith(
        "  cause: rank 1 in ACCUMULATE running step 2: RuntimeError: injected failure on rank 1 at step 2 ("
    )
    assert story.splitlines()[1].endswith("; rank(s) 0 then failed in a collective")


@pytest.mark.slow
def test_exception_on_one_rank_that_stays_alive_fails_the_other_at_the_timeout(tmp_path: Path) -> None:
    # Rank 1 keeps its connections open after its own failure (killed by the test once rank 0 ended).
    outcome, trails = _one_rank(tmp_path, "raise", "--linger", "60", ranks=(0,))
    assert outcome.codes[0] in FAILED and outcome.codes[1] == -9, outcome.describe()
    raised = _first(trails[1], "exception")
    peer = _first(trails[0], "exception")
    assert peer["type"] == "RuntimeError" and TIMED_OUT.search(peer["message"]), peer["message"]
    note = _first(trails[0], "collective_failed")["note"]
    assert f"only at the process-group timeout ({PG_TIMEOUT:g} s)" in note and note in peer["traceback"]
    assert PG_TIMEOUT - 1 <= _first(trails[0], "exit")["ts"] - raised["ts"] <= PG_TIMEOUT + SLACK


# ---------------------------------------------------------------- SIGKILL of one rank of examples/ddp.py
STEPS, INTERVAL, KILL_TIMEOUT = 60, 10, 20.0


def _example(workspace: Path) -> list[str]:
    return [
        sys.executable, str(ROOT / "examples" / "ddp.py"), "--workspace", str(workspace), "--steps", str(STEPS),
        "--interval", str(INTERVAL), "--timeout", str(KILL_TIMEOUT), "--step-seconds", "0.03",
    ]  # fmt: skip


@pytest.mark.parametrize("killed", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_sigkill_of_one_rank_fails_the_other_and_both_resume_from_the_last_checkpoint(
    tmp_path: Path, killed: int
) -> None:
    workspace = tmp_path / "ws"
    survivor = 1 - killed
    with Ranks(lambda rank: _example(workspace), tmp_path / "first") as ranks:
        deadline = time.monotonic() + 60
        # Past the second checkpoint, in the middle of an interval.
        while not any(
            e["event"] == "checkpoint_saved" and e["saved_step"] >= 2 * INTERVAL for e in events(workspace, 0)
        ):
            assert time.monotonic() < deadline, f"no checkpoint at step {2 * INTERVAL} after 60 s"
            assert all(p.poll() is None for p in ranks.procs), ranks.wait(0).describe()
            time.sleep(0.02)
        time.sleep(0.1)
        ranks.kill(killed)
        first = ranks.wait(KILL_TIMEOUT + SLACK)
    assert not first.hung, f"rank {survivor} did not exit after its peer was killed\n{first.describe()}"
    assert first.codes[killed] == -9
    assert first.codes[survivor] in FAILED, first.describe()
    assert f"rank {survivor} of 2 failed at step" in first.stderr[survivor]  # the example's message
    assert "resume from the last complete checkpoint" in first.stderr[survivor]
    trail = events(workspace, survivor)
    assert (_first(trail, "exit")["reason"], _first(trail, "exit")["code"]) == ("failed", 1)
    saved = [e["saved_step"] for e in events(workspace, 0) if e["event"] == "checkpoint_saved"]
    assert saved and saved[-1] >= 2 * INTERVAL and saved[-1] < STEPS

    with Ranks(lambda rank: _example(workspace), tmp_path / "second") as ranks:
        second = ranks.wait(90)
    assert second.codes == {0: 0, 1: 0}, second.describe()
    for rank in range(WORLD):
        attempt = [e for e in events(workspace, rank) if e["attempt"] == 1]
        loaded = _first(attempt, "checkpoint_loaded")
        assert loaded["from_step"] == saved[-1]  # the last complete checkpoint before the kill
        assert _first(attempt, "exit")["reason"] == "completed" and _first(attempt, "exit")["step"] == STEPS
    assert summary(events(workspace, 0), attempt=1)["steps"] == summary(events(workspace, 1), attempt=1)["steps"]
    assert audit_problems(workspace) == [] and run_problems(workspace) == []  # attempt 1 resumed and completed
    assert killed_ranks(workspace) == {0: [killed]}  # only the killed rank's exit is missing
