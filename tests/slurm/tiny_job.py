"""The tiny regression trainer the SLURM job scripts share (``stall_job.py``, ``slow_save_job.py``):
48 samples of 6 features, a two-layer network with dropout (so the random state matters on
resume), Adam. Each script adds its hooks and its ``forward``. The scripts run as files, so this
folder is on their ``sys.path``; they import this after parsing their arguments (torch loads then).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainfsm import BaseTrainer


class TinyJobTrainer(BaseTrainer):
    def build_data_loader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))

    def build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=0.01)  # type: ignore[union-attr]
