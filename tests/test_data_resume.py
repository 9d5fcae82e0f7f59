"""Data resume: a resumed run draws the batches the uninterrupted one would have drawn, and finding
the position does not load the batches before it (``data_resume``, ``trainfsm.data_state``).

Each test trains straight for ``total`` steps, then trains ``at`` steps with a checkpoint there and
resumes a fresh trainer (in a process whose random state was disturbed) up to ``total``: the
samples each resumed step saw, the final parameters and the ``data_resumed`` record are checked.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from tests.helpers import trail_events
from trainfsm import BaseTrainer, CheckpointingHook


class Samples(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """``n`` fixed samples that know their index; counts its loads (in this process).
    ``augment`` adds noise drawn from the loading process's global generator, as a random
    augmentation in ``__getitem__`` does."""

    def __init__(self, n: int, augment: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = torch.randn(n, 1, generator=generator)
        self.augment = augment
        self.loads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        self.loads += 1
        x = self.x[index]
        if self.augment:
            x = x + 0.1 * torch.rand(4)
        return index, x, self.y[index]


class Stream(IterableDataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.samples = Samples(n)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        return (self.samples[i] for i in range(len(self.samples)))


class Trainer(BaseTrainer):
    """A linear model on whatever loader ``make_loader`` builds; ``seen`` holds each micro-batch's
    sample indices."""

    def __init__(self, make_loader: Callable[[], Any], hook: CheckpointingHook, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        self.make_loader = make_loader
        self.hook = hook
        self.seen: list[list[int]] = []

    def build_data_loader(self) -> Any:
        return self.make_loader()

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.05)  # type: ignore[union-attr]

    def build_hooks(self) -> list[Any]:
        return [self.hook]

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        index, x, y = batch
        self.seen.append(torch.as_tensor(index).reshape(-1).tolist())
        return nn.functional.mse_loss(self.model(x.reshape(-1, 4)), y.reshape(-1, 1)), {}  # type: ignore[misc]


def train(
    workspace: Path,
    make_loader: Callable[[], Any],
    steps: int,
    seed: int = 1,
    global_batch_size: int | None = None,
    **hook: Any,
) -> Trainer:
    hook.setdefault("interval", 10**9)  # only the last step is saved
    torch.manual_seed(seed)
    random.seed(seed)
    trainer = Trainer(
        make_loader,
        CheckpointingHook(**hook),
        max_steps=steps,
        workspace=workspace,
        global_batch_size=global_batch_size,
    )
    trainer.train()
    return trainer


def resumed_run(tmp_path: Path, make_loader: Callable[[], Any], at: int, total: int, **hook: Any) -> dict[str, Any]:
    """Straight and interrupted-then-resumed runs; what a test compares."""
    straight = train(tmp_path / "straight", make_loader, total, **hook)
    train(tmp_path / "resumed", make_loader, at, **hook)
    resumed = train(tmp_path / "resumed", make_loader, total, seed=999, **hook)  # all must come from the checkpoint
    trail = trail_events(tmp_path / "resumed")
    [record] = [e for e in trail if e["event"] == "data_resumed"]
    return {"straight": straight, "resumed": resumed, "record": record}


def same_parameters(a: BaseTrainer, b: BaseTrainer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))  # type: ignore[union-attr]


def assert_exact(found: dict[str, Any], at: int) -> None:
    straight, resumed = found["straight"], found["resumed"]
    assert resumed.seen == straight.seen[len(straight.seen) - len(resumed.seen) :]
    assert len(resumed.seen) == len(straight.seen) - at
    assert same_parameters(straight, resumed)


def test_a_map_style_dataloader_resumes_deep_in_the_epoch_without_loading_a_skipped_sample(tmp_path: Path) -> None:
    loaders: list[DataLoader[Any]] = []

    def make() -> DataLoader[Any]:
        loaders.append(DataLoader(Samples(64_000), batch_size=16, shuffle=True, drop_last=True))
        return loaders[-1]

    found = resumed_run(tmp_path, make, at=3000, total=3005)
    assert_exact(found, 3000)
    # Only what the 5 resumed steps used, and the batch after the final save, drawn for its fingerprint.
    assert loaders[-1].dataset.loads == 6 * 16  # type: ignore[attr-defined]
    record = found["record"]
    assert (record["mode"], record["epoch"], record["batches"], record["positioned"]) == ("sampler", 0, 3000, 3000)
    assert "nothing is loaded" in record["why"]


def _shuffled_partial_batches() -> DataLoader[Any]:
    # 8 batches an epoch, the last of 2; random augmentation drawn in this process is exact too
    return DataLoader(Samples(30, augment=True), batch_size=4, shuffle=True)


def _distributed() -> DataLoader[Any]:
    sampler = DistributedSampler(Samples(30), num_replicas=2, rank=1, shuffle=True, seed=3)
    return DataLoader(sampler.dataset, batch_size=4, sampler=sampler)  # type: ignore[arg-type]


class Descending:
    """A custom batch sampler: batches of 3 in descending index order, then a shuffled order of the
    batches drawn from the global generator."""

    def __iter__(self) -> Iterator[list[int]]:
        batches = [list(range(i, max(i - 3, -1), -1)) for i in range(29, -1, -3)]
        return iter([batches[i] for i in torch.randperm(len(batches)).tolist()])

    def __len__(self) -> int:
        return 10


def _custom_batch_sampler() -> DataLoader[Any]:
    return DataLoader(Samples(30), batch_sampler=Descending())  # type: ignore[arg-type]


class EagerShuffle:
    """A custom sampler that draws its order from the global generator when iter() is called (not
    lazily, as torch's samplers do)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


def _eager_sampler() -> DataLoader[Any]:
    return DataLoader(Samples(30), batch_size=4, sampler=EagerShuffle(30))  # type: ignore[arg-type]


def _own_generator() -> DataLoader[Any]:
    return DataLoader(Samples(30), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))


