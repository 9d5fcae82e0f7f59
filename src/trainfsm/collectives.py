"""Every collective the library runs, in one place, each with its one-rank shortcut; and what a
rank says when a collective failed because of another rank.

The user creates the process group and wraps the model; the trainer only sequences. What the
library itself must decide alike on every rank goes through this module, and every function
returns at once, without touching ``torch.distributed``, in a single-process run, so callers never
check the world size themselves.

Two facts local to one rank decide a transition that every rank must take together:

- an exit signal is pending, maybe on one rank only: every rank checkpoints and exits at the same
  step (``trainfsm.preemption.policy``). By default one all-reduce per step carries it
  (``SignalAgreement``: started when a step begins, waited for when it ends, so it overlaps the
  step's work), and only when exit signals are installed. It is a host flag like the next one's,
  so it runs in the host group too: no device sync.
- ``forward`` returned ``loss=None``: the micro-batch is skipped. Had one rank skipped while the
  others ran backward, DDP's gradient all-reduces would pair up the wrong micro-batches and the
  ranks' data positions would drift apart. With ``loss_none_agreement=True``
  (``LossNoneAgreement``) one all-reduce (MAX) of a CPU int32 tensor per micro-batch, after
  ``forward`` and before backward, carries ``[pending signal, loss=None on rank 0, ..., on rank
  W-1]``, and every rank skips when any returned None; the signal rides on it.

Host flags stay on the host: these all-reduces run in the default group when it has a CPU backend
(gloo, or ``"cpu:gloo,cuda:nccl"``), else in a gloo group created once (``host_group``). Through
NCCL the flag would be copied to the GPU and read back with a ``.item()`` that waits for every
kernel queued so far: a device sync between each forward and its backward (and, for the signal,
after each optimizer step). Through gloo the loss=None agreement costs
one small-message round trip per micro-batch (1.3-1.6x on the small case of
``benchmarks/ddp_overhead.py``), which is why it is opt-in. Collectives inside the wrapped model's
forward (DDP's bucket rebuild and buffer broadcast, FSDP's all-gathers) run before the agreement,
so a rank that returns ``loss=None`` must still call the wrapped model when the others do.

A rank that raises or dies cannot be agreed on: it leaves the others in whatever collective comes
next. gloo notices a peer process that exited at once; a rank that hangs, a failing process kept
alive, and NCCL are noticed only at the process-group timeout (``init_process_group(timeout=...)``).
The trainer adds ``collective_note`` to such an error (the type is kept), records it in the trail
(``collective_failed``), then raises.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Final

import torch

from trainfsm import activity
from trainfsm.trail import files
from trainfsm.trail.schema import new_run_id
from trainfsm.utils import user_stacklevel

# What the backends say when a collective failed because of another rank: torch's own DistError
# types (NCCL, the store), or gloo's RuntimeErrors: the peer's socket closed, or a timeout.
_COLLECTIVE_ERROR: Final = re.compile(
    r"Connection (closed|reset) by peer|Timed out waiting|Application timeout caused pair closure|"
    r"gloo/transport|NCCL|ProcessGroup"
)

_NONE_HINT: Final = (
    "trainfsm: this rank's forward returned loss=None just before. If it did not call the wrapped model, "
    "the other ranks may be waiting in the collectives of theirs (DDP's bucket rebuild in its second "
    "forward, its buffer broadcast; FSDP's all-gathers): call the wrapped model on every rank, then "
    "return None."
)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) without an initialised process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def world() -> int:
    return rank_and_world()[1]


def _flag_device() -> torch.device | None:
    """Where a small tensor must live for the default group: the current CUDA device for NCCL."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all ranks, at once (a blocking all-reduce; never per step)."""
    if world() == 1:
        return value
    import torch.distributed as dist

    flag = torch.tensor([value], dtype=torch.int32, device=_flag_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())  # host read: the caller's decision is the host's


