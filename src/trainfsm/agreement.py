"""What every rank must decide alike; and what a rank says when a collective failed because of
another rank.

By default one all-reduce per step carries the pending exit signal (``SignalAgreement``: started
when a step begins, waited for when it ends, so it overlaps the step's work), and only when exit
signals are installed. With ``loss_none_agreement=True`` the ranks agree once per micro-batch
instead (``Agreement``, below), and the signal rides on that.

In a run with more than one rank (``torch.distributed`` initialised, world size > 1) two facts are
local to one rank but decide a transition that every rank must take together:

- ``forward`` returned ``loss=None``: the micro-batch is skipped, ``micro`` again without backward.
  Had one rank skipped while the others ran backward, DDP's gradient all-reduces would pair up
  the wrong micro-batches (or wait until the process-group timeout) and the ranks' data
  positions would drift apart. Every rank skips it instead, and the trail names the rank(s).
- an exit signal is pending, maybe on one rank only: every rank checkpoints and exits at the
  same step (``trainfsm.signals``).

One all-reduce (MAX) of a CPU int32 tensor carries both, after ``forward`` returns and before
backward: ``[pending signal, loss=None on rank 0, ..., loss=None on rank W-1]``. The flags are
host facts and stay on the host: the all-reduce runs in the default group when that has a CPU
backend (gloo, or ``"cpu:gloo,cuda:nccl"``), else in a gloo group that the first trainer creates
(``host_group``). Through NCCL the flag would be copied to the GPU and read back with a
``.item()`` that waits for every kernel queued so far: a device sync between each forward and its
backward. Through gloo it costs one small-message round trip per micro-batch, which also lines the
ranks up (they meet in DDP's gradient all-reduce anyway): on the small case of
``benchmarks/ddp_overhead.py`` (2 ms steps, 2 ranks on 2 shared cores) that was 1.3-1.6x, which is
why it is opt-in. A single-process run creates no agreement and pays nothing.

Collectives inside the wrapped model's forward run before the agreement: DDP rebuilds its buckets
in its second forward and broadcasts buffers (BatchNorm's statistics) in every forward; FSDP
all-gathers. A rank that returns ``loss=None`` must therefore still call the wrapped model when
the others do; one that does not leaves them waiting there (the trainer's error then says so).

A rank that raises (in its data loader, forward, backward, a hook, a checkpoint) or dies cannot be
agreed on: it leaves the others in whatever collective comes next. When its process exits, gloo
closes its connections and the others' collective fails at once; a rank that hangs, a failing
process kept alive (a user's ``except`` around ``train()``), and NCCL are noticed only at the
process-group timeout. That timeout (``init_process_group(timeout=...)``) is the bound. The
trainer adds ``collective_note`` to such an error (the type is kept), records it in the trail
(``collective_failed``), then raises.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Final

import torch

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


def host_group() -> Any:
    """The group for host flags: None (the default group) when it has a CPU backend, else a gloo
    group over every rank, created once per default group (collectively: every rank calls this at
    the same point, the start of BUILD) and reused by later trainers."""
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


class SignalAgreement:
    """One all-reduce (MAX) per step of the pending signal number, started early, waited late."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._work: Any = None

    def start(self, pending: int) -> None:
        self._flag.fill_(pending)
        self._work = self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, async_op=True)

    def result(self) -> int:
        """The largest signal number pending on any rank, 0 for none (waits for the collective)."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._flag.item())  # host sync, once per step, after the optimizer step


def agree_now(pending: int) -> int:
    """The largest signal number pending on any rank, at once (a blocking all-reduce): for the
    end of BUILD and of RESTORE, where every rank must leave by ``preempt`` or none."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([pending], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())  # once each in BUILD and RESTORE, never per step


class Agreement:
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
    return [str(logs / f"events.rank{1 - rank if world == 2 else '*'}.jsonl")]


def collective_note(rank: int, world: int, step: int, state: str, logs: Path | None) -> str:
    """The note added to a failed collective's error: what most likely happened, where to look."""
    timeout = group_timeout()
    bound = f" ({timeout.total_seconds():g} s)" if timeout is not None else ""
    paths = trails(logs, rank, world)
    other = f"rank {1 - rank}" if world == 2 else "another rank"
    whose, trail = ("its", "trail") if world == 2 else ("the other ranks'", "trails")
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