def _no_batching() -> DataLoader[Any]:
    return DataLoader(Samples(30), batch_size=None, shuffle=True)  # one sample a step, indices skipped singly


LOADERS = {
    "shuffle, last batch partial": _shuffled_partial_batches,
    "DistributedSampler with set_epoch": _distributed,
    "custom batch_sampler": _custom_batch_sampler,
    "custom sampler drawing at iter()": _eager_sampler,
    "DataLoader(generator=...)": _own_generator,
    "batch_size=None": _no_batching,
    "shuffle, drop_last": lambda: DataLoader(Samples(30), batch_size=4, shuffle=True, drop_last=True),
}


@pytest.mark.parametrize("at", [3, 13], ids=["epoch 0", "epoch 1"])
@pytest.mark.parametrize("kind", list(LOADERS))
def test_sampler_resume_draws_the_batches_of_the_uninterrupted_run(tmp_path: Path, kind: str, at: int) -> None:
    found = resumed_run(tmp_path, LOADERS[kind], at=at, total=at + 20)  # and on over two more epochs
    assert_exact(found, at)
    record = found["record"]
    assert record["mode"] == "sampler"
    assert record["positioned"] == record["batches"] > 0


def test_a_loaders_own_generator_is_part_of_the_epochs_random_state(tmp_path: Path) -> None:
    # DataLoader(generator=g, shuffle=True) draws each epoch's order from g, not from the global
    # generator: without g's state at the start of the epoch, epoch 1 would resume in epoch 0's order.
    found = resumed_run(tmp_path, _own_generator, at=10, total=12)
    assert_exact(found, 10)
    straight = found["straight"].seen
    assert straight[8:] != straight[:4]  # epoch 1's order (steps 9-12) differs from epoch 0's


def test_workers_replay_by_default_and_stay_exact_with_random_augmentation(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Samples(40, augment=True), batch_size=4, shuffle=True, num_workers=2)

    found = resumed_run(tmp_path, make, at=6, total=9)
    assert_exact(found, 6)
    record = found["record"]
    assert (record["mode"], record["positioned"]) == ("skip", 6)
    assert "num_workers=2" in record["why"] and "data_resume='sampler'" in record["why"]


def test_sampler_mode_with_workers_is_exact_without_random_augmentation(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Samples(40), batch_size=4, shuffle=True, num_workers=2)

    found = resumed_run(tmp_path, make, at=6, total=9, data_resume="sampler")
    assert_exact(found, 6)
    assert (found["record"]["mode"], found["record"]["positioned"]) == ("sampler", 6)


