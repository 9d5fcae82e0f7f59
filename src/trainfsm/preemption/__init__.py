"""Preemption: ending a run cleanly on a scheduler's signal, in one room.

- ``policy``: which signals end a run and how (``ExitPolicy``, ``exit_policy``), and
  ``Preemption``, which installs the handlers for one ``train()`` and sequences the way out
  (agree, checkpoint, requeue, exit ``128 + signal``);
- ``signals``: the handlers themselves and what may run inside one;
- ``slurm``: the batch job (``SLURM_*``), requeueing it;
- ``torchelastic``: what torchrun's agent tells its workers (``TORCHELASTIC_*``, read only there).

Nothing here imports the trainer, the run or a hook at run time.
``from trainfsm.preemption import exit_policy`` is the documented path.
"""

from trainfsm.preemption.policy import DEFAULT_EXIT_SIGNALS, ExitPolicy, Preemption, exit_policy

__all__ = ["DEFAULT_EXIT_SIGNALS", "ExitPolicy", "Preemption", "exit_policy"]
