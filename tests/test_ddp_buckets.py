"""A resumed DDP run of 3 or 4 ranks trains the uninterrupted run's bits (issue 48).

DDP rebuilds its gradient buckets after its first backward (its second with ``static_graph``),
in the order the gradients became ready; a new DDP starts with one bucket in parameter order.
With more than two ranks a sum's order follows the layout, so a resume used to differ from an
uninterrupted run in the last bits. ``trainfsm.ddp_buckets`` keeps the gradient order in the
checkpoint and takes the resumed DDP through zero backwards in that order before its first step.

Each case of ``tests/distributed/buckets_worker.py`` runs straight through and, in another
workspace, stops and resumes with a new trainer and a new DDP; ``not_primed`` is the same resume
with priming switched off: it must differ, or these tests could not see a wrong layout. The
relaunches under torchrun (a new process) are ``tests/faults/ddp_ranks.py``'s trials.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import audit_problems, events, run_worker
from tests.faults import ddp_ranks

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux"), pytest.mark.distributed]

WORKER = Path(__file__).resolve().parent / "distributed" / "buckets_worker.py"
WORLD = 3
FAST = ("default", "not_primed")
SLOW = (
    "after_one_step",
    "wrap_model",
    "no_sync",
    "static_graph",
    "static_graph_after_one_step",
    "gradient_as_bucket_view",
    "model_changed",
)


def launch(out: Path, cases: tuple[str, ...]) -> tuple[Path, list[dict[str, Any]]]:
    outcome = run_worker("buckets", out, 300, "--cases", ",".join(cases), world=WORLD, worker=WORKER)
    assert set(outcome.codes.values()) == {0} and not outcome.hung, outcome.describe()
    return out, [torch.load(out / f"buckets.rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return launch(tmp_path_factory.mktemp("buckets"), FAST)


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    return launch(tmp_path_factory.mktemp("buckets_slow"), SLOW)


def exact(result: dict[str, Any]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(result["straight"], result["resumed"], strict=True))


def bucket_events(out: Path, case: str, rank: int) -> list[tuple[int, str, Any, Any, Any]]:
    trail = events(out / case / "resumed", rank)
    return [
        (e["attempt"], e["action"], e["passes"], e["exact"], e["same_order"])
        for e in trail
        if e["event"] == "ddp_buckets"
    ]


def test_a_resumed_ddp_of_three_ranks_ends_with_the_uninterrupted_runs_parameters(
    fast: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = fast
    for result in results:
        assert result["default"]["steps"] == 8
        assert exact(result["default"])
        assert result["default"]["warnings"] == []


def test_without_priming_the_same_resume_differs_in_the_last_bits(fast: tuple[Path, list[dict[str, Any]]]) -> None:
    """The control: these tests see a resume on DDP's first layout (what every resume was before)."""
    _, results = fast
    for result in results:
        straight, resumed = result["not_primed"]["straight"], result["not_primed"]["resumed"]
        assert not exact(result["not_primed"])
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(straight, resumed, strict=True))


