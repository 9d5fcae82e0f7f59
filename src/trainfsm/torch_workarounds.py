"""Workarounds for torch behaviour that would otherwise hurt a run of ours; each says when it can go.

**A destroyed process group that stays alive.** ``torch.distributed.nn.functional`` takes
``group=group.WORLD`` as default arguments, evaluated once, when the module is first imported.
torch imports it lazily and often late: building the first optimizer imports ``torch._dynamo``,
which imports FSDP and with it this module. If that happens after ``init_process_group`` (the
order of every training script), the default group is captured in those defaults, and
``destroy_process_group()`` no longer frees it: gloo's worker threads run on into interpreter
shutdown. If one of them is still releasing the last collective's work item there, it needs the
GIL, the finalizing interpreter ends the thread, and C++ aborts the process: exit 134/-6,
"terminate called without an active exception", after a run that finished cleanly (seen in
about one in eight two-rank runs here, torch 2.13). Under torchrun or srun that marks the job
failed.

Importing the module before any group exists makes those defaults None (the default group at
call time), so nothing holds the group. ``import trainfsm`` does that: scripts import it at the
top, before they create their group. Costs about 0.08 s once. Checked by
``tests/test_torch_workarounds.py``, which also shows when torch stops capturing the group (then
this can go).
"""

from __future__ import annotations

import importlib

import torch.distributed as dist


def import_collectives_before_any_group() -> None:
    """Import ``torch.distributed.nn.functional`` now if no process group exists yet."""
    if dist.is_available() and not dist.is_initialized():
        importlib.import_module("torch.distributed.nn.functional")