def any_rank(flag: torch.Tensor) -> bool:
    """Whether the one-element ``flag`` is non-zero on any rank (all-reduced in place, MAX)."""
    if world() > 1:
        import torch.distributed as dist

        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())  # host read: stepping or retrying is the host's decision


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over all ranks, in place (one all-reduce); itself with one rank."""
    if world() > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def share_run_id(run_id: str, attempt: int) -> tuple[str, int]:
    """Rank 0's run id and attempt on every rank: one small broadcast at start.

    A fixed-size tensor, not ``broadcast_object_list``: no size exchange, no pickle. Run ids are
    12 hex digits (48 bits); one that is not (an edited trail) is replaced by a fresh one first.
    """
    if world() == 1:
        return run_id, attempt
    import torch.distributed as dist

    try:
        number = int(run_id, 16) if len(run_id) == 12 else -1
    except ValueError:
        number = -1
    if number < 0:
        run_id = new_run_id()
        number = int(run_id, 16)
    shared = torch.tensor([number, attempt], dtype=torch.int64, device=_flag_device())
    dist.broadcast(shared, src=0)
    number, attempt = (int(v) for v in shared.tolist())
    return f"{number:012x}", attempt


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, on every rank (``group`` None: the default group)."""
    size = world()
    if size == 1:
        return [value]
    import torch.distributed as dist

    values: list[Any] = [None] * size
    dist.all_gather_object(values, value, group=group)
    return values


def from_rank0(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value``, on every rank (a decision all must share)."""
    if world() == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def barrier() -> None:
    if world() > 1:
        import torch.distributed as dist

        dist.barrier()


class SignalAgreement:
    """One all-reduce (MAX) per step of the pending signal number, started early, waited late.

    A host flag on the host group (``host_group``), as ``LossNoneAgreement``'s: through NCCL the
    flag would be a GPU tensor whose ``.item()`` after the optimizer step waits for every kernel
    queued so far, a second device sync per step beside the finite check's. Through gloo it runs
    on gloo's own thread while the step computes; with DDP or FSDP every rank has started it by
    the time the finite check's sync returns (that waited for the gradient all-reduce, which
    every rank reaches after ``start``), so ``result`` is a short host wait, not a device sync.
    Waited for at the step's end rather than read one step later: the agreed value is the same
    on every rank at the same step either way, and this way the exit's checkpoint comes a step
    sooner.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self._all_reduce = dist.all_reduce
        self._max = dist.ReduceOp.MAX
        self._group = host_group()  # collective when it creates the group: every rank decides in BUILD
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._work: Any = None

    def start(self, pending: int) -> None:
        self._flag.fill_(pending)
        self._work = self._all_reduce(self._flag, op=self._max, group=self._group, async_op=True)

    def result(self) -> int:
        """The largest signal number pending on any rank, 0 for none (waits for the collective)."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._flag.item())  # a CPU tensor: no device sync


def flagged_ranks(flag: bool, rank: int, world: int, group: Any) -> list[int]:
    """The ranks whose ``flag`` is set, the same list on every rank (one blocking all-reduce of a
    CPU tensor on ``group``, a host group: no device sync). For decisions taken off the routine
    path, such as an out-of-memory retry (``trainfsm.oom``)."""
    import torch.distributed as dist

    flags = torch.zeros(world, dtype=torch.int32)
    if flag:
        flags[rank] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [r for r, value in enumerate(flags.tolist()) if value]


def host_group() -> Any:
    """The group for host flags: None (the default group) when it has a CPU backend, else a gloo
    group over every rank, created once per default group (collectively: every rank calls this at
    the same point of BUILD, its start for ``LossNoneAgreement``, the exit policy's decision for
    ``SignalAgreement``) and reused by later trainers."""
    import torch.distributed as dist

    if any(part.startswith("cpu:") for part in dist.get_backend_config().split(",")):
        return None
    default = dist.distributed_c10d._get_default_group()
    group = _HOST_GROUPS.get(default)
    if group is None:
        group = _HOST_GROUPS[default] = dist.new_group(backend="gloo", timeout=group_timeout())
    return group


_HOST_GROUPS: dict[Any, Any] = {}


def group_timeout() -> Any:
    """The default group's timeout (a ``timedelta``), or None where torch does not tell."""
    import torch.distributed as dist

    for device in ("cpu", "cuda"):
        try:  # a private accessor (torch 2.4-2.13); without it a message only lacks the number
            return dist.distributed_c10d._get_default_group()._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
    return None


