"""Out of memory as a transition: a step that runs out of device memory is run again in smaller pieces.

With ``BaseTrainer(max_oom_retries=N)``, a ``torch.OutOfMemoryError`` raised by the forward or the
backward of a micro-batch takes ACCUMULATE -> RETRY by ``oom`` instead of ending the run. RETRY drops
the step's gradients and runs the step again from its first micro-batch, on the micro-batches it had
already drawn (kept for that, not drawn again: the data ledger counts each once), each now split in
two along its first dimension. Each piece's loss is weighted by its share of the micro-batch's rows
over the accumulation, so the optimizer step averages the same samples with the same weights as
before (exactly, for a loss that is a mean over independent samples). The split stays in force for
the rest of the run: every drawn micro-batch runs as ``pieces`` pieces (2, then 4, ...), and the
trail's ``oom`` event says from which step, on which micro-batch, in forward or backward, and the
rows each piece now has.

Why the default is 0 (off): splitting changes what a loss sees wherever samples of a batch meet,
such as BatchNorm's batch statistics or a contrastive loss's in-batch negatives, and then the split
run is not the run the user asked for. Turn it on where the loss is a per-sample mean.

Why the step's micro-batches are kept rather than drawn again: drawing on would train other samples
in that step, and the data ledger would see micro-batches drawn and never trained. Keeping costs a
reference to each of the step's batches until the step ends (only with ``max_oom_retries > 0``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainfsm.collectives import flagged_ranks, host_group
from trainfsm.utils import is_distributed_wrapper, map_nested_tensor

if TYPE_CHECKING:
    from trainfsm.step import Stepper


class BatchSplitError(ValueError):
    """A micro-batch that cannot be split along its first dimension (``max_oom_retries``)."""


def rows(batch: Any) -> int:
    """The micro-batch's samples: the first dimension its tensors share. Raises ``BatchSplitError``
    when it has no tensor with a first dimension, or its tensors disagree on it."""
    sizes: set[int] = set()

    def see(tensor: torch.Tensor) -> torch.Tensor:
        sizes.add(tensor.shape[0] if tensor.dim() > 0 else -1)
        return tensor

    map_nested_tensor(see, batch)
    if not sizes:
        raise BatchSplitError(
            f"a micro-batch of type {type(batch).__name__} holds no tensor to split; max_oom_retries splits "
            "each tensor of a batch (in dicts, lists, tuples) along its first dimension"
        )
    if len(sizes) > 1 or -1 in sizes:
        shown = ", ".join("a 0-dimensional tensor" if size == -1 else str(size) for size in sorted(sizes))
        raise BatchSplitError(
            f"a micro-batch's tensors do not share a first dimension (first dimensions: {shown}), so it "
            "cannot be split into samples; max_oom_retries needs every tensor of a batch to have the batch's "
            "samples along dimension 0"
        )
    return sizes.pop()


def split(batch: Any, pieces: int) -> list[tuple[Any, int]]:
    """``batch`` in ``pieces`` nearly equal pieces along dimension 0 (views, no copy), each with
    its rows; fewer pieces when the batch has fewer rows."""
    total = rows(batch)
    count = min(pieces, total)
    bounds = [total * i // count for i in range(count + 1)]
    return [(_rows_of(batch, a, b), b - a) for a, b in itertools.pairwise(bounds)]


def _rows_of(batch: Any, start: int, end: int) -> Any:
    return map_nested_tensor(lambda t: t[start:end], batch)


def weighted(values: list[Any], weights: list[float]) -> Any:
    """Pieces' losses or records combined by their share of the rows: tensors and numbers are
    weighted sums (no host sync), dicts combined key by key, anything else the first piece's."""
    first = values[0]
    if isinstance(first, torch.Tensor) or (isinstance(first, int | float) and not isinstance(first, bool)):
        if all(isinstance(v, torch.Tensor | int | float) and not isinstance(v, bool) for v in values):
            return sum(v * w for v, w in zip(values, weights, strict=True))
        return first
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) for v in values):
        keys = [k for k in first if all(k in v for v in values)]
        return {k: weighted([v[k] for v in values], weights) for k in keys}
    return first