def test_sampler_mode_with_workers_changes_random_augmentation_but_not_the_samples(tmp_path: Path) -> None:
    # What the README's table says: a worker starts afresh, so the noise it draws differs from the
    # uninterrupted run's; the samples and their order are the same.
    def make() -> DataLoader[Any]:
        return DataLoader(Samples(40, augment=True), batch_size=4, shuffle=True, num_workers=2)

    found = resumed_run(tmp_path, make, at=6, total=9, data_resume="sampler")
    assert found["resumed"].seen == found["straight"].seen[6:]
    assert not same_parameters(found["straight"], found["resumed"])


def test_persistent_workers_skip_only_in_the_resumed_epoch(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Samples(24), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)

    found = resumed_run(tmp_path, make, at=4, total=16, data_resume="sampler")  # resumed epoch 0, then epochs 1, 2
    assert_exact(found, 4)


def test_an_iterable_dataset_is_replayed_and_the_trail_says_what_it_cost(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Stream(40), batch_size=4)

    found = resumed_run(tmp_path, make, at=7, total=9)
    assert_exact(found, 7)
    record = found["record"]
    assert (record["mode"], record["batches"], record["positioned"]) == ("skip", 7, 7)
    assert record["seconds"] >= 0 and "only replaying" in record["why"] and "StatefulDataLoader" in record["why"]


def test_a_plain_list_is_replayed(tmp_path: Path) -> None:
    samples = Samples(12)
    collate = torch.utils.data.default_collate
    batches = [collate([samples[i] for i in range(j, j + 3)]) for j in range(0, 12, 3)]
    found = resumed_run(tmp_path, lambda: batches, at=2, total=6)
    assert_exact(found, 2)
    assert (found["record"]["mode"], found["record"]["positioned"]) == ("skip", 2)


def test_sampler_mode_on_a_loader_without_a_sampler_names_the_fix(tmp_path: Path) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Stream(40), batch_size=4)

    train(tmp_path, make, 3)
    with pytest.raises(ValueError, match=r'data_resume="sampler" needs a torch.utils.data.DataLoader over a map-style'):
        train(tmp_path, make, 6, data_resume="sampler")


def test_an_unknown_data_resume_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"data_resume must be one of \('auto', 'state', 'sampler', 'skip', 'none'\)"):
        CheckpointingHook(interval=1, data_resume="rewind")


