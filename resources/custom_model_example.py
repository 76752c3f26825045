"""Example of the custom-model contract: ``acstudio profile resources/custom_model_example.py:make --batch-size 8``.

The factory takes the batch size and returns ``(model, batch, loss_fn)``; ``loss_fn(model, batch)`` returns a
scalar loss. The model is built with random weights on the CPU; AC Studio moves it to the chosen device.
"""

import torch
import torch.nn.functional as F
from torch import nn


class TinyRegressor(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, width),
                                  nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A tensor made inside forward becomes a graph constant; AC Studio keeps it with the graph.
        scale = torch.tensor([1.0, 0.5])
        return self.head(self.body(x)) * scale.to(x.device)


def make(batch_size: int):
    model = TinyRegressor()
    batch = {"x": torch.randn(batch_size, 16), "y": torch.randn(batch_size, 2)}

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        return F.mse_loss(model(batch["x"]), batch["y"])

    return model, batch, loss_fn
