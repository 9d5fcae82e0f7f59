"""A resumed DDP all-reduces with the bucket layout the uninterrupted run has at the same step.

**Why.** ``DistributedDataParallel`` starts with its gradients in one bucket in parameter order,
and after its first backward (its second, with ``static_graph=True``) rebuilds its buckets in the
order the gradients became ready (``Reducer::rebuild_buckets``; the first bucket capped at 1 MiB).
A resumed process's DDP is new: its first steps all-reduce with the first layout where the
uninterrupted run already uses the rebuilt one. An element's place in its bucket decides how the
all-reduce splits and orders its sum, and with more than two ranks a float sum depends on its
order: the resumed run then differs from the uninterrupted one in the last bits (6e-8 at four
ranks after 20 steps), from its first step on.

**How.** Every process records the order in which its parameters' gradients became ready at the
backward DDP rebuilds from (one hook per parameter, removed once that backward ends: nothing
per step after it). A checkpoint keeps that order and how many synchronised backwards DDP had run
(0, 1 or 2 matter). On resume, before the first step, ``prime`` takes the reducer through the
backwards the saved run had run, with a zero gradient made ready per parameter in the saved order:
DDP then rebuilds at its first forward from exactly that order, as the uninterrupted run did. The
pass all-reduces zeros once (twice with ``static_graph``); it runs no model code, draws no batch,
uses no random number, and leaves every ``.grad`` as it found it. Once the first real
synchronised backward ends, ``BucketOrder`` checks that DDP did rebuild and that the gradients
became ready in the saved order (a changed model would not), and the trail says so.

The other way (building the resumed DDP with the saved layout, through the
``_compute_bucket_assignment_by_size`` call in DDP's constructor) needs the checkpoint before
``build_model()`` runs, where the user constructs DDP; the way here works on whatever DDP the user
built, at RESTORE, where the checkpoint is read.

**Private torch API.** ``reducer.prepare_for_forward``, ``reducer.prepare_for_backward``,
``reducer._delay_all_reduce``, ``ddp._static_graph_delay_allreduce_enqueued`` and
``ddp._has_rebuilt_buckets``; checked on the torch versions in ``CHECKED_ON``. When one is missing,
``unsupported`` names it before any collective runs, and the trainer says in the trail and in a
``DDPBucketsWarning`` that the resume is not bit-exact, with the public way out:
``find_unused_parameters=True`` (DDP never rebuilds then, at the cost of a graph walk per step).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: torch versions (major.minor) on which priming was checked bit-exact (tests/test_ddp_buckets.py).
CHECKED_ON = ("2.13",)

ADVICE = (
    "wrap the model with DistributedDataParallel(..., find_unused_parameters=True) (or "
    "wrap_model(model, 'ddp', device, find_unused_parameters=True)): DDP then never rebuilds its buckets, "
    "so a resume is bit-exact, at the cost of one walk over the autograd graph per step"
)


class DDPBucketsWarning(UserWarning):
    """A resumed DDP run cannot start with the uninterrupted run's bucket layout: not bit-exact."""


def ddp_of(model: nn.Module | None) -> Any:
    """The ``DistributedDataParallel`` the user built (under ``torch.compile`` too), or None."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    return model if isinstance(model, DistributedDataParallel) else None


def ddps_of(model: nn.Module | None) -> list[tuple[str, Any]]:
    """Every ``DistributedDataParallel`` in the model, by its module path ("" for the model itself):
    a GAN's generator and discriminator may each be one."""
    top = ddp_of(model)
    if top is not None or model is None:
        return [("", top)] if top is not None else []
    found: list[tuple[str, Any]] = []
    for name, module in getattr(model, "_orig_mod", model).named_modules():
        ddp = ddp_of(module)
        if ddp is not None and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, ddp))
    return found


