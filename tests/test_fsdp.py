"""FSDP on 2 real gloo ranks (CPU): ``fully_shard`` trains like one process on the concatenated
batches, ``state_dict()``/``load_state_dict()`` honour ``state_dict_options`` (sharded DTensors or
full tensors) and round-trip, and the checkpoint hook resumes from a full state dict.

Also: a NaN in one rank's gradient shard makes every rank retry (the finite check all-reduces its
flag when gradients are sharded); the checkpoint hook saves a sharded model state with DCP
(``sharded="auto"``) and resumes it exactly; it resumes with ``cpu_offload=True``; and a full
state dict loads into an optimizer without tensor state (plain SGD). The older
``FullyShardedDataParallel`` wrapper refuses to run without an accelerator (skipped, with torch's
message).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import Outcome, audit_problems, events, run_worker, summary
from tests.distributed.worker import reference

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux"), pytest.mark.distributed]

WORLD = 2


def _load(out: Path, scenario: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{scenario}.rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp")
    outcome = run_worker("fsdp", out, 120, "--pg-timeout", "5")  # a regression would leave a rank waiting
    assert outcome.codes == {0: 0, 1: 0} and not outcome.hung, outcome.describe()
    return out, _load(out, "fsdp")


@pytest.fixture(scope="module")
def checkpoint_run(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Save at step 3, then a differently initialised run resumes: per case and rank, each run's
    parameters and step, or its error."""
    return [result["checkpoint"] for result in fsdp_run[1]]


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Outcome, Path]:
    """Only rank 1's gradient shard is NaN at step 2: with grad_clip (``clip``), then without."""
    out = tmp_path_factory.mktemp("fsdp_nan")
    outcome = run_worker("fsdp_nan", out, 60, "--pg-timeout", "10")
    assert not outcome.hung, outcome.describe()  # bounded either way: 10 s process-group timeout
    return outcome, out


