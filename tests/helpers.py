"""Test helpers: a tiny real trainer on CPU, a recording hook, and readers for the audit trail.

``TinyTrainer`` trains ``nn.Linear(3, 1)`` with plain SGD on a list of seeded random batches. Its
``forward`` can be scripted per call (1-based, counted over the whole run): ``"nan"`` multiplies the
loss by NaN (non-finite gradients), ``"none"`` returns ``loss=None``, an exception instance is
raised. Every call records which batch it saw, so tests can tell which data a step used. On
``device="cuda"`` (the ``cuda`` tier, ``tests/tiers.py``'s ``DEVICES``) the model is moved there and
each batch as ``forward`` takes it; the batches themselves stay the same CPU tensors on both devices.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainfsm import STATES, BaseHook, BaseTrainer
from trainfsm.machine import EXIT, transition_rows
from trainfsm.trail.reader import TrailError
from trainfsm.trail.reader import read_events as read_trail_events

EVENTS_FILE = Path("logs") / "events.rank0.jsonl"
COMMON_FIELDS = ("ts", "event", "rank", "step", "state", "run_id", "attempt")

#: The initial parameters of every TinyTrainer model (fixed, so no global RNG is touched).
INIT_WEIGHT = ((0.1, -0.2, 0.3),)
INIT_BIAS = (0.05,)


def make_batches(n: int = 8, batch_size: int = 4, seed: int = 0, scale: float = 0.5) -> list[dict[str, Any]]:
    """``n`` batches ``{"i": index, "x": (batch_size, 3), "y": (batch_size, 1)}`` from a seeded generator.

    Inputs and targets are small so that fp16 gradients scaled by GradScaler's 2**16 stay finite.
    """
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "i": i,
            "x": torch.randn(batch_size, 3, generator=generator) * scale,
            "y": torch.randn(batch_size, 1, generator=generator) * scale,
        }
        for i in range(n)
    ]


def make_model() -> nn.Linear:
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(INIT_WEIGHT))
        model.bias.copy_(torch.tensor(INIT_BIAS))
    return model


class TinyTrainer(BaseTrainer):
    """A real trainer: Linear(3, 1), SGD, MSE loss, scripted forward calls (see the module doc)."""

    def __init__(
        self,
        *,
        batches: Iterable[Any] | None = None,
        lr: float = 0.1,
        script: Mapping[int, Any] | None = None,
        hooks: Sequence[BaseHook] = (),
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)
        self.batches = make_batches() if batches is None else batches
        self.lr = lr
        self.script = dict(script or {})
        self.hook_list = list(hooks)
        self.scheduler_factory = scheduler
        self.calls = 0
        self.seen: list[int] = []  # batch index of every forward call
        self.losses: list[float] = []  # loss of every forward call that returned one
        self.autocast: list[tuple[bool, torch.dtype]] = []  # (autocast on, output dtype) per call

    def build_data_loader(self) -> Iterable[Any]:
        return self.batches

    def build_model(self) -> nn.Module:
        model = make_model()
        return model if self.device.type == "cpu" else model.to(self.device)  # on CPU: no Tensor.to call at all

    def build_optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def build_lr_scheduler(self) -> Any:
        assert self.optimizer is not None
        return self.scheduler_factory(self.optimizer) if self.scheduler_factory else None

    def build_hooks(self) -> list[BaseHook]:
        return list(self.hook_list)

    def forward(self, input: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
        assert self.model is not None
        self.calls += 1
        self.seen.append(int(input["i"]))
        action = self.script.get(self.calls)
        if isinstance(action, BaseException):
            raise action
        if action == "none":
            return None, {}
        x, y = (input["x"], input["y"]) if self.device.type == "cpu" else _to(self.device, input["x"], input["y"])
        out = self.model(x)
        self.autocast.append((torch.is_autocast_enabled(self.device.type), out.dtype))
        loss = nn.functional.mse_loss(out.float(), y)
        if action == "nan":
            loss = loss * float("nan")
        self.losses.append(loss.item())
        return loss, {"loss": loss.item(), "m": {"batch": float(input["i"])}}


def _to(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


class Slow(BaseHook):
    """Each step takes at least ``seconds``; calls ``at_step[step]()`` as that step ends (a
    preemption, a moved job end: something at a known step of a run that is not too fast)."""

    def __init__(self, seconds: float, at_step: dict[int, Any] | None = None) -> None:
        self.seconds, self.at_step = seconds, dict(at_step or {})

    def on_after_step(self, trainer: BaseTrainer) -> None:
        time.sleep(self.seconds)
        action = self.at_step.pop(trainer.step, None)
        if action is not None:
            action()


def parameters(run: BaseTrainer) -> list[torch.Tensor]:
    """The model's parameters, detached copies."""
    return [p.detach().clone() for p in run.model.parameters()]  # type: ignore[union-attr]