def rebuilds(ddp: Any) -> bool:
    """Whether this DDP rebuilds its buckets (not with ``find_unused_parameters`` unless static)."""
    return bool(ddp.static_graph or not ddp.find_unused_parameters) and not getattr(ddp, "_use_python_reducer", False)


def reducer_parameters(ddp: Any) -> list[nn.Parameter]:
    """The reducer's parameters, in its index order (``DistributedDataParallel._build_params_for_reducer``,
    without that method's side effect on the module's buffers)."""
    ignored = ddp.parameters_to_ignore
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and f"{module_name}.{name}" not in ignored and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def shapes_key(params: list[nn.Parameter]) -> str:
    """A short fingerprint of the parameters' shapes and dtypes, in reducer order."""
    text = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(order: list[int] | None, params: list[nn.Parameter], ddp: Any) -> str | None:
    """A short fingerprint of the layout DDP builds from ``order``: the order, the parameters'
    shapes, and the bucket caps (the layout is a function of the three)."""
    if order is None:
        return None
    caps = (getattr(ddp, "bucket_bytes_cap", None), ddp.static_graph)
    text = f"{order}|{shapes_key(params)}|{caps}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def unsupported(ddp: Any) -> str | None:
    """The private torch API ``prime`` needs that this torch lacks, or None when all is there."""
    reducer = getattr(ddp, "reducer", None)
    needs = [(reducer, "Reducer.prepare_for_forward"), (reducer, "Reducer.prepare_for_backward")]
    needs.append((ddp, "DistributedDataParallel._has_rebuilt_buckets"))
    if ddp.static_graph:
        needs.append((reducer, "Reducer._delay_all_reduce"))
        needs.append((ddp, "DistributedDataParallel._static_graph_delay_allreduce_enqueued"))
    missing = [name for owner, name in needs if not hasattr(owner, name.rsplit(".", 1)[1])]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)}"
    if any(getattr(module, "sparse", False) is True for module in ddp.module.modules()):
        return "the model has a sparse-gradient embedding (the zero pass makes dense gradients)"
    return None


