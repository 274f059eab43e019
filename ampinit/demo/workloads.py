"""The demo's two tasks as the interleaved training drives them (the :class:`Task` protocol: build, batches, loss,
evaluation), on the builders of :mod:`ampinit.demo.tasks`, with each task's learning rate.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from ampinit import amp
from ampinit.demo.config import opt_level
from ampinit.demo.tasks import checkerboard, coordinate_grid, make_checkerboard, make_classifier


class Task(Protocol):
    name: str
    description: str
    accuracy_name: str

    def build(self, seed: int, device: torch.device) -> nn.Module: ...

    def batches(self, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> tuple[float, list[list[float]] | None]: ...

    def target_image(self) -> list[list[float]] | None: ...


class CheckerboardTask:
    """Pixel coordinates -> an 8 x 8 checkerboard; one fixed batch of jittered coordinates."""

    name = "checkerboard"
    accuracy_name = "pixel accuracy"

    def __init__(self, quick: bool, device: torch.device) -> None:
        self.batch_size, self.grid, self.width, self.depth = (4, 16, 32, 3) if quick else (8, 32, 64, 4)
        self.device = device
        self.description = (
            f"coordinates ({self.batch_size} x 2 x {self.grid} x {self.grid}) -> 8 x 8 checkerboard; "
            f"{self.depth} x (1x1 Conv2d({self.width}) + BatchNorm2d + ReLU), BCE-with-logits, AdamW lr 3e-3"
        )
        grid = coordinate_grid(self.grid, self.grid).unsqueeze(0)
        self.clean_coords = grid.to(device)
        self.clean_target = checkerboard(grid, 8).to(device)

    def build(self, seed: int, device: torch.device) -> nn.Module:
        model, inputs, target, _ = make_checkerboard(
            seed, batch_size=self.batch_size, grid=self.grid, width=self.width, depth=self.depth
        )
        self._batch = (inputs.to(device), target.to(device))
        return model.to(device)

    def batches(self, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self._batch

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(output, target)

    def evaluate(self, model: nn.Module) -> tuple[float, list[list[float]] | None]:
        model.eval()
        with torch.no_grad():
            drawn = torch.sigmoid(model(self.clean_coords).float())
        model.train()
        accuracy = ((drawn > 0.5).float() == self.clean_target).float().mean().item()
        return accuracy, drawn[0, 0].cpu().tolist()

    def target_image(self) -> list[list[float]] | None:
        return list(self.clean_target[0, 0].cpu().tolist())


class MlpTask:
    """An MLP classifier on a synthetic dataset, trained on random minibatches, scored on the held-out split."""

    name = "mlp"
    accuracy_name = "test accuracy"

    def __init__(self, quick: bool, device: torch.device) -> None:
        self.sizes = (
            {"train_size": 2048, "test_size": 512, "hidden": 128, "depth": 2}
            if quick
            else {"train_size": 8192, "test_size": 2048, "hidden": 512, "depth": 3}
        )
        self.batch_size = 128 if quick else 256
        self.device = device
        s = self.sizes
        self.description = (
            f"10-class synthetic dataset ({s['train_size']} train / {s['test_size']} test points in 16-d), "
            f"MLP {s['depth']} x (Linear({s['hidden']}) + LayerNorm + GELU), batch {self.batch_size}, "
            "cross-entropy, AdamW lr 1e-3"
        )

    def build(self, seed: int, device: torch.device) -> nn.Module:
        data = make_classifier(seed, **self.sizes)
        self._train = (data.train_inputs.to(device), data.train_target.to(device))
        self._test = (data.test_inputs.to(device), data.test_target.to(device))
        return data.model.to(device)

    def batches(self, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, target = self._train
        generator = torch.Generator().manual_seed(seed)
        while True:
            index = torch.randint(0, inputs.shape[0], (self.batch_size,), generator=generator).to(inputs.device)
            yield inputs[index], target[index]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def evaluate(self, model: nn.Module) -> tuple[float, list[list[float]] | None]:
        inputs, target = self._test
        model.eval()
        with torch.no_grad():
            predicted = model(inputs).argmax(dim=1)
        model.train()
        return (predicted == target).float().mean().item(), None

    def target_image(self) -> list[list[float]] | None:
        return None


def _make_task(name: str, quick: bool, device: torch.device) -> Task:
    return CheckerboardTask(quick, device) if name == "checkerboard" else MlpTask(quick, device)


_LEARNING_RATES = {"checkerboard": 3e-3, "mlp": 1e-3}


def initialize(
    model: nn.Module, optimizer: torch.optim.Optimizer, level: str
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``amp.initialize`` at ``level``, quietly. The demo runs O3 with AdamW on purpose (Apex's speed baseline; the
    table's notes say it diverged and why), so initialize's warning about an ``eps`` that fp16 cannot hold is not
    shown in the middle of the progress bars."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*which is 0 in float16", category=UserWarning)
        return amp.initialize(model, optimizer, opt_level=opt_level(level), verbosity=0)