class LossNoneAgreement:
    """One all-reduce per micro-batch: whether any rank's loss is None, and the pending signal."""

    def __init__(self, *, rank: int, world: int, watcher: Any) -> None:
        import torch.distributed as dist

        self._all_reduce = dist.all_reduce
        self._max = dist.ReduceOp.MAX
        self._group = host_group()
        self._flags = torch.zeros(world + 1, dtype=torch.int32)
        self._slot = 1 + rank
        self._watcher = watcher  # the SignalWatcher: its ``pending`` is read, never written
        self._none: list[int] = []
        #: The largest signal number pending on any rank at the last agreement, 0 for none.
        self.signal = 0

    def skip(self, loss_none: bool) -> bool:
        """Whether every rank skips this micro-batch: some rank's ``forward`` returned loss=None.
        Waits for every rank (at most the process-group timeout)."""
        flags = self._flags
        flags.zero_()
        flags[0] = self._watcher.pending
        if loss_none:
            flags[self._slot] = 1
        try:
            self._all_reduce(flags, op=self._max, group=self._group)
        except Exception as exc:
            if loss_none:
                add_note(exc, _NONE_HINT)
            raise
        values: list[int] = flags.tolist()  # a CPU tensor: no device sync
        self.signal = values[0]
        if not any(values[1:]):
            return False
        self._none = [rank for rank, flag in enumerate(values[1:]) if flag]
        return True

    def none_ranks(self) -> list[int]:
        """The ranks whose ``forward`` returned loss=None in the last skipped micro-batch."""
        return self._none


_LOSS_NONE_ALONE: Final = (
    "forward() returned loss=None for a DDP/FSDP model; this rank skips the micro-batch. Return None on "
    "every rank at the same micro-batch without calling the wrapped model, or pass loss_none_agreement=True "
    "to the trainer so that every rank skips it when any rank returns None."
)
_LOSS_NONE_AGREED: Final = (
    "forward() returned loss=None for a DDP/FSDP model; every rank skips this micro-batch. Call the wrapped "
    "model before returning None, as the other ranks do: collectives in its forward (DDP's bucket rebuild and "
    "buffer broadcast, FSDP's all-gathers) have no partner otherwise."
)


class LossNoneWarning(UserWarning):
    """``forward`` returned ``loss=None`` for a DDP/FSDP model (on this rank).

    By default (the ``trainloop`` contract) the ranks do not talk about it: return None on every
    rank at the same micro-batch, without calling the wrapped model. A rank that skips alone pairs
    its next gradient all-reduce with the others' current one; the next checkpoint notices (the
    ranks' skip counts differ), saves nothing and fails on every rank with an error saying so.

    With ``loss_none_agreement=True`` the ranks agree before every backward (one small host
    all-reduce per micro-batch), and every rank skips a micro-batch when any rank returned None.
    Collectives inside the wrapped module's forward run before that agreement (DDP rebuilds its
    buckets in its second forward and broadcasts buffers in every forward; FSDP all-gathers), so
    then call the wrapped model on every rank before returning None."""


def loss_none_ranks(agreement: LossNoneAgreement | None, rank: int, warn: bool) -> list[int]:
    """A micro-batch is skipped for loss=None: the ranks whose forward returned None. With
    ``warn`` (a DDP/FSDP model) this rank gets a ``LossNoneWarning`` at the user's ``train()``
    call if it is one of them."""
    ranks = agreement.none_ranks() if agreement is not None else [rank]
    if warn and rank in ranks:
        warnings.warn(
            _LOSS_NONE_AGREED if agreement is not None else _LOSS_NONE_ALONE,
            LossNoneWarning,
            stacklevel=user_stacklevel(),
        )
    return ranks


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11+: shown under the traceback, the type is kept); on 3.10
    the note reaches the user through the trail only."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because of another rank."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and _COLLECTIVE_ERROR.search(str(exc)) is not None