def stateful_dataloader() -> Any:
    """torchdata's StatefulDataLoader: the extra trainfsm[data], part of the test set-up (dev)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader


@pytest.mark.parametrize(
    ("workers", "augment"), [(0, True), (2, False)], ids=["0 workers, random augmentation", "2 workers"]
)
def test_torchdatas_stateful_dataloader_resumes_from_its_own_state_exactly(
    tmp_path: Path, workers: int, augment: bool
) -> None:
    loader_type = stateful_dataloader()

    def make() -> Any:
        return loader_type(Samples(40, augment=augment), batch_size=4, shuffle=True, num_workers=workers)

    found = resumed_run(tmp_path, make, at=13, total=17)  # in the second epoch
    assert_exact(found, 13)
    record = found["record"]
    assert (record["mode"], record["positioned"]) == ("state", 0)
    assert "state_dict" in record["why"]


def test_torchdatas_stateful_dataloader_with_a_distributed_sampler_resumes_exactly(tmp_path: Path) -> None:
    loader_type = stateful_dataloader()

    def make() -> Any:
        sampler = DistributedSampler(Samples(30), num_replicas=2, rank=1, shuffle=True, seed=3)
        return loader_type(sampler.dataset, batch_size=4, sampler=sampler, num_workers=2)  # type: ignore[arg-type]

    found = resumed_run(tmp_path, make, at=6, total=10)
    assert_exact(found, 6)
    assert found["record"]["mode"] == "state"


def test_torchdatas_stateful_dataloader_does_not_restore_random_augmentation_in_workers(tmp_path: Path) -> None:
    # Measured for the README's table: StatefulDataLoader saves its sampler's position and a
    # Stateful dataset's state, not a worker's random generators, so workers start afresh.
    loader_type = stateful_dataloader()

    def make() -> Any:
        return loader_type(Samples(40, augment=True), batch_size=4, shuffle=True, num_workers=2)

    found = resumed_run(tmp_path, make, at=13, total=17)
    assert found["resumed"].seen == found["straight"].seen[13:]
    assert not same_parameters(found["straight"], found["resumed"])


# ------------------------------------------------- 2 gloo ranks, SIGKILL at a random moment, resume
DDP_STEPS, DDP_INTERVAL = 48, 8  # 16 batches an epoch per rank: the kill and the resume cross epochs


def _ddp(workspace: Path, loader: str, workers: int) -> Callable[[int], list[str]]:
    from tests.distributed.launch import ROOT

    def argv(rank: int) -> list[str]:
        return [
            sys.executable, str(ROOT / "examples" / "ddp.py"), "--workspace", str(workspace), "--steps",
            str(DDP_STEPS), "--interval", str(DDP_INTERVAL), "--step-seconds", "0.03", "--loader", loader,
            "--workers", str(workers),
        ]  # fmt: skip

    return argv


@pytest.mark.skipif(sys.platform != "linux", reason="spawns gloo ranks on Linux")
@pytest.mark.distributed
@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.parametrize(("loader", "workers"), [("stateful", 2), ("dataloader", 0)])
def test_two_ddp_ranks_killed_at_a_random_moment_resume_to_the_uninterrupted_parameters(
    tmp_path: Path, loader: str, workers: int
) -> None:
    from tests.distributed.launch import Ranks, audit_problems, events, killed_ranks, run_problems

    stateful_dataloader()  # the extra must be there: this test must not pass by skipping
    with Ranks(_ddp(tmp_path / "straight", loader, workers), tmp_path / "logs-straight") as ranks:
        straight = ranks.wait(120)
    assert straight.codes == {0: 0, 1: 0}, straight.describe()

    workspace = tmp_path / "killed"
    with Ranks(_ddp(workspace, loader, workers), tmp_path / "logs-first") as ranks:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "checkpoint_saved" for e in events(workspace, 0)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), ranks.wait(0).describe()
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.9))  # anywhere in the next ~2 intervals, a save included
        for rank in (0, 1):
            ranks.kill(rank)  # the whole job, DataLoader workers included (a node lost)
        first = ranks.wait(30)
    assert first.codes == {0: -9, 1: -9}, f"the run ended before the kill: {first.describe()}"

    with Ranks(_ddp(workspace, loader, workers), tmp_path / "logs-second") as ranks:
        second = ranks.wait(120)
    assert second.codes == {0: 0, 1: 0}, second.describe()
    for rank in (0, 1):
        [resumed] = [e for e in events(workspace, rank) if e["event"] == "data_resumed"]
        assert resumed["mode"] == ("state" if loader == "stateful" else "sampler")
    expected = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    found = torch.load(workspace / "final.pt", weights_only=True)
    assert expected.keys() == found.keys() and all(torch.equal(expected[k], found[k]) for k in expected)
    assert audit_problems(workspace) == [] and run_problems(workspace) == []  # the resume completed the run
    assert killed_ranks(workspace) == {0: [0, 1]}  # the killed attempt


def test_a_checkpoint_without_the_loaders_state_starts_a_fresh_iterator_and_says_why(tmp_path: Path) -> None:
    # Saved with a plain DataLoader, resumed with a StatefulDataLoader: no loader state to load.
    train(tmp_path, _shuffled_partial_batches, 3)
    loader_type = stateful_dataloader()
    resumed = train(tmp_path, lambda: loader_type(Samples(30), batch_size=4, shuffle=True), 5)
    assert len(resumed.seen) == 2 and all(len(batch) == 4 for batch in resumed.seen)
    trail = trail_events(tmp_path)
    [record] = [e for e in trail if e["event"] == "data_resumed"]
    assert (record["mode"], record["batches"], record["positioned"]) == ("none", 0, 0)
    assert record["why"] == "the checkpoint has no data position for 'state' (saved with another data_resume)"


class EpochStream(IterableDataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """An iterable dataset that shuffles by epoch, as WebDataset-style streams do."""

    def __init__(self, n: int) -> None:
        self.samples = Samples(n)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(self.epochs[-1]))
        return (self.samples[int(i)] for i in order)


def test_an_iterable_dataset_with_set_epoch_is_told_each_epoch(tmp_path: Path) -> None:
    datasets: list[EpochStream] = []

    def make() -> DataLoader[Any]:
        datasets.append(EpochStream(8))
        return DataLoader(datasets[-1], batch_size=4)

    trainer = train(tmp_path, make, 6)  # 2 batches an epoch: epochs 0, 1, 2
    assert datasets[-1].epochs == [0, 1, 2, 3]  # 3: the final save's next batch, drawn for the ledger
    assert trainer.seen[0:2] != trainer.seen[2:4]  # another order in each epoch


def test_the_dataset_is_told_besides_a_distributed_sampler(tmp_path: Path) -> None:
    told: list[int] = []

    class Told(Samples):
        def set_epoch(self, epoch: int) -> None:
            told.append(epoch)

    sampler = DistributedSampler(Told(8), num_replicas=1, rank=0, shuffle=True)
    train(tmp_path, lambda: DataLoader(sampler.dataset, batch_size=4, sampler=sampler), 4)
    assert told == [0, 1, 2] and sampler.epoch == 2  # 2: the final save's next batch, drawn for the ledger


def test_a_run_that_leaves_after_a_save_records_the_batch_a_resume_must_draw_first(tmp_path: Path) -> None:
    """Drawn after the state was captured and not trained: the resumed run's first batch is the same."""
    trainer = train(tmp_path, lambda: DataLoader(Samples(40), batch_size=4, shuffle=True), 3)
    assert len(trainer.seen) == 3  # the fingerprinted batch was not trained
    train(tmp_path, lambda: DataLoader(Samples(40), batch_size=4, shuffle=True), 5)
    fingerprints = [e for e in trail_events(tmp_path) if e["event"] == "batch_fingerprint"]
    assert [(e["after"], e["from_step"], e["epoch"], e["batches"]) for e in fingerprints] == [
        ("save", 3, 0, 4),
        ("resume", 3, 0, 4),
        ("save", 5, 0, 6),
    ]
    assert fingerprints[0]["fingerprint"] == fingerprints[1]["fingerprint"]