class BucketOrder:
    """The gradient-ready order DDP builds its layout from in this process, and its check on resume.

    ``report(action, fields)`` is called from inside autograd's engine at the end of a backward:
    ``"recorded"`` when the order DDP rebuilds from is known (a run that did not resume through
    ``prime``), ``"checked"`` after the first real synchronised backward that followed ``prime``.
    """

    def __init__(self, ddp: Any, report: Callable[[str, dict[str, Any]], None]) -> None:
        self.ddp = ddp
        self.params = reducer_parameters(ddp)
        self.needed = 2 if ddp.static_graph else 1  # synchronised backwards before DDP rebuilds
        self.synced = 0  # synchronised backwards DDP has run, capped at ``needed``
        self.order: list[int] | None = None  # the order DDP rebuilt (or will rebuild) from
        self.primed: dict[str, Any] | None = None  # what prime() did, until the check
        # static_graph: the parameters its first backward did not reach. DDP treats them as unused
        # from then on and puts them last in the order it rebuilds from; the zero passes skip them.
        self.unused: list[int] | None = None
        self._report = report
        self._seen: list[int] = []
        self._handles: list[Any] = []
        self._listen()

    # ------------------------------------------------------------ recording
    def _listen(self) -> None:
        for index, param in enumerate(self.params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._ready(index)))  # type: ignore[no-untyped-call]

    def _ready(self, index: int) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            if not self.ddp.require_backward_grad_sync:  # inside no_sync(): DDP ignores this backward
                return
            if not self._seen:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._seen.append(index)

        return ready

    def _backward_ended(self) -> None:
        seen, self._seen = self._seen, []
        if self.synced < self.needed:
            self.synced += 1
            if self.ddp.static_graph and self.synced == 1 and self.unused is None:
                self.unused = sorted(set(range(len(self.params))) - set(seen))
            if self.synced == self.needed and self.order is None:
                self.order = seen + (self.unused or [])
                self._report("recorded", {"fingerprint": self.layout})
        if self.primed is not None:
            self._check(seen)
        if self.synced >= self.needed and self.primed is None:
            self.close()

    def close(self) -> None:
        """Remove the hooks: nothing of this runs on later steps."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _check(self, seen: list[int]) -> None:
        primed, self.primed = self.primed, None
        assert primed is not None
        # Primed through every backward DDP rebuilds from: it must have rebuilt at the first
        # forward since (from the saved order). Primed through fewer (a static graph saved after
        # one step): it must not have, and rebuilds later from this run's order, as the
        # uninterrupted run did.
        full = primed["passes"] == self.needed
        rebuilt = bool(getattr(self.ddp, "_has_rebuilt_buckets", False))
        fields = {
            "passes": primed["passes"],
            "fingerprint": primed["fingerprint"],
            "rebuilt": rebuilt,
            "same_order": (seen + (self.unused or []) == self.order) if full else None,
            "exact": rebuilt == full,
        }
        self._report("checked", fields)

    # ------------------------------------------------------------ saving
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: rank 0's (DDP broadcasts rank 0's rebuilt layout to every rank)."""
        return {
            "order": self.order,
            "synced": self.synced,
            "static_graph": bool(self.ddp.static_graph),
            "unused": self.unused,
            "params": len(self.params),
            "shapes": shapes_key(self.params),
            "fingerprint": self.layout,
        }

    @property
    def layout(self) -> str | None:
        """The fingerprint of the layout DDP rebuilt (or will rebuild) from ``order``."""
        return fingerprint(self.order, self.params, self.ddp)

    # ------------------------------------------------------------ resuming
    def mismatch(self, saved: dict[str, Any]) -> str | None:
        """Why the saved layout cannot be this DDP's, or None."""
        if saved.get("params") != len(self.params) or saved.get("shapes") != shapes_key(self.params):
            return (
                f"the model's parameters changed since the checkpoint was saved ({saved.get('params')} "
                f"parameter tensors then, {len(self.params)} now, or other shapes)"
            )
        if bool(saved.get("static_graph")) != bool(self.ddp.static_graph):
            return f"static_graph was {bool(saved.get('static_graph'))} when the checkpoint was saved"
        order = saved.get("order")
        if order is not None and sorted(order) != list(range(len(self.params))):
            return "the saved gradient order does not name each parameter once"
        if order is not None and fingerprint(order, self.params, self.ddp) != saved.get("fingerprint"):
            return "DDP's bucket size (bucket_cap_mb) changed since the checkpoint was saved: another layout"
        return None

    def prime(self, saved: dict[str, Any]) -> dict[str, Any]:
        """Take DDP through the synchronised backwards the saved run had run (at most ``needed``),
        each gradient made ready in the saved order; every rank calls it at the same point (each
        pass all-reduces). Returns the trail's fields."""
        synced = min(int(saved.get("synced", 0)), self.needed)
        order = saved.get("order")
        passes = synced if order is not None else min(synced, self.needed - 1)
        unused = set(saved.get("unused") or []) if self.ddp.static_graph else set()
        self.unused = sorted(unused) if synced else None
        rounds = [i for i in (range(len(self.params)) if order is None else order) if i not in unused]
        grads = [p.grad for p in self.params]
        try:
            for number in range(passes):
                self._zero_backward(rounds, first_static=self.ddp.static_graph and number == 0)
        finally:
            for param, grad in zip(self.params, grads, strict=True):
                param.grad = grad
        self.synced = passes
        self.order = order if passes == self.needed else None
        self._seen = []
        fields = {"passes": passes, "fingerprint": fingerprint(order, self.params, self.ddp)}
        if passes:
            self.primed = fields
        return fields

    def _zero_backward(self, order: list[int], first_static: bool) -> None:
        """One synchronised backward as DDP's forward would set it up, each gradient a zero made
        ready in ``order`` by a backward of its own; with ``static_graph``, the first iteration's
        all-reduce is the delayed one DDP's ``_DDPSink`` queues."""
        reducer, params = self.ddp.reducer, self.params
        handles, self._handles = self._handles, []  # not recorded: this is not the run's backward
        for handle in handles:
            handle.remove()
        try:
            reducer.prepare_for_forward()
            reducer.prepare_for_backward([])
            for index in order:
                param = params[index]
                torch.autograd.backward(param.reshape(-1)[:1].sum() * 0)  # reshape: channels_last
            if first_static:
                reducer._delay_all_reduce()
                self.ddp._static_graph_delay_allreduce_enqueued = True
        finally:
            self._listen()


