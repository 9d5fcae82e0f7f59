"""Checkpoints: everything ``CheckpointingHook`` uses to save and load them, in one room.

- ``store``: one directory per step, written atomically (temporary directory, fsyncs, manifest
  last, rename, ``latest``), listed, verified and pruned;
- ``parts``: a save's files, each written its own way, fsynced after the last; the other ranks' checked;
- ``directories``: the step directories under a store's root, and who wrote each (trainloop's are foreign);
- ``pointers``: ``latest``, ``best``, ... moved atomically, and those that wait for a save;
- ``recycling``: a pruned checkpoint's large files, kept for the next saves to write over;
- ``reservation``: the room of a run's checkpoints, taken in RESTORE;
- ``writemode``: through the page cache or past it (``O_DIRECT``), measured on the disk and chosen;
- ``manifest``: what a complete checkpoint holds and the checks made before a byte is unpickled;
- ``lineage``: the order checkpoints were written in, and which ones a rollback abandoned;
- ``replace``: a step saved again over its old copy, and the copies a kill left on the way;
- ``io``: how bytes reach the disk fast (staging buffers, ``O_DIRECT``, checksums on the way);
- ``disk``: whether a file may be written over (nothing else sees it), and room taken without writing;
- ``sharded``: DCP for model and optimizer states split over ranks;
- ``trainloop``: checkpoints that trainloop wrote, read as they are;
- ``save``, ``restore``, ``background``: what a checkpoint holds and which rank writes what, which
  checkpoint loads and how its state gets back, and the writer thread of ``async_save=True``.

Nothing here imports the trainer, the run or a hook at run time. The store's public names are
here as well: ``from trainfsm.checkpoint import CheckpointStore`` is the documented path.
"""

from trainfsm.checkpoint.store import *  # noqa: F403  (the store's public names, listed once, there)
from trainfsm.checkpoint.store import __all__ as __all__