def test_each_epochs_first_batch_is_fingerprinted(tmp_path: Path) -> None:
    train(tmp_path, lambda: DataLoader(Samples(8), batch_size=4, shuffle=True), 5)
    epochs = [e for e in trail_events(tmp_path) if e["event"] == "epoch"]
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, 1), (1, 3), (2, 5)]
    assert len({e["fingerprint"] for e in epochs}) == 3


def test_global_batch_size_sets_the_accumulation_and_ends_each_epoch_at_its_last_full_global_batch(
    tmp_path: Path,
) -> None:
    """10 samples, global batches of 4 (2 micro-batches of 2): 2 steps an epoch, 2 samples left out."""
    sampler = DistributedSampler(Samples(10), num_replicas=1, rank=0, shuffle=True, seed=0)
    torch.manual_seed(1)
    trainer = Trainer(
        lambda: DataLoader(sampler.dataset, batch_size=2, sampler=sampler),
        CheckpointingHook(interval=10**9),
        max_steps=4,
        global_batch_size=4,
        workspace=tmp_path,
    )
    trainer.train()
    assert trainer.gradient_accumulation_steps == 2
    for epoch, seen in enumerate((trainer.seen[:4], trainer.seen[4:])):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert [index for batch in seen for index in batch] == order[:8]


def test_a_global_batch_size_the_loader_cannot_make_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=5 is not a multiple of world_size 1 x .*batch_size 2"):
        train(tmp_path, lambda: DataLoader(Samples(10), batch_size=2), 2, global_batch_size=5)


def test_global_batch_size_and_a_gradient_accumulation_steps_that_disagree_are_an_error_naming_both(
    tmp_path: Path,
) -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(Samples(10), batch_size=2)

    def run(accumulation: int) -> Trainer:
        trainer = Trainer(
            loader,
            CheckpointingHook(interval=10**9),
            max_steps=1,
            global_batch_size=4,
            gradient_accumulation_steps=accumulation,
            workspace=tmp_path / str(accumulation),
        )
        trainer.train()
        return trainer

    assert run(2).gradient_accumulation_steps == 2  # the same: accepted
    with pytest.raises(ValueError, match=r"means gradient_accumulation_steps=2, but gradient_accumulation_steps=3 was"):
        run(3)
