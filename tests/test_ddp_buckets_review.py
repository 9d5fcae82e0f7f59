"""Cases the primed DDP resume of issue 48 (``trainfsm.ddp_buckets``) must also handle; each fails
on main at 867d9bd (the review of issue 48).

- A model in ``channels_last`` (any convolution trained the GPU way): ``prime`` calls
  ``param.view(-1)`` on a non-contiguous parameter and RESTORE raises, so the run can never resume.
- ``static_graph=True`` with a parameter forward never uses (what ``static_graph`` exists for):
  resumed after one step, the zero pass makes the unused parameter "used" in DDP's first static
  iteration, and the run fails two steps later ("Expected to have finished reduction"); resumed
  later, the saved order lacks the unused parameter and the resume is refused as "does not name
  each parameter once", not bit-exact.
- ``bucket_cap_mb`` changed between save and resume: the layout differs from the saved one, yet the
  trail says ``checked`` with ``exact`` and ``same_order`` true and ``trainfsm audit`` says nothing.
- A DDP inside another module (the model ``build_model`` returns holds the DDP): never primed, no
  warning, no trail event: silently not bit-exact.

The first three are shown in one process (a group of one: the reducer's logic does not depend on the
number of ranks; under a second each); the 3-rank runs under the trainer (bit-exactness, the trail and
the audit) are ``tests/distributed/buckets_review_worker.py``'s cases, in the full tier.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks on Linux"), pytest.mark.distributed]

Reports = list[tuple[str, dict[str, Any]]]


@pytest.fixture
def group(tmp_path: Path) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class WithSpare(nn.Module):
    """Two layers and a third that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.one, self.two, self.spare = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.two(torch.tanh(self.one(x)))  # type: ignore[no-any-return]


def plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def conv_channels_last() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 6 * 6, 2))
    return model.to(memory_format=torch.channels_last)


def steps(model: nn.Module, n: int, shape: tuple[int, ...] = (3, 4)) -> None:
    for _ in range(n):
        model(torch.randn(*shape)).sum().backward()
        for p in model.parameters():
            p.grad = None


def saved_after(ddp: Any, n: int, shape: tuple[int, ...] = (3, 4)) -> dict[str, Any]:
    """What a checkpoint of ``ddp``'s run keeps after ``n`` steps."""
    from trainfsm import ddp_buckets

    order = ddp_buckets.BucketOrder(ddp, lambda action, fields: None)
    steps(ddp, n, shape)
    return order.state()


def resumed(make: Callable[[], Any], saved: dict[str, Any]) -> tuple[Any, Any, Reports]:
    """A new DDP primed with ``saved``, as RESTORE does it: (ddp, its BucketOrder, the reports)."""
    from trainfsm import ddp_buckets

    ddp = make()
    reports: Reports = []
    order = ddp_buckets.BucketOrder(ddp, lambda action, fields: reports.append((action, fields)))
    reason = order.mismatch(saved) or ddp_buckets.unsupported(ddp)
    assert reason is None, reason
    order.prime(saved)
    return ddp, order, reports


def checked(reports: Reports) -> dict[str, Any]:
    [fields] = [fields for action, fields in reports if action == "checked"]
    return fields


def test_a_channels_last_model_is_primed(group: Any) -> None:
    """main: RuntimeError "view size is not compatible with input tensor's size and stride" in prime."""
    from torch.nn.parallel import DistributedDataParallel

    def make() -> Any:
        return DistributedDataParallel(conv_channels_last())

    saved = saved_after(make(), 1, (2, 3, 8, 8))
    ddp, _, reports = resumed(make, saved)
    steps(ddp, 2, (2, 3, 8, 8))
    assert checked(reports)["exact"] and checked(reports)["same_order"]


def test_static_graph_with_an_unused_parameter_resumed_after_one_step_trains_on(group: Any) -> None:
    """main: the zero pass marks ``spare`` used in DDP's first static iteration; two steps later
    "Expected to have finished reduction in the prior iteration" (a run the uninterrupted job completes)."""
    from torch.nn.parallel import DistributedDataParallel

    def make() -> Any:
        return DistributedDataParallel(WithSpare(), static_graph=True)

    saved = saved_after(make(), 1)
    assert saved["order"] is None and saved["synced"] == 1  # DDP rebuilds after its second backward
    ddp, _, reports = resumed(make, saved)
    steps(ddp, 3)
    assert checked(reports)["exact"]


