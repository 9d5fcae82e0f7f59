"""The run, as data: ``examples/config/train.py`` loads this with ``cfgx.load`` and builds it with
``specbuild.build``. ``type`` names a class registered with ``@specbuild.register()`` (``MyTrainer``,
``ToyDataset``, ``MyModel``) or a dotted import path (``torch.optim.AdamW``). Small and CPU-friendly:
an in-memory dataset, a 32-64-4 MLP, no mixed precision.

Override any value from the command line, e.g. ``--set max_steps=500 --set optimizer.lr=1e-3``.
"""

config = {
    "type": "MyTrainer",
    "max_steps": 200,
    "grad_clip": 1.0,
    "mixed_precision": None,  # "bf16" on hardware that has it
    "gradient_accumulation_steps": 2,
    "workspace": "./runs/config",
    "data": {
        "type": "torch.utils.data.DataLoader",
        "dataset": {"type": "ToyDataset", "size": 1024, "features": 32, "classes": 4},
        "batch_size": 32,
        "shuffle": True,
        "drop_last": True,
    },
    "model": {
        "type": "MyModel",
        "in_dim": 32,
        "hidden_dim": 64,
        "out_dim": 4,
    },
    "optimizer": {
        "type": "torch.optim.AdamW",
        "lr": 3e-3,
    },
}
