"""The CNN of this example: two 5x5 convolutions with max pooling, then two linear
layers, for 28x28 grayscale images in 10 classes (MNIST's shape).

    conv1  Conv2d(1 -> 16, 5x5, padding 2) - ReLU - MaxPool 2    16 x 14 x 14
    conv2  Conv2d(16 -> 32, 5x5, padding 2) - ReLU - MaxPool 2   32 x 7 x 7
    fc1    flatten - Linear(32*7*7 -> 128) - ReLU
    fc2    Linear(128 -> 10)

215,370 parameters. Their ``state_dict`` names (``conv1.weight``, ``conv1.bias``,
``conv2.weight``, ``conv2.bias``, ``fc1.weight``, ``fc1.bias``, ``fc2.weight``,
``fc2.bias``) are the tensor names Cohort averages, so changing the architecture means
starting a new experiment from a new initial model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SHAPE = (1, 28, 28)
CLASSES = 10


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    print(f"{num_parameters(CNN()):,} parameters")