def test_fully_shard_trains_like_one_process_on_the_concatenated_batches(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, results = fsdp_run
    expected = reference(steps=3, accumulation=2, world=WORLD, lr=0.1)
    assert results[0]["train"]["grad_types"] == ["DTensor"]
    for result in results:  # the gathered (full) parameters, on each rank
        for got, want in zip(result["train"]["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    trails = [summary(events(out / "train", rank)) for rank in range(WORLD)]
    assert trails[0] == trails[1] and trails[0]["exit"] == [(3, "completed", 0)]
    assert audit_problems(out / "train") == []


def test_loss_none_on_a_fully_sharded_model_warns(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fsdp_run
    assert [r["loss_none_warnings"] for r in results] == [["LossNoneWarning"]] * WORLD


def test_older_fsdp_wrapper_on_cpu(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fsdp_run
    if results[0]["fsdp1"] != "ok":  # torch 2.13: "FSDP needs a non-CPU accelerator device, ..."
        pytest.skip(f"FullyShardedDataParallel does not run on CPU/gloo here: {results[0]['fsdp1']}")


@pytest.mark.parametrize("label", ["default", "sharded"])
def test_sharded_state_dict_holds_dtensor_shards_and_round_trips(
    fsdp_run: tuple[Path, list[dict[str, Any]]], label: str
) -> None:
    _, results = fsdp_run
    for result in results:
        case = result[label]
        # (type, global shape, this rank's shape): dim 0 split over the 2 ranks.
        assert case["model"] == {
            "0.weight": ("DTensor", (8, 4), (4, 4)),
            "0.bias": ("DTensor", (8,), (4,)),
            "2.weight": ("DTensor", (2, 8), (1, 8)),
            "2.bias": ("DTensor", (2,), (1,)),
        }
        assert case["optimizer_state"]["0.weight"]["exp_avg"] == ("DTensor", (8, 4), (4, 4))
        _assert_round_trip(case)


def test_full_state_dict_holds_whole_tensors_on_every_rank_and_round_trips(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = fsdp_run
    for result in results:
        case = result["full"]
        assert case["model"] == {
            "0.weight": ("Tensor", (8, 4), (8, 4)),
            "0.bias": ("Tensor", (8,), (8,)),
            "2.weight": ("Tensor", (2, 8), (2, 8)),
            "2.bias": ("Tensor", (2,), (2,)),
        }
        assert case["optimizer_state"]["0.weight"]["exp_avg"] == ("Tensor", (8, 4), (8, 4))
        _assert_round_trip(case)


def _assert_round_trip(case: dict[str, Any]) -> None:
    """Trainer B (other init, other data, one step) loaded trainer A's state: B is now A."""
    assert not all(torch.equal(a, b) for a, b in zip(case["a_params"], case["b_before"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(case["a_params"], case["b_after"], strict=True))
    assert case["optim_equal"] and case["step"] == 2


@pytest.mark.parametrize(
    "label",
    [
        "full_adam",
        "full_offload_adam",
    ],
)
def test_checkpoint_hook_resumes_fsdp_from_a_full_state_dict(checkpoint_run: list[dict[str, Any]], label: str) -> None:
    """full_state_dict=True: every rank gathers the whole state; with cpu_offload=True only rank 0
    keeps it (in CPU memory), which is all the hook writes. Every rank then loads the file."""
    for result in checkpoint_run:
        first, resumed = result[label]["first"], result[label]["resumed"]
        assert first["error"] is None and resumed["error"] is None
        assert resumed["step"] == 3
        assert all(torch.equal(a, b) for a, b in zip(first["params"], resumed["params"], strict=True))


def test_checkpoint_hook_saves_a_sharded_fsdp_state_with_dcp_and_resumes_it_exactly(
    checkpoint_run: list[dict[str, Any]],
) -> None:
    """Default options (sharded DTensors): sharded="auto" writes every rank's shards with DCP."""
    for result in checkpoint_run:
        first, resumed = result["default_adam"]["first"], result["default_adam"]["resumed"]
        assert first["error"] is None and resumed["error"] is None, (first["error"], resumed["error"])
        assert resumed["step"] == 3
        assert all(torch.equal(a, b) for a, b in zip(first["params"], resumed["params"], strict=True))


@pytest.mark.parametrize("label", ["full_sgd", "default_sgd"])
def test_checkpoint_hook_resumes_fsdp_with_a_stateless_optimizer(
    checkpoint_run: list[dict[str, Any]], label: str
) -> None:
    for result in checkpoint_run:
        first, resumed = result[label]["first"], result[label]["resumed"]
        assert first["error"] is None
        assert resumed["error"] is None, resumed["error"]
        assert all(torch.equal(a, b) for a, b in zip(first["params"], resumed["params"], strict=True))


# ---------------------------------------------------------------- non-finite gradients in one shard
def test_nan_in_one_shard_with_grad_clip_makes_every_rank_retry(nan_run: tuple[Outcome, Path]) -> None:
    """clip_grad_norm_ on DTensor gradients reduces the norm over every shard: both ranks see it."""
    outcome, out = nan_run
    trails = [summary(events(out / "clip", rank)) for rank in range(WORLD)]
    assert trails[0]["retries"] == trails[1]["retries"] == [(2, 1)], outcome.describe()
    assert trails[0]["exit"] == [(3, "completed", 0)]
    assert trails[0] == trails[1]
    assert audit_problems(out / "clip") == []


def test_nan_in_one_shard_makes_every_rank_retry_the_same_step(nan_run: tuple[Outcome, Path]) -> None:
    outcome, out = nan_run
    trails = [summary(events(out / "no_clip", rank)) for rank in range(WORLD)]
    assert trails[1]["retries"] == [(2, 1)]  # rank 1 owns rows 4-7, where the NaN is
    # trainfsm audit sees it too: "rank_disagreement" (retry steps, steps done) in attempt 0.
    assert audit_problems(out / "no_clip") == [], audit_problems(out / "no_clip")
    assert trails[0]["retries"] == [(2, 1)], f"rank 0 did not retry; outcome: {outcome.describe()}"
    assert outcome.codes == {0: 0, 1: 0}, outcome.describe()
    assert trails[0] == trails[1]
