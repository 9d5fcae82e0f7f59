"""A trainloop user switches the import in the middle of a project and loses nothing.

The same script (``user_trainer``) runs with the real ``trainloop`` package (a test dependency,
0.11) and then with ``trainfsm``: trainfsm resumes from trainloop's newest checkpoint at its step,
with its model, optimizer (momentum), scheduler and EMA state, and continues exactly as trainloop
itself would have; trainloop's directories stay as they were, byte for byte. A directory trainfsm
did not write is never replaced or pruned: a run that could save over one stops in RESTORE, with
an error that names it, before a step is lost.

Under DDP (``tests/distributed/trainloop_worker.py``, gloo ranks) trainloop's rank 0 writes the full
state, which every rank loads: trainfsm resumes from it on the same number of ranks, and on another,
as trainloop itself would.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
import torch
import trainloop  # the real package: a test dependency (dev extra), never skipped
from torch import nn

import trainfsm
from trainfsm.checkpoint.manifest import MANIFEST
from trainfsm.checkpoint.store import CheckpointError

from . import helpers
from .distributed.launch import ROOT, Ranks

BATCHES = [
    (torch.randn(4, 3, generator=torch.Generator().manual_seed(i)), torch.full((4, 1), float(i % 3))) for i in range(5)
]


class Batches:
    """An endless, re-iterable stream: each new iterator starts again at the first batch."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (BATCHES[i % len(BATCHES)] for i in itertools.count())


def read_events(workspace: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in helpers.read_events(workspace) if e["event"] == name]


class StepsSeen(trainfsm.BaseHook):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_after_step(self, trainer: Any) -> None:
        self.steps.append(trainer.step)


def user_trainer(
    package: ModuleType, workspace: Path, max_steps: int, extra: tuple[Any, ...] = (), **hook_args: Any
) -> Any:
    """The user's script; ``package`` is the one line that changes (``from trainloop import ...``);
    ``extra``: hooks the test adds."""

    class Trainer(package.BaseTrainer):  # type: ignore[name-defined,misc]
        def build_data_loader(self) -> Batches:
            return Batches()

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

        def build_optimizer(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

        def build_lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.7)

        def build_hooks(self) -> list[Any]:
            args = {"interval": 4, "keep_previous": 1, **hook_args}
            # EMA first: trainloop loads a checkpoint in the CheckpointingHook's on_before_train, which
            # must find the EMA model built.
            return [package.EMAHook(decay=0.9), package.CheckpointingHook(**args), *extra]

        def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y), {}

    return Trainer(max_steps=max_steps, workspace=workspace, device="cpu")