def trails(logs: Path | None, rank: int, world: int) -> list[str] | None:
    """The other ranks' trail files (a ``rank*`` pattern beyond two ranks), None without a workspace."""
    if logs is None:
        return None
    return [str(logs / files.active_name(1 - rank if world == 2 else "*"))]


def collective_note(
    rank: int, world: int, step: int, state: str, logs: Path | None, stalled: float | None = None
) -> str:
    """The note added to a failed collective's error: what most likely happened, where to look.
    ``stalled``: this rank's stall watchdog had reported it stuck for that many seconds (a peer that
    hangs: the group's timeout ended the wait, and the cause is the peer's stall, not an exception)."""
    timeout = group_timeout()
    bound = f" ({timeout.total_seconds():g} s)" if timeout is not None else ""
    paths = trails(logs, rank, world)
    other = f"rank {1 - rank}" if world == 2 else "another rank"
    whose, trail = ("its", "trail") if world == 2 else ("the other ranks'", "trails")
    if stalled is not None:
        where = (
            f"{whose} {trail} {paths[0]}: a 'stall' event (stuck, alive), or where it ends (a frozen or killed "
            f"rank writes nothing more); `trainfsm trace` on the workspace names the rank that held the others up"
            if paths is not None
            else f"{whose} output (no workspace, so no trail files)"
        )
        return (
            f"trainfsm: rank {rank} of {world} failed in a collective at step {step} ({state}) after waiting in it "
            f"for {stalled:.0f} s (its stall watchdog reported it): {other} held it up (stuck, frozen or killed) "
            f"until the process-group timeout{bound} ended the wait. The cause is the stall: see {where}."
        )
    where = (
        f"{whose} {trail} {paths[0]} (the first 'exception' event) and output"
        if paths is not None
        else f"{whose} output (no workspace, so no trail files)"
    )
    return (
        f"trainfsm: rank {rank} of {world} failed in a collective at step {step} ({state}): {other} "
        f"probably raised an exception or died. gloo notices a peer process that exited at once; a peer "
        f"that hangs or stays alive after failing, and NCCL, only at the process-group timeout{bound}. "
        f"The cause is in {where}."
    )


def failed_collective(
    exc: BaseException,
    rank: int,
    world: int,
    step: int,
    state: str,
    logs: Path | None,
    stalled: float | None = None,
) -> dict[str, Any] | None:
    """When ``exc`` looks like a collective that failed because of another rank: add the note to
    it (the type is kept) and return the ``collective_failed`` event's fields; else None.
    ``stalled``: the seconds this rank's stall watchdog had it stuck (``Watchdog.stalled_for``)."""
    if world == 1 or not is_collective_error(exc):
        return None
    note = collective_note(rank, world, step, state, logs, stalled)
    add_note(exc, note)
    return {"note": note, "trails": trails(logs, rank, world)}


# What a stalled rank waits in (``trainfsm.activity``): every one waits for every rank.
activity.name(SignalAgreement.result, "the step-end signal agreement (all-reduce)", collective=True)
activity.name(max_over_ranks, "the signal agreement at the end of BUILD or RESTORE (all-reduce)", collective=True)
activity.name(LossNoneAgreement.skip, "the loss=None agreement of a micro-batch (all-reduce)", collective=True)
activity.name(any_rank, "an all-reduce of a flag", collective=True)
activity.name(sum_over_ranks, "an all-reduce (sum)", collective=True)
activity.name(share_run_id, "the run id's broadcast from rank 0 (start of train())", collective=True)
activity.name(gather_objects, "an all_gather_object", collective=True)
activity.name(from_rank0, "a broadcast from rank 0", collective=True)
activity.name(barrier, "a barrier", collective=True)