class MemoryFit:
    """The split in force and the step's kept micro-batches (one per ``train()``).

    ``shared``: DDP over several ranks, whose gradient all-reduce pairs every rank's backward. A rank
    that runs out of memory then goes on through its step so that the others' collectives still
    pair: the micro-batches whose backward all-reduces run a one-sample forward with a NaN loss
    (``shadow``), so every rank's finite check fails at the step's end; there, and only there, one
    all-reduce of who ran out (``agree``) turns the non-finite step into every rank's ``oom``."""

    def __init__(self, max_retries: int, accumulation: int, shared: bool = False) -> None:
        self.max_retries = max_retries
        self.shared = shared
        self._group = host_group() if shared else None  # collectively, in BUILD on every rank
        self.retries = 0  # out-of-memory errors taken so far (each doubled ``pieces``)
        self.pieces = 1  # each drawn micro-batch runs as this many pieces
        self.inv_accumulation = 1.0 / accumulation
        self.kept: list[Any] = []  # the step's drawn micro-batches, in order
        self.replay: list[Any] = []  # the retry's micro-batches still to run, last first
        self.failure: dict[str, Any] | None = None  # the error being retried: where and what
        self.piece = 0  # the piece of a split micro-batch being run

    def next(self, draw: Callable[[], Any]) -> Any:
        """The micro-batch to run: the retry's next kept one, else a new draw (kept)."""
        batch = self.replay.pop() if self.replay else draw()
        self.kept.append(batch)
        return batch

    def micro(self, stepper: Stepper, forward: Callable[[Any], Any], batch: Any, last: bool) -> tuple[Any, Any]:
        """Forward and backward of one drawn micro-batch, as ``pieces`` pieces when split."""
        if self.pieces == 1:
            return stepper.micro(forward, batch, last)
        parts = split(batch, self.pieces)
        total = sum(n for _, n in parts)
        losses, records, shares = [], [], []
        for i, (piece, n) in enumerate(parts):
            self.piece = i  # where an error strikes: ``shadow`` mirrors the pieces from there
            share = n / total
            loss, record = stepper.micro(forward, piece, last and i == len(parts) - 1, share * self.inv_accumulation)
            records.append(record)
            if loss is not None:
                losses.append(loss)
                shares.append(share)
        # A piece whose forward returned loss=None trained nothing: the others keep their share,
        # in the gradient and in the reported loss alike.
        combined = weighted(losses, shares) if losses else None
        return combined, weighted(records, [n / total for _, n in parts])

    def shadow(self, stepper: Stepper, forward: Callable[[Any], Any], batch: Any, micro: int, last: bool) -> None:
        """This rank ran out of memory earlier in the step (``shared``): pair the other ranks'
        gradient all-reduce where this micro-batch's backward makes one, with one sample and a NaN
        loss (no memory to speak of; the NaN tells every rank at the finite check)."""
        failure = self.failure or {}
        failed_here = failure.get("micro") == micro
        count = min(self.pieces, rows(batch)) if self.pieces > 1 else 1  # ``split``'s, without the views
        final_piece = failure.get("piece", 0) == count - 1  # only its backward is outside no_sync
        if failed_here and failure.get("phase") == "backward" and ((last and final_piece) or stepper.no_sync is None):
            raise torch.OutOfMemoryError(
                f"out of memory in the backward of micro-batch {micro}, whose gradient all-reduce (DDP) had begun "
                f"({failure.get('message')}): the other ranks wait in it, so this step cannot be retried in step "
                "with them. With gradient_accumulation_steps > 1 only the last micro-batch all-reduces; lower the "
                "data loader's batch_size so that it fits."
            )
        # The same forwards and backwards as the others run (DDP's own collectives, its bucket rebuild
        # among them, follow its forwards), one sample each: the pieces from the failed one on.
        first = failure.get("piece", 0) if failed_here else 0
        one = map_nested_tensor(lambda t: t[:1], batch)
        for i in range(first, count):
            try:
                stepper.micro(forward, one, last and i == count - 1, float("nan"))
            except torch.OutOfMemoryError:
                raise torch.OutOfMemoryError(
                    f"out of memory again in a one-sample forward/backward run to keep step with the other ranks "
                    f"after {failure.get('message')!r}: even one sample does not fit; the other ranks will fail at "
                    "their next collective. Use less memory per sample (activation checkpointing, bf16, a smaller "
                    "model or sequence) or a device with more memory."
                ) from None

    def ran_out(self, rank: int, world: int, scaler: torch.amp.GradScaler | None) -> bool:
        """At a non-finite step's end: whether it is every rank's ``oom`` (``shared`` and some rank
        ran out in it). The fp16 scaler, which unscaled for nothing, is then set back as it was,
        its scale unchanged."""
        if not self.shared or not self.agree(rank, world):
            return False
        if scaler is not None and scaler.is_enabled():
            scaler.update(new_scale=scaler.get_scale())
        return True

    def agree(self, rank: int, world: int) -> list[int]:
        """At a non-finite step's end (``shared``): the ranks that ran out of memory in it, the same
        list on every rank (one host all-reduce; a routine step never comes here)."""
        ranks = flagged_ranks(self.failure is not None, rank, world, self._group)
        if ranks and self.failure is None:  # another rank's: this one splits with it
            self.failure = {
                "micro": None,
                "phase": None,
                "rows": _piece_rows(self.kept[0], self.pieces) if self.kept else None,
                "message": f"rank {', '.join(map(str, ranks))} ran out of memory in this step",
            }
        if self.failure is not None:
            self.failure["ranks"] = ranks
        return ranks

    def caught(self, exc: BaseException, micro: int, batch: Any) -> None:
        """Note where the error struck; the exception (and the graph its traceback holds) is
        dropped by the caller's ``except`` as it ends."""
        self.failure = {
            "micro": micro,
            "piece": self.piece if self.pieces > 1 else 0,
            "phase": "backward" if _in_backward(exc) else "forward",
            "rows": _piece_rows(batch, self.pieces),
            "message": str(exc).split("\n", 1)[0][:300],
        }

    def retry(self, step: int, log: Any, device: torch.device) -> None:
        """RETRY after an out-of-memory error: split further (or raise what to do), and run the
        step's kept micro-batches again."""
        failure, self.failure = self.failure or {}, None
        replays = len(self.kept)
        for batch in self.kept:  # each must split: say so now, naming the step, not in the next forward
            try:
                rows(batch)
            except BatchSplitError as exc:
                raise BatchSplitError(f"Step {step}: out of memory ({failure.get('message')}), and {exc}") from None
        if failure.get("rows") == 1:
            raise torch.OutOfMemoryError(
                f"Step {step}: out of memory with micro-batches of 1 sample ({failure.get('phase')} of "
                f"micro-batch {failure.get('micro')}: {failure.get('message')}); splitting cannot help further. "
                "Use less memory per sample (a smaller model or sequence, activation checkpointing, "
                "mixed_precision='bf16') or a device with more memory."
            )
        if self.retries >= self.max_retries:
            raise torch.OutOfMemoryError(
                f"Step {step}: out of memory in the {failure.get('phase')} of micro-batch {failure.get('micro')} "
                f"with pieces of {failure.get('rows')} samples, after {self.retries} split(s) "
                f"(max_oom_retries={self.max_retries}): {failure.get('message')}. Raise max_oom_retries to split "
                "further, or lower the data loader's batch_size."
            )
        self.retries += 1
        self.pieces *= 2
        if device.type == "cuda":  # give the failed graph's blocks back before the smaller try
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
        log.warning(
            "oom",
            micro=failure.get("micro"),
            phase=failure.get("phase"),
            rows=failure.get("rows"),
            pieces=self.pieces,
            piece_rows=_halved(failure.get("rows")),
            replays=replays,
            retry=self.retries,
            max=self.max_retries,
            ranks=failure.get("ranks"),
            message=failure.get("message"),
        )
        self.replay, self.kept = list(reversed(self.kept)), []

    def new_step(self) -> None:
        self.kept = []


