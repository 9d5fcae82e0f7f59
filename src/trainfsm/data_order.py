"""Where a run stands in each epoch's order of samples, whatever its number of ranks.

``DistributedSampler`` draws one order per epoch from ``seed + epoch`` alone, and rank ``r`` of
``W`` takes ``order[r::W]``. After ``b`` micro-batches of ``B`` samples on every rank, the
positions used are exactly ``order[0 : b*B*W]``: a *global position* that means the same at any
world size. A run resumed on ``W'`` ranks continues there when ``b*B*W`` is a multiple of
``W'*B'``: each new rank skips ``b*B*W / (W'*B')`` of its own micro-batches, and every sample of
the epoch is trained once.

An epoch's end depends on ``W`` (the sampler pads the order to a multiple of ``W``, or truncates
it with ``drop_last``; a last micro-batch may be short). With ``global_batch_size=G`` the trainer
ends every epoch at its last full global batch: ``N // G`` optimizer steps of ``G`` samples, the
positions ``[0, (N // G) * G)`` at any world size; the rest of that epoch's order (fewer than
``G`` samples, others each epoch since the order is drawn again) is not trained in it.

Only a loader whose order the trainer can see is continued this way (a ``DataLoader`` whose
sampler or batch sampler's sampler is a ``DistributedSampler`` for this rank and world size,
torchdata's ``StatefulDataLoader`` and ``StatefulDistributedSampler`` included). Anything else
on another world size is refused before training, unless the user accepts an approximation
(``CheckpointingHook(data_reshard="approximate")``), which the trail records.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Final

RESHARD_MODES: Final = ("exact", "approximate")

DISTRIBUTED: Final = "distributed"
UNKNOWN: Final = "unknown"


@dataclass(frozen=True)
class Layout:
    """How one rank's micro-batches map onto each epoch's order (the trail's ``data_layout``)."""

    order: str  # DISTRIBUTED: the mapping below holds; UNKNOWN: ``why`` says what is missing
    why: str | None
    world_size: int
    rank: int
    batch_size: int | None  # B, per rank
    length: int | None  # N, samples in the dataset
    seed: int | None
    shuffle: bool | None
    epoch_batches: int | None  # micro-batches this rank draws per epoch
    global_batch: int | None  # G, when the user stated it
    accumulation: int
    #: Positions of the epoch's order trained per epoch by all ranks together: with G, ``(N // G) * G``;
    #: else the sampler's own epoch (padded or cut to a multiple of W; a short last micro-batch counts
    #: its samples).
    epoch_samples: int | None = None

    @property
    def exact(self) -> bool:
        return self.order == DISTRIBUTED

    def samples(self, batches: int) -> int:
        """The global position after ``batches`` micro-batches on every rank (a short last
        micro-batch holds fewer than B: the epoch's end caps it)."""
        assert self.batch_size is not None
        used = batches * self.batch_size * self.world_size
        return used if self.epoch_samples is None else min(used, self.epoch_samples)

    def as_event(self) -> dict[str, Any]:
        return asdict(self)


#: torchdata's stateful versions of torch's samplers: the same order, and a position they save.
_TORCHDATA: Final = "torchdata.stateful_dataloader.sampler"


def _own(value: Any, base: type, torchdata_name: str) -> bool:
    """``value`` is ``base`` itself, or torchdata's stateful version of it: a subclass with an
    ``__iter__`` of its own may draw any order, which the trainer cannot see."""
    kind = type(value)
    return kind is base or (kind.__module__ == _TORCHDATA and kind.__name__ == torchdata_name)


def distributed_sampler(loader: Any) -> tuple[Any, str | None]:
    """The ``DistributedSampler`` whose order ``loader``'s micro-batches follow, cut into
    consecutive batches; else None and why not."""
    from torch.utils.data import BatchSampler, DistributedSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else None
    sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        return None, (
            f"{type(loader).__name__} draws no torch DistributedSampler, so the trainer cannot see which samples "
            f"each rank draws (a DataLoader with sampler=DistributedSampler(dataset) makes it visible)"
        )
    if not _own(sampler, DistributedSampler, "StatefulDistributedSampler"):
        return None, (
            f"its sampler is {type(sampler).__name__}, a DistributedSampler of its own making: the trainer cannot "
            f"tell which of the epoch's samples it gives each rank (torch's DistributedSampler, or torchdata's "
            f"StatefulDistributedSampler, it can)"
        )
    if batch_sampler is not None and not _own(batch_sampler, BatchSampler, "BatchSampler"):
        return None, (
            f"its batch_sampler is {type(batch_sampler).__name__}: the trainer cannot tell how it groups the "
            f"sampler's indices into batches (torch's BatchSampler, from batch_size=..., it can)"
        )
    return sampler, None


def batch_size(loader: Any) -> int | None:
    size = getattr(loader, "batch_size", None)
    if size is None:  # a user's batch_sampler: torch's and torchdata's BatchSampler say theirs
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def layout_of(loader: Any, rank: int, world: int, accumulation: int, global_batch: int | None) -> Layout:
    """This rank's layout; ``order`` UNKNOWN, with the reason, when the mapping cannot be seen."""

    def unknown(why: str) -> Layout:
        return Layout(UNKNOWN, why, world, rank, batch_size(loader), None, None, None, None, global_batch, accumulation)

    sampler, why = distributed_sampler(loader)
    if sampler is None:
        return unknown(why)  # type: ignore[arg-type]
    if sampler.num_replicas != world or sampler.rank != rank:
        return unknown(
            f"the DistributedSampler is for rank {sampler.rank} of {sampler.num_replicas}, the process is rank "
            f"{rank} of {world}"
        )
    size = batch_size(loader)
    if size is None:
        return unknown("the data loader's batch size is unknown (neither loader.batch_size nor its batch_sampler's)")
    length = len(sampler.dataset)
    if global_batch is not None and length < global_batch:
        raise ValueError(
            f"global_batch_size={global_batch} is larger than the dataset ({length} samples): an epoch would hold "
            f"no full global batch. Choose a global_batch_size of at most {length}."
        )
    loader_drops = bool(
        getattr(getattr(loader, "batch_sampler", None), "drop_last", getattr(loader, "drop_last", False))
    )
    per_rank = sampler.num_samples
    natural_batches = per_rank // size if loader_drops else -(-per_rank // size)
    # With a global batch: its last full one ends the epoch (the same positions at any world size).
    if global_batch is None:
        epoch_batches, epoch_samples = natural_batches, (natural_batches * size if loader_drops else per_rank) * world
    else:
        epoch_batches, epoch_samples = (length // global_batch) * accumulation, (length // global_batch) * global_batch
    return Layout(
        DISTRIBUTED,
        None,
        world,
        rank,
        size,
        length,
        int(sampler.seed),
        bool(sampler.shuffle),
        epoch_batches,
        global_batch,
        accumulation,
        epoch_samples,
    )


def layout_from(saved: dict[str, Any] | None) -> Layout | None:
    """A layout a checkpoint saved (``Layout.as_event``), or None."""
    if not saved:
        return None
    return Layout(**{key: saved[key] for key in Layout.__dataclass_fields__ if key in saved})


def accumulation_for(global_batch: int, batch_size: int | None, world: int) -> int:
    """Micro-batches per optimizer step that make ``global_batch`` samples on ``world`` ranks."""
    if batch_size is None:
        raise ValueError(
            f"global_batch_size={global_batch} needs the data loader's per-rank batch size, and the loader "
            f"build_data_loader() returned has none (loader.batch_size, or its batch_sampler's). Return a "
            f"DataLoader with batch_size=..., or leave global_batch_size=None and set gradient_accumulation_steps."
        )
    per_micro = batch_size * world
    if global_batch % per_micro:
        fits = [size for size in range(1, global_batch // batch_size + 1) if global_batch % (size * batch_size) == 0]
        sizes = (
            f"the numbers of ranks that fit it: {', '.join(map(str, fits))}" if fits else "no number of ranks fits it"
        )
        batches = [size for size in range(1, global_batch // world + 1) if global_batch % (size * world) == 0]
        per_rank = (
            f"; or on {world} ranks a batch_size of {', '.join(map(str, batches))}" if global_batch % world == 0 else ""
        )
        raise ValueError(
            f"global_batch_size={global_batch} is not a multiple of world_size {world} x the data loader's "
            f"batch_size {batch_size} = {per_micro} samples per micro-batch, so no whole number of micro-batches "
            f"makes it. With batch_size {batch_size}, {sizes}{per_rank}."
        )
    return global_batch // per_micro


@dataclass(frozen=True)
class Continuation:
    """Where one rank of a new world size starts: the old per-rank entry to resume as, and why."""

    data: dict[str, Any]  # a per-rank data position (``data_state.capture``'s form)
    global_position: dict[str, int] | None  # {"epoch", "samples"} continued from
    exact: bool
    reason: str | None  # why not exact (an error unless the user accepted approximations)

    def as_event(self) -> dict[str, Any]:
        return {"global": self.global_position, "exact": self.exact}


def continue_at(old: list[dict[str, Any]], new: Layout) -> Continuation:
    """The position rank ``new.rank`` of ``new.world_size`` continues from, given every old rank's
    saved data position (each with its ``layout``). Exact when the global position carries over;
    otherwise the approximation (the old rank ``new.rank mod W``'s own position, or the global
    position rounded down) with the reason it is not exact."""
    mine = dict(old[new.rank % len(old)])
    fallback = {**mine, "loader": mine.get("loader")}
    layouts = [layout_from(entry.get("layout")) for entry in old]
    positions = {(int(entry["epoch"]), int(entry["batches"])) for entry in old}

    def approximate(reason: str, data: dict[str, Any] = fallback, at: dict[str, int] | None = None) -> Continuation:
        return Continuation(data, at, False, reason)

    if any(layout is None or not layout.exact for layout in layouts):
        bad = next(layout for layout in layouts if layout is None or not layout.exact)
        return approximate(
            "the saving run's order is unknown: "
            + (bad.why if bad is not None and bad.why else "its checkpoint has no data layout (an older trainfsm)")
        )
    if not new.exact:
        return approximate(f"this run's order is unknown: {new.why}")
    if len(positions) != 1:
        return approximate(f"the saving run's ranks stood at different positions ({sorted(positions)})")
    saved: Layout = layouts[0]  # type: ignore[assignment]
    epoch, batches = positions.pop()
    at = {"epoch": epoch, "samples": saved.samples(batches)}
    for label, then, now in (
        ("dataset length", saved.length, new.length),
        ("sampler seed", saved.seed, new.seed),
        ("sampler shuffle", saved.shuffle, new.shuffle),
    ):
        if then != now:
            return approximate(f"the {label} was {then} when saved and is {now} now: the epoch's order differs")
    data = {"epoch": epoch, "epoch_rng": mine.get("epoch_rng"), "loader": None}
    per_micro = new.batch_size * new.world_size  # type: ignore[operator]
    rounded = {**data, "batches": at["samples"] // per_micro}
    repeated = (new.epoch_samples or 0) - (new.length or 0)
    if saved.epoch_samples == new.epoch_samples and repeated > 0:
        return approximate(
            f"DistributedSampler pads each epoch's order of {new.length} samples to {new.epoch_samples} positions (at "
            f"world size {saved.world_size} and at {new.world_size}), repeating {repeated} of its samples: an epoch "
            f"trains those twice at any size (state global_batch_size so that each epoch ends at its last full global "
            f"batch)",
            rounded,
            at,
        )
    if saved.epoch_samples != new.epoch_samples:
        return approximate(
            f"an epoch trains {saved.epoch_samples} positions of its order at world size {saved.world_size} and "
            f"{new.epoch_samples} at {new.world_size} (of {new.length} samples): the epochs end differently "
            f"(state global_batch_size so that each epoch ends at its last full global batch at any size)",
            rounded,
            at,
        )
    if at["samples"] % per_micro:
        return approximate(
            f"the saved position, {at['samples']} samples into epoch {epoch}, is not a multiple of world size "
            f"{new.world_size} x batch size {new.batch_size}; rounded down, {at['samples'] % per_micro} samples "
            f"are trained twice",
            rounded,
            at,
        )
    return Continuation(rounded, at, True, None)


def other_size(ranks: list[dict[str, Any]], rank: int, reshard: str = "exact") -> dict[str, Any]:
    """The ``rank_state`` of ``rank`` resuming a checkpoint of ``len(ranks)`` ranks on another
    number: the old rank's random streams where it existed, else streams seeded from the old rank
    0's state and the rank (``derived_seed``); the data position is decided in RESTORE, from
    every old rank's (``DataCursor.start``), once the loader's layout is known, and ``reshard``
    (``RESHARD_MODES``) says whether one it cannot continue exactly is an error."""
    from trainfsm import rng

    if rank < len(ranks):
        state, how = ranks[rank]["rng"], f"old rank {rank}'s"
    else:
        seed = derived_seed(ranks[0]["rng"], rank)
        state, how = rng.seeded(seed), f"seeded {seed} (from old rank 0's state and rank {rank})"
    positions = [entry.get("data") for entry in ranks]
    resize = {"resize": positions, "reshard": reshard, "rng_how": how}
    return {"rng": state, "data": resize if all(p is not None for p in positions) else None, "loss_none_skips": 0}


def derived_seed(rank0_rng: dict[str, Any], rank: int) -> int:
    """A seed for a rank the saving run did not have: from the saving rank 0's random state and
    the rank, so the same checkpoint and rank give the same streams every time."""
    torch_state = rank0_rng.get("torch")
    digest = hashlib.blake2b(digest_size=8)
    digest.update(bytes(torch_state.numpy()) if torch_state is not None else b"")
    digest.update(rank.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") >> 1  # a non-negative int64


def settle(
    loader: Any, rank: int, world: int, accumulation: int, accumulation_given: bool, global_batch: int | None
) -> tuple[int, Layout]:
    """BUILD's accumulation and layout: with ``global_batch_size``, the accumulation that keeps it at
    this world size (an error when one was given that disagrees), and how this rank's micro-batches
    map onto each epoch's order."""
    if global_batch is not None:
        size = batch_size(loader)
        derived = accumulation_for(global_batch, size, world)
        if accumulation_given and derived != accumulation:
            raise ValueError(
                f"global_batch_size={global_batch} on {world} rank(s) of batch_size {size} means "
                f"gradient_accumulation_steps={derived}, but gradient_accumulation_steps={accumulation} was given: "
                "pass one of the two."
            )
        accumulation = derived
    return accumulation, layout_of(loader, rank, world, accumulation, global_batch)