def test_the_trail_says_the_order_was_recorded_then_primed_and_checked(fast: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = fast
    for rank in range(WORLD):
        assert bucket_events(out, "default", rank) == [
            (0, "recorded", None, None, None),
            (1, "primed", 1, None, None),
            (1, "checked", 1, True, True),
        ]
    assert audit_problems(out / "default" / "resumed") == []


def test_the_audit_notes_an_attempt_whose_check_failed(fast: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """A real trail with its ``checked`` events turned false (what a torch whose reducer ignored the
    zero pass would write): the audit says the attempt may not be bit-exact."""
    import json
    import shutil

    from trainfsm.tools import audit

    out, _ = fast
    copy = tmp_path / "resumed"
    shutil.copytree(out / "default" / "resumed" / "logs", copy / "logs")
    for path in (copy / "logs").glob("events.rank*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for line in lines:
            if line["event"] == "ddp_buckets" and line["action"] == "checked":
                line.update(exact=False, rebuilt=False)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = audit.render(audit.audit([copy]))
    assert "attempt 1: DDP's bucket layout may differ from the saved run's (DDP did not rebuild its buckets" in text
    assert "attempt 0: DDP" not in text


@pytest.mark.slow
@pytest.mark.parametrize("case", ["after_one_step", "wrap_model", "no_sync", "static_graph", "gradient_as_bucket_view"])
def test_every_ddp_configuration_resumes_bit_exact(slow: tuple[Path, list[dict[str, Any]]], case: str) -> None:
    out, results = slow
    for rank, result in enumerate(results):
        assert exact(result[case]), case
        passes = 2 if case == "static_graph" else 1
        assert bucket_events(out, case, rank)[1:] == [
            (1, "primed", passes, None, None),
            (1, "checked", passes, True, True),
        ]


@pytest.mark.slow
def test_a_static_graph_saved_after_one_step_is_primed_once_and_rebuilds_later(
    slow: tuple[Path, list[dict[str, Any]]],
) -> None:
    """It had run one of the two backwards DDP rebuilds after (attempt 0 never learnt the order):
    one pass, and DDP must not have rebuilt at the first resumed step (it rebuilds later, from this
    run's order, as the uninterrupted run did)."""
    out, results = slow
    for rank, result in enumerate(results):
        assert exact(result["static_graph_after_one_step"])
        assert bucket_events(out, "static_graph_after_one_step", rank) == [
            (1, "primed", 1, None, None),
            (1, "recorded", None, None, None),  # the order is known once the second backward ended
            (1, "checked", 1, True, None),
        ]


@pytest.mark.slow
def test_a_model_whose_trainable_parameters_changed_is_not_primed_and_says_so(
    slow: tuple[Path, list[dict[str, Any]]],
) -> None:
    from trainfsm.tools import audit

    out, results = slow
    for rank, result in enumerate(results):
        assert result["model_changed"]["steps"] == 8  # the run goes on
        assert all(torch.isfinite(p).all() for p in result["model_changed"]["resumed"])
        [message] = result["model_changed"]["warnings"]
        assert (
            "the model's parameters changed since the checkpoint was saved (8 parameter tensors then, 6 now" in message
        )
        assert "find_unused_parameters=True" in message
        # Not primed, then the order this attempt's own DDP rebuilt from, for a later resume.
        not_primed, recorded = [
            e
            for e in events(out / "model_changed" / "resumed", rank)
            if e["event"] == "ddp_buckets" and e["attempt"] == 1
        ]
        assert not_primed["action"] == "not_primed" and "parameters changed" in not_primed["reason"]
        assert recorded["action"] == "recorded" and recorded["fingerprint"]
    text = audit.render(audit.audit([out / "model_changed" / "resumed"]))
    assert "attempt 1: DDP's bucket layout may differ from the saved run's (not primed: the model's parameters" in text


@pytest.mark.faults
@pytest.mark.parametrize(
    ("ranks", "faults"),
    [
        pytest.param(3, ("kill", "signal"), marks=pytest.mark.slow),  # fast tier: the in-process 3-rank cases
        pytest.param(4, ("signal",), marks=pytest.mark.slow),
        pytest.param(4, ("kill", "kill"), marks=pytest.mark.slow),
    ],
    ids=["3 ranks, SIGKILL then SIGUSR1 at torchrun", "4 ranks, SIGUSR1 at torchrun", "4 ranks, SIGKILL twice"],
)
def test_relaunched_under_torchrun_after_a_fault_the_run_ends_bit_exact(
    ranks: int, faults: tuple[str, ...], tmp_path: Path
) -> None:
    expected = ddp_ranks.reference(tmp_path, ranks)
    assert ddp_ranks.trial(tmp_path / "trial", expected, ranks, list(faults), random.Random(ranks)) == ""


# ---------------------------------------------------------------- one process (a group of one)
@pytest.fixture
def group(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_rank_ddp(**kw: Any) -> Any:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    return DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), **kw)


def test_this_torch_has_every_private_call_the_priming_needs(group: Any) -> None:
    """Fails on a torch whose DDP lost one: then the trainer warns and does not prime. (A torch that
    kept the calls but changed what they do is caught at run time: the ``checked`` event.)"""
    from trainfsm import ddp_buckets

    assert ddp_buckets.unsupported(one_rank_ddp()) is None
    assert ddp_buckets.unsupported(one_rank_ddp(static_graph=True)) is None


def test_a_sparse_embedding_is_not_primed(group: Any) -> None:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from trainfsm import ddp_buckets

    ddp = DistributedDataParallel(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    assert "sparse-gradient embedding" in (ddp_buckets.unsupported(ddp) or "")


def test_the_order_is_recorded_at_the_first_synchronised_backward_and_its_hooks_removed(group: Any) -> None:
    """Nothing of it runs on later steps: no hook is left on any parameter."""
    from trainfsm import ddp_buckets

    ddp = one_rank_ddp()
    reports: list[tuple[str, dict[str, Any]]] = []
    order = ddp_buckets.BucketOrder(ddp, lambda action, fields: reports.append((action, fields)))
    params = order.params
    with ddp.no_sync():  # DDP ignores this backward: so does the recording
        ddp(torch.randn(3, 4)).sum().backward()
    assert order.order is None and all(p._post_accumulate_grad_hooks for p in params)
    ddp(torch.randn(3, 4)).sum().backward()
    assert order.order == [3, 2, 1, 0]  # the last layer's gradients first, bias before weight
    assert order.synced == 1
    assert [action for action, _ in reports] == ["recorded"]
    assert all(not p._post_accumulate_grad_hooks for p in params)
    saved = order.state()
    assert (saved["order"], saved["synced"], saved["params"]) == ([3, 2, 1, 0], 1, 4)
