"""The offline tools: the ``trainfsm`` command and what it runs (audit, trace, plot, inspect, diagram, demo).

Nothing is imported here: ``trainfsm audit``, ``trace``, ``plot`` and ``diagram`` must start without torch.
"""