def tree(path: Path) -> dict[str, str]:
    """Every file and link under ``path``: relative name -> sha256 of its bytes, or the link's target."""
    return {
        str(p.relative_to(path)): ("-> " + str(p.readlink()))
        if p.is_symlink()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


def state(trainer: Any) -> dict[str, torch.Tensor]:
    """Model, EMA and optimizer momentum, flat, for an exact comparison."""
    ema = next(h for h in trainer.hooks if type(h).__name__ in ("EMAHook", "EmaHook")).ema_model
    flat = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    flat |= {f"ema.{k}": v for k, v in ema.state_dict().items()}
    for i, s in trainer.optimizer.state_dict()["state"].items():
        flat[f"momentum.{i}"] = s["momentum_buffer"]
    flat["lr"] = torch.tensor(trainer.optimizer.param_groups[0]["lr"])
    return flat


@pytest.fixture
def trained_by_trainloop(tmp_path: Path) -> Path:
    """trainloop trained 10 steps: checkpoints 8/ and 10/ (4/ pruned by keep_previous=1), latest -> 10."""
    workspace = tmp_path / "run"
    user_trainer(trainloop, workspace, max_steps=10).train()
    checkpoints = workspace / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["10", "8", "latest"]
    assert (checkpoints / "latest").readlink() == Path("10")
    return workspace


def test_trainfsm_resumes_from_trainloops_newest_checkpoint_at_its_step(trained_by_trainloop: Path) -> None:
    seen = StepsSeen()
    user_trainer(trainfsm, trained_by_trainloop, max_steps=12, extra=(seen,)).train()
    (loaded,) = read_events(trained_by_trainloop, "checkpoint_loaded")
    assert loaded["format"] == "trainloop" and loaded["from_step"] == 10
    assert loaded["path"] == str(trained_by_trainloop / "checkpoints" / "10")
    assert seen.steps == [11, 12]


def test_the_switched_run_continues_exactly_as_trainloop_would(trained_by_trainloop: Path, tmp_path: Path) -> None:
    """Both resume from the same checkpoint with a fresh data iterator (trainloop saves no data
    position): model, EMA, momentum and learning rate agree bit for bit six steps on."""
    reference_workspace = tmp_path / "reference"
    shutil.copytree(trained_by_trainloop, reference_workspace, symlinks=True)
    reference = user_trainer(trainloop, reference_workspace, max_steps=16)
    reference.train()
    switched = user_trainer(trainfsm, trained_by_trainloop, max_steps=16)
    switched.train()
    expected, got = state(reference), state(switched)
    assert expected.keys() == got.keys()
    assert {k for k in expected if not torch.equal(expected[k], got[k])} == set()
    assert switched.lr_scheduler.state_dict()["last_epoch"] == reference.lr_scheduler.state_dict()["last_epoch"] == 16


def test_a_fresh_start_would_differ(trained_by_trainloop: Path, tmp_path: Path) -> None:
    """The comparison above can fail: without the resume the parameters are not those values."""
    resumed = user_trainer(trainfsm, trained_by_trainloop, max_steps=16)
    resumed.train()
    fresh = user_trainer(trainfsm, tmp_path / "fresh", max_steps=6)
    fresh.train()
    assert not torch.equal(state(resumed)["model.0.weight"], state(fresh)["model.0.weight"])


def test_trainloops_directories_stay_byte_for_byte_through_saves_and_pruning(trained_by_trainloop: Path) -> None:
    checkpoints = trained_by_trainloop / "checkpoints"
    before = {name: tree(checkpoints / name) for name in ("8", "10")}
    user_trainer(trainfsm, trained_by_trainloop, max_steps=24, keep_previous=0).train()
    assert {name: tree(checkpoints / name) for name in ("8", "10")} == before
    ours = sorted(int(p.name) for p in checkpoints.iterdir() if not p.is_symlink() and (p / MANIFEST).is_file())
    assert ours == [24]  # trainfsm pruned its own 12, 16 and 20, nothing of trainloop's
    assert (checkpoints / "latest").readlink() == Path("24")
    assert read_events(trained_by_trainloop, "checkpoint_foreign")[0]["found"] == {"8": "trainloop", "10": "trainloop"}


def test_a_second_resume_takes_trainfsms_own_newer_checkpoint(trained_by_trainloop: Path) -> None:
    user_trainer(trainfsm, trained_by_trainloop, max_steps=12).train()
    user_trainer(trainfsm, trained_by_trainloop, max_steps=14).train()
    loaded = read_events(trained_by_trainloop, "checkpoint_loaded")
    assert [(e["format"], e["from_step"]) for e in loaded] == [("trainloop", 10), ("trainfsm", 12)]


def test_inspect_lists_what_a_trainloop_checkpoint_holds(
    trained_by_trainloop: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No manifest, so nothing to verify: its files load with weights_only=True and are listed, with
    what a resume from it lacks; a workspace finds it through ``checkpoints/latest``."""
    from tests.cli_helpers import cli

    code, out, err = cli(capsys, "inspect", trained_by_trainloop)
    assert (code, err) == (0, ""), err
    lines = out.splitlines()
    found = f"(from {trained_by_trainloop}: checkpoints/latest)"
    assert lines[0] == f"checkpoint {trained_by_trainloop / 'checkpoints' / '10'}  {found}"
    assert lines[1].startswith("written by trainloop (no manifest.json): no sizes or checksums to verify")
    assert lines[2] == "step 10, kept: no"
    assert [line.split()[0] for line in lines[lines.index("files:") + 1 : lines.index("files:") + 4]] == [
        "ema.pt",
        "model.pt",
        "training_state.pt",
    ]
    assert "model (model.pt): 4 entries, 41 values, 164 B" in lines
    assert "training state (training_state.pt): step 10" in lines
    assert "  optimizer: state for 4 parameters (momentum_buffer)" in lines
    assert any(line.startswith("  not saved by trainloop: random state, data position") for line in lines)
    assert "hooks: ema (ema.pt)" in lines
    assert len(lines[1]) <= 120


def test_inspect_fails_a_trainloop_checkpoint_a_resume_would_refuse(
    trained_by_trainloop: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.cli_helpers import cli

    checkpoint = trained_by_trainloop / "checkpoints" / "10"
    torch.save({"step": 10}, checkpoint / "training_state.pt")  # no optimizer: not trainloop's training state
    code, out, err = cli(capsys, "inspect", checkpoint)
    assert (code, out) == (1, "")
    assert "INVALID" in err and "does not hold trainloop's training state" in err


def test_a_kept_trainloop_checkpoint_loads_through_its_keep_directory(tmp_path: Path) -> None:
    """trainloop keeps step 8 as 8_keep/ with an 8 -> 8_keep link; latest -> 8 links on."""
    workspace = tmp_path / "run"
    user_trainer(trainloop, workspace, max_steps=8, keep_steps=[8]).train()
    checkpoints = workspace / "checkpoints"
    assert (checkpoints / "8").readlink() == Path("8_keep")
    user_trainer(trainfsm, workspace, max_steps=9, keep_steps=[8]).train()
    (loaded,) = read_events(workspace, "checkpoint_loaded")
    assert (loaded["format"], loaded["from_step"], loaded["path"]) == ("trainloop", 8, str(checkpoints / "8_keep"))


# ---------------------------------------------------------------- under DDP
# trainloop saves under DDP as it does alone: rank 0 writes ``trainer.state_dict()``, the full model
# (``get_state_dict``: without DDP's ``module.``) and the whole optimizer state, replicated on every
# rank; every rank loads the same files. So the checkpoint is no rank's own: any number of ranks
# can resume from it, each with a fresh data iterator of its own batches (trainloop saves no data
# position), and trainloop itself resumes that way on any number.
WORKER = ROOT / "tests" / "distributed" / "trainloop_worker.py"
F = TypeVar("F", bound=Callable[..., None])


def distributed(test: F) -> F:
    linux = pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux")
    return pytest.mark.distributed(linux(test))


def on_ranks(out: Path, world: int, *runs: str) -> dict[str, list[dict[str, Any]]]:
    """Each ``PACKAGE:WORKSPACE:MAX_STEPS`` of ``runs`` in turn on ``world`` fresh gloo ranks; what
    each rank held after each run: ``{"PACKAGE.WORKSPACE": [rank 0's, rank 1's, ...]}``."""
    argv = [sys.executable, str(WORKER), "--out", str(out), *(arg for run in runs for arg in ("--run", run))]
    with Ranks(lambda rank: argv, out / f"logs.{len(list(out.glob('logs.*')))}", world=world) as started:
        outcome = started.wait(timeout=90)
    assert outcome.codes == dict.fromkeys(range(world), 0), outcome.describe()
    names = [f"{run.split(':')[0]}.{Path(run.split(':')[1]).name}" for run in runs]
    return {
        name: [torch.load(out / f"{name}.rank{rank}.pt", weights_only=True) for rank in range(world)] for name in names
    }


def differing(expected: dict[str, Any], got: dict[str, Any]) -> set[str]:
    """The names whose values are not the same bit for bit (a step or an epoch: not equal)."""
    assert expected.keys() == got.keys()
    same = {k: torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k] for k, v in expected.items()}
    return {k for k, equal in same.items() if not equal}


@pytest.fixture(scope="module")
def trainloop_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """trainloop trained 8 steps on 2 DDP ranks: checkpoints 4/ and 8/, written by rank 0."""
    out = tmp_path_factory.mktemp("ddp")
    on_ranks(out, 2, f"trainloop:{out / 'saved'}:8")
    checkpoints = out / "saved" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["4", "8", "latest"]
    assert sorted(p.name for p in (checkpoints / "8").iterdir()) == ["ema.pt", "model.pt", "training_state.pt"]
    return out


#: trainfsm's workspace resumed on some ranks, each rank's state after it, and trainloop's after its own resume.
Resumed = tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]


def resumed_on(out: Path, world: int) -> Resumed:
    """Two copies of trainloop's workspace resumed to step 12 on ``world`` ranks, one by trainfsm
    (fresh processes), one by trainloop: (trainfsm's workspace, its ranks' state, trainloop's)."""
    for name in (f"trainfsm{world}", f"trainloop{world}"):
        shutil.copytree(out / "saved", out / name, symlinks=True)
    held = on_ranks(out, world, f"trainfsm:{out / f'trainfsm{world}'}:12", f"trainloop:{out / f'trainloop{world}'}:12")
    return out / f"trainfsm{world}", held[f"trainfsm.trainfsm{world}"], held[f"trainloop.trainloop{world}"]


@pytest.fixture(scope="module")
def resumed_on_two(trainloop_on_two_ranks: Path) -> Resumed:
    return resumed_on(trainloop_on_two_ranks, 2)


@pytest.fixture(scope="module")
def resumed_on_three(trainloop_on_two_ranks: Path) -> Resumed:
    return resumed_on(trainloop_on_two_ranks, 3)


def loaded_on_each_rank(workspace: Path, world: int) -> list[tuple[str, int, str]]:
    from .distributed.launch import events

    return [
        (e["format"], e["from_step"], e["path"])
        for rank in range(world)
        for e in events(workspace, rank)
        if e["event"] == "checkpoint_loaded"
    ]


@distributed
@pytest.mark.slow  # two launches of 2 ranks (~17 s): the fast tier resumes trainloop's checkpoints on one
def test_two_ddp_ranks_resume_from_trainloops_checkpoint_at_its_step(resumed_on_two: Resumed) -> None:
    workspace, held, _ = resumed_on_two
    assert loaded_on_each_rank(workspace, 2) == [("trainloop", 8, str(workspace / "checkpoints" / "8"))] * 2
    assert [state["step"] for state in held] == [12, 12]


@distributed
@pytest.mark.slow  # two launches of 2 ranks (~17 s): the fast tier resumes trainloop's checkpoints on one
def test_on_two_ranks_the_switched_run_continues_exactly_as_trainloop_would(resumed_on_two: Resumed) -> None:
    """Each rank's model, EMA, momentum, learning rate and scheduler epoch, bit for bit, four steps on."""
    _, held, reference = resumed_on_two
    assert [differing(expected, got) for expected, got in zip(reference, held, strict=True)] == [set(), set()]


@distributed
@pytest.mark.slow  # two launches of 2 ranks (~17 s): the fast tier resumes trainloop's checkpoints on one
def test_audit_passes_the_workspace_resumed_on_ranks(
    resumed_on_two: Resumed, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.cli_helpers import cli

    code, out, err = cli(capsys, "audit", resumed_on_two[0])
    assert code == 0, out + err
    assert "2 files (2 ranks), 1 attempt" in out and "exit: completed, code 0" in out


@distributed
@pytest.mark.slow
def test_three_ranks_resume_from_a_two_rank_trainloop_checkpoint_as_trainloop_does(
    resumed_on_two: Resumed, resumed_on_three: Resumed, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full state, no rank's own: trainfsm neither refuses it nor splits it, it continues as
    trainloop resumed on three ranks continues, bit for bit; which differs from two ranks' run
    (a third rank's batches are averaged in), so the comparison can fail."""
    from tests.cli_helpers import cli

    workspace, held, reference = resumed_on_three
    assert loaded_on_each_rank(workspace, 3) == [("trainloop", 8, str(workspace / "checkpoints" / "8"))] * 3
    assert [state["step"] for state in held] == [12, 12, 12]
    assert [differing(expected, got) for expected, got in zip(reference, held, strict=True)] == [set()] * 3
    assert "model.0.weight" in differing(resumed_on_two[1][0], held[0])
    code, out, err = cli(capsys, "audit", workspace)
    assert code == 0, out + err


# ---------------------------------------------------------------- nothing foreign is replaced
def test_a_foreign_directory_where_the_run_would_save_stops_it_in_restore(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "8").mkdir(parents=True)
    (checkpoints / "8" / "notes.txt").write_text("my evaluation results, not a checkpoint\n")
    before = tree(checkpoints)
    trainer = user_trainer(trainfsm, tmp_path, max_steps=12)
    with pytest.raises(CheckpointError, match=r"checkpoints/8 was written by something other than trainfsm"):
        trainer.train()
    assert trainer.step == 0 and tree(checkpoints) == before
    assert read_events(tmp_path, "checkpoint_foreign")[0]["found"] == {"8": "unknown"}


def test_the_refusal_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "4_keep").mkdir(parents=True)
    with pytest.raises(CheckpointError) as error:
        user_trainer(trainfsm, tmp_path, max_steps=12).train()
    message = str(error.value)
    assert "saves step 4 there" in message and "never replaces or deletes a directory it did not write" in message
    assert f"Move it out of {tmp_path / 'checkpoints'}" in message and "another path=" in message


def test_a_foreign_directory_past_max_steps_is_left_alone_and_the_run_trains(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "100").mkdir(parents=True)
    (tmp_path / "checkpoints" / "100" / "data.bin").write_bytes(b"\x00\x01")
    before = tree(tmp_path / "checkpoints" / "100")
    user_trainer(trainfsm, tmp_path, max_steps=8).train()
    assert tree(tmp_path / "checkpoints" / "100") == before
    assert [e["saved_step"] for e in read_events(tmp_path, "checkpoint_saved")] == [4, 8]


def test_a_foreign_directory_is_not_called_an_interrupted_save(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    user_trainer(trainfsm, tmp_path, max_steps=1).train()  # 2 is past max_steps: the run goes ahead
    assert read_events(tmp_path, "checkpoint_skipped") == []  # not tried as a checkpoint at all
    assert read_events(tmp_path, "checkpoint_foreign")[0]["found"] == {"2": "unknown"}


def test_a_save_onto_a_directory_that_appeared_during_the_run_fails_and_keeps_it(tmp_path: Path) -> None:
    """The last guard, in the store's save: a directory made after RESTORE checked (here by a hook
    at step 3) is named in the error, and is there untouched afterwards."""

    class MakesADirectory(trainfsm.BaseHook):
        def on_after_step(self, trainer: Any) -> None:
            if trainer.step == 3:
                (tmp_path / "checkpoints" / "4").mkdir(parents=True)
                (tmp_path / "checkpoints" / "4" / "model.pt").write_bytes(b"someone else's")

    trainer = user_trainer(trainfsm, tmp_path, max_steps=8, extra=(MakesADirectory(),))
    with pytest.raises(CheckpointError, match=r"checkpoints/4 was written by something other than trainfsm"):
        trainer.train()
    assert (tmp_path / "checkpoints" / "4" / "model.pt").read_bytes() == b"someone else's"
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "checkpoints").iterdir())


def test_prune_never_deletes_a_foreign_directory(tmp_path: Path) -> None:
    from trainfsm.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        store.save(step, {"model": {"w": torch.ones(1)}}, keep=False)
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "x").write_text("x")
    assert [c.path.name for c in store.prune(keep_previous=0)] == ["1", "2"]
    assert (tmp_path / "0" / "x").read_text() == "x"
    assert [(c.path.name, c.written_by) for c in store.foreign()] == [("0", None)]