def test_static_graph_with_an_unused_parameter_is_primed_after_the_rebuild(group: Any) -> None:
    """main: the recorded order lacks ``spare`` (DDP appends unused parameters to the order it
    rebuilds from), so ``mismatch`` refuses the checkpoint: "does not name each parameter once"."""
    from torch.nn.parallel import DistributedDataParallel

    def make() -> Any:
        return DistributedDataParallel(WithSpare(), static_graph=True)

    saved = saved_after(make(), 3)
    ddp, _, reports = resumed(make, saved)
    steps(ddp, 3)
    assert checked(reports)["exact"] and checked(reports)["same_order"]


def test_a_changed_bucket_cap_is_not_reported_as_the_saved_layout(group: Any) -> None:
    """main: priming goes ahead, and ``checked`` says exact and same_order though DDP rebuilt
    another layout than the saved run's (the checkpoint's ``fingerprint`` is never compared)."""
    from torch.nn.parallel import DistributedDataParallel

    from trainfsm import ddp_buckets

    saved = saved_after(DistributedDataParallel(plain()), 1)

    def small_buckets() -> Any:  # a bucket per parameter, where the saved run had one
        return DistributedDataParallel(plain(), bucket_cap_mb=0.0001)

    ddp = small_buckets()
    order = ddp_buckets.BucketOrder(ddp, lambda action, fields: None)
    assert ddp_buckets.fingerprint(saved["order"], order.params, ddp) != saved["fingerprint"]
    reason = order.mismatch(saved)
    if reason is None:  # primed anyway: then the check must not call this the saved layout
        ddp, _, reports = resumed(small_buckets, saved)
        steps(ddp, 1)
        fields = checked(reports)
        assert not (fields["exact"] and fields["same_order"]), fields


# ---------------------------------------------------------------- 3 ranks, the trainer
WORKER = Path(__file__).resolve().parent / "distributed" / "buckets_review_worker.py"
WORLD = 3
EXACT = ("channels_last", "static_graph_unused_after_one_step", "static_graph_unused")
TRAIL = ("bucket_cap_changed", "nested_ddp")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    from tests.distributed.launch import run_worker

    out = tmp_path_factory.mktemp("buckets_review")
    outcome = run_worker("review", out, 400, "--cases", ",".join(EXACT + TRAIL), world=WORLD, worker=WORKER)
    assert set(outcome.codes.values()) == {0} and not outcome.hung, outcome.describe()
    return out, [torch.load(out / f"review.rank{rank}.pt") for rank in range(WORLD)]


def exact(result: dict[str, Any]) -> bool:
    return result["error"] is None and all(
        torch.equal(a, b) for a, b in zip(result["straight"], result["resumed"], strict=True)
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT)
def test_each_resumes_bit_exact_at_three_ranks(ranks: tuple[Path, list[dict[str, Any]]], case: str) -> None:
    _, results = ranks
    for result in results:
        assert result[case]["error"] is None, result[case]["error"]
        assert exact(result[case])
        assert result[case]["warnings"] == []


@pytest.mark.slow
def test_a_changed_bucket_cap_is_noted_by_the_trail_and_the_audit(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    from tests.distributed.launch import events
    from trainfsm.tools import audit

    out, _ = ranks
    workspace = out / "bucket_cap_changed" / "resumed"
    trail = [e for e in events(workspace, 0) if e["event"] == "ddp_buckets"]
    [recorded] = [e for e in trail if e["action"] == "recorded" and e["attempt"] == 0]
    claims = [e for e in trail if e["attempt"] == 1 and e["action"] == "checked" and e["exact"] and e["same_order"]]
    layouts = {e["fingerprint"] for e in trail if e["attempt"] == 1 and e["action"] in ("primed", "checked")}
    assert not (claims and layouts != {recorded["fingerprint"]}), trail
    assert "bucket layout" in audit.render(audit.audit([workspace]))


@pytest.mark.slow
def test_a_ddp_inside_another_module_is_primed_or_says_it_is_not(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = ranks
    for result in results:
        assert exact(result["nested_ddp"]) or result["nested_ddp"]["warnings"]
