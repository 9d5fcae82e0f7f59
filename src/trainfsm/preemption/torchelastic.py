"""What torchrun's agent tells its workers, read in this module only.

The agent starts each worker with ``TORCHELASTIC_*`` variables: ``RESTART_COUNT`` (set in every
worker and only there, so it also says "this process is a torchrun worker"), ``MAX_RESTARTS``,
``RUN_ID`` and ``USE_AGENT_STORE``. It cannot tell a worker which restarted *group* it belongs to
across nodes (each agent counts only its own restarts), so ``trainfsm.distributed`` agrees on a
group number through the launcher store and records it here (``joined_group``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

#: Set by torchrun's agent in every worker's environment, and only there.
WORKER_VARIABLE: Final = "TORCHELASTIC_RESTART_COUNT"

#: The number of the group this process joined under torchrun (1 for the first), once it did.
_group: int | None = None


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun's agent started."""
    return WORKER_VARIABLE in os.environ


def restart_count(environ: dict[str, str] | None = None) -> int | None:
    """torchrun's restart count for this attempt (0 for the first), or None outside torchrun."""
    value = (os.environ if environ is None else environ).get(WORKER_VARIABLE, "")
    return int(value) if value.isdigit() else None


def uses_agent_store() -> bool:
    """Whether the agent shares its own store with the workers (torchrun's default)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def is_worker(pid: int) -> bool | None:
    """Whether process ``pid`` is itself a torchrun worker (a wrapper of ours, not the agent);
    None when its environment cannot be read."""
    try:
        return f"{WORKER_VARIABLE}=".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None


def joined_group(number: int) -> None:
    """Record the group number ``init_distributed`` agreed on (a fact about this process)."""
    global _group
    _group = number


def group() -> int | None:
    """The number of the torchrun group this process joined through ``init_distributed`` (1 for
    the first group of a launch, N+1 after N restarts of the group), the same on every node; None
    before that or outside torchrun."""
    return _group


def launch() -> dict[str, Any] | None:
    """``run_start``'s ``torchelastic`` record: which restart this is (0 for the first launch) of
    how many allowed, the launch's id and the group number; None outside torchrun."""
    restart = restart_count()
    if restart is None:
        return None
    maximum = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    return {
        "restart_count": restart,  # this node's agent's count: agents on other nodes may count fewer
        "max_restarts": int(maximum) if maximum.isdigit() else None,
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "group": _group,  # None when the script set up its group without init_distributed
    }