# ---------------------------------------------------------------- the trainer's side
#: ``ddp_buckets`` event fields an action leaves unset.
FIELDS = dict.fromkeys(("fingerprint", "passes", "rebuilt", "same_order", "exact", "reason"))


def watch(model: nn.Module | None, world_size: int, events: Any) -> dict[str, BucketOrder]:
    """BUILD: follow the order each DDP of the model will rebuild its buckets from (by module path),
    with several ranks (with one, nothing is all-reduced). A DDP that never rebuilds
    (``find_unused_parameters=True``) needs nothing."""
    if world_size < 2:
        return {}
    return {name: BucketOrder(ddp, _reporter(events, name)) for name, ddp in ddps_of(model) if rebuilds(ddp)}


def _reporter(events: Any, module: str) -> Callable[[str, dict[str, Any]], None]:
    def report(action: str, fields: dict[str, Any]) -> None:
        record = {**FIELDS, **fields, "action": action, "module": module}
        if action != "checked" or (fields["exact"] and fields["same_order"] is not False):
            events.debug("ddp_buckets", **record)  # routine: the trail's, not the console's
            return
        events.warning("ddp_buckets", **record)
        what = (
            "DDP did not rebuild its buckets as primed"
            if not fields["exact"]
            else "the gradients became ready in another order than in the saved run (the model's graph changed)"
        )
        warnings.warn(
            f"{what}: this resumed run may differ from an uninterrupted one in the last bits",
            DDPBucketsWarning,
            stacklevel=1,
        )

    return report


def prime_all(orders: dict[str, BucketOrder], saved: dict[str, Any] | None, step: int, events: Any) -> None:
    """RESTORE, on every rank at once (each pass all-reduces): give each resumed DDP the saved run's
    layout, or say in the trail and in a warning why it cannot have it. Every input is the same on
    every rank (rank 0's saved state, the same model, the same torch), so every rank decides alike."""
    for module, order in orders.items():
        if order.synced or order.primed is not None:
            continue  # a DDP that has run already (a load during training): nothing to prime
        mine = (saved or {}).get(module)
        if mine is None and step == 0:
            continue  # saved before any step: DDP had not rebuilt, nor will the resumed one yet
        if mine is None:
            reason: str | None = (
                "the checkpoint holds no gradient order (saved on one rank, by trainloop or by an earlier trainfsm)"
                if saved is None
                else f"the saving run recorded no gradient order for the DDP at {module or 'the model'!r} (its DDP "
                f"did not rebuild its buckets: find_unused_parameters=True; or the module moved)"
            )
        else:
            reason = order.mismatch(mine) or unsupported(order.ddp)
        if mine is None or reason is not None:
            events.warning("ddp_buckets", **{**FIELDS, "action": "not_primed", "module": module, "reason": reason})
            warnings.warn(
                f"this resumed DDP run starts with DDP's first bucket layout, not the saved run's: {reason}. With more "
                f"than two ranks it differs from an uninterrupted run in the last bits. For bit-exact resumes, "
                f"{ADVICE}.",
                DDPBucketsWarning,
                stacklevel=1,
            )
            continue
        fields = order.prime(mine)
        if fields["passes"]:
            events.info("ddp_buckets", **{**FIELDS, **fields, "action": "primed", "module": module})
