"""The linear MLP head that two official reward checkpoints share.

LAION's aesthetic predictor (christophschuhmann/improved-aesthetic-predictor, ``MLP``) and
ImageReward (THUDM/ImageReward, ``ImageReward.py: MLP``, which took it over) score an
embedding with five linears and no activation between them. The Dropouts are identities
at eval but keep the official state-dict indices (layers.0, .2, .4, .6, .7), so both
checkpoints load into this one class.
"""

from __future__ import annotations

import torch
from torch import nn


class RewardMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(width, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