def _halved(count: int | None) -> int | None:
    return None if count is None else (count + 1) // 2


def _piece_rows(batch: Any, pieces: int) -> int | None:
    """The largest piece's rows at the split that failed (None when the batch has no rows)."""
    try:
        total = rows(batch)
    except BatchSplitError:
        return None
    count = min(pieces, total)
    return -(-total // count)


def _in_backward(exc: BaseException) -> bool:
    """Whether the error came out of ``Tensor.backward`` (autograd), from its traceback."""
    code = torch.Tensor.backward.__code__
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def oom_shared(trainer: Any, agreement: Any) -> bool:
    """Whether an out-of-memory retry must be agreed among ranks (DDP over several ranks), after
    refusing what cannot be retried in step: FSDP over several ranks (a failed forward leaves its
    all-gathers unpaired) and ``loss_none_agreement`` (its per-micro-batch all-reduce would wait
    for a rank that ran out before reaching it)."""
    from torch.nn.parallel import DistributedDataParallel

    if trainer.world_size == 1:
        return False
    model = trainer.model
    if isinstance(model, DistributedDataParallel):
        if agreement is not None:
            raise ValueError(
                "max_oom_retries cannot be combined with loss_none_agreement=True over several ranks: a rank that "
                "runs out of memory in forward never reaches that micro-batch's agreement. Turn one of them off."
            )
        return True
    if is_distributed_wrapper(model):
        raise ValueError(
            f"max_oom_retries over several ranks supports DistributedDataParallel models, not "
            f"{type(model).__name__}: a forward that runs out of memory leaves FSDP's all-gathers unpaired on the "
            "other ranks. Set max_oom_retries=0, or fit the batch (a smaller batch_size, activation checkpointing)."
        )
    return False  # each rank's own model: its split is its own