class RecordingHook(BaseHook):
    """Records ``(name, method, trainer.step)`` for every seed method and every state callback."""

    def __init__(self, log: list[tuple[str, str, int]], name: str = "hook", **flags: Any) -> None:
        self.log = log
        self.name = name
        self.checkpoint_at = set(flags.get("checkpoint_at", ()))
        self.stop_at = set(flags.get("stop_at", ()))
        self.after_train_state: dict[str, Any] = {}

    def _rec(self, method: str, trainer: BaseTrainer) -> None:
        self.log.append((self.name, method, trainer.step))

    def on_before_train(self, trainer: BaseTrainer) -> None:
        self._rec("on_before_train", trainer)

    def on_before_step(self, trainer: BaseTrainer) -> None:
        self._rec("on_before_step", trainer)

    def on_before_optimizer_step(self, trainer: BaseTrainer) -> None:
        self._rec("on_before_optimizer_step", trainer)

    def on_after_step(self, trainer: BaseTrainer) -> None:
        self._rec("on_after_step", trainer)

    def on_after_train(self, trainer: BaseTrainer) -> None:
        self.after_train_state = {"reason": trainer.exit_reason, "code": trainer.exit_code, "step": trainer.step}
        self._rec("on_after_train", trainer)

    def wants_checkpoint(self, trainer: BaseTrainer) -> bool:
        return trainer.step in self.checkpoint_at

    def wants_stop(self, trainer: BaseTrainer) -> bool:
        return trainer.step in self.stop_at


def _add_state_callbacks() -> None:
    for state in STATES:
        for kind in ("enter", "exit"):
            method = f"on_{kind}_{state.lower()}"

            def callback(self: RecordingHook, trainer: BaseTrainer, _method: str = method) -> None:
                self._rec(_method, trainer)

            callback.__name__ = method
            setattr(RecordingHook, method, callback)


_add_state_callbacks()


# ---------------------------------------------------------------- audit trail readers
def read_events(workspace: Path) -> list[dict[str, Any]]:
    """Every event of ``workspace``'s rank-0 audit trail, in file order."""
    return trail_events(workspace)


def trail_events(where: Path | str, rank: int = 0) -> list[dict[str, Any]]:
    """Rank ``rank``'s events (a workspace or an events file), segments included, compact ``steps``
    records expanded to the transitions they stand for; [] when there is no trail yet."""
    try:
        return list(read_trail_events(where, rank))
    except TrailError:
        return []


def transitions_of(events: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(trigger, source, dest) of every transition event, in order."""
    return [(e["trigger"], e["source"], e["dest"]) for e in events if e["event"] == "transition"]


def outline(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """One short string per event: ``trigger:SOURCE>DEST`` for transitions, the event name otherwise
    (with its reason/what/type where it has one)."""
    out = []
    for e in events:
        if e["event"] == "transition":
            out.append(f"{e['trigger']}:{e['source']}>{e['dest']}")
        elif e["event"] == "exit":
            out.append(f"exit:{e['reason']}")
        elif e["event"] == "non_finite":
            out.append(f"non_finite:{e['what']}")
        elif e["event"] == "exception":
            out.append(f"exception:{e['type']}")
        else:
            out.append(e["event"])
    return out


def assert_valid_chain(rows: Sequence[tuple[str, str, str]]) -> None:
    """The transitions start in BUILD, chain source to dest, follow the table, and end in EXIT."""
    table = set(transition_rows())
    assert rows, "no transitions recorded"
    assert rows[0][1] == "BUILD"
    for row in rows:
        assert row in table, f"{row} is not a row of the transition table"
    for (_, _, dest), (_, source, _) in itertools.pairwise(rows):
        assert dest == source
    assert rows[-1][2] == EXIT


def ignored_here(*also: signal.Signals) -> list[str]:
    """``run_start``'s ``ignored`` for a process started from this one (or for this one): what this
    process ignores already (``nohup`` ignores SIGHUP, and ignored signals survive ``exec``), plus
    ``also``, in the trail's order."""
    from trainfsm.preemption.signals import REPORTED_SIGNALS

    return [s.name for s in REPORTED_SIGNALS if s in also or signal.getsignal(s) == signal.SIG_IGN]


def ledger_problem(workspace: Path) -> str:
    """The data ledger's verdict on a fault trial's trail (``trainfsm.tools.ledger``): "" when
    every micro-batch was kept once across all attempts, on every rank; else what broke."""
    from trainfsm.tools import audit
    from trainfsm.tools.ledger import proven

    report = audit.audit([workspace])
    breaks = [p.message for p in report.run_problems if p.kind == "ledger"]
    if breaks:
        return f"data ledger: {breaks[0]}"
    if not report.ledger or not all(proven(line) for line in report.ledger):
        return f"data ledger: {report.ledger}"
    return ""
