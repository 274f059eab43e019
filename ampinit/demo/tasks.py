"""Small, deterministic training workloads for `ampinit demo` and the amp benchmarks.

Each builder returns a :class:`Workload`, a named tuple that unpacks as ``(model, inputs, target, loss_fn)``:

    model, inputs, target, loss_fn = make_mlp(seed=0)
    loss = loss_fn(model(inputs), target)

Everything is built on the CPU in fp32 from ``seed`` alone, without touching the global RNG state, so two
calls with the same arguments give identical weights and data (what the benchmark needs to compare precisions
on the same starting point). The models use only standard layers, so every opt level and ``torch.autocast`` apply.

* :func:`make_mlp`: 4 x (Linear + LayerNorm + GELU) on 1024 features, batch 256: matmul-bound, the case where
  bf16 compute pays off most.
* :func:`make_checkerboard`: a per-pixel network of 1x1 convolutions with BatchNorm that learns to draw an
  8 x 8 checkerboard from (x, y) coordinates: a mix of small matmuls and memory-bound BatchNorm/activation
  work, and BatchNorm is what O2/O5 keep in fp32.
* :func:`make_classifier`: a synthetic classification dataset (train and held-out split) with an MLP to learn
  it, for ``ampinit demo``: unlike the fixed-batch workloads it has a test set, so accuracy means something.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MlpTask = Literal["classification", "regression"]


class Workload(NamedTuple):
    """A model with one fixed batch: ``loss_fn(model(inputs), target)`` is a training loss."""

    model: nn.Module
    inputs: torch.Tensor
    target: torch.Tensor
    loss_fn: LossFn


# -- (a) MLP -------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """``depth`` x (Linear(features, features) + LayerNorm + GELU), then a Linear head to ``outputs``."""

    def __init__(self, features: int, depth: int, outputs: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(features, features), nn.LayerNorm(features), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(features, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.body(x))
        return logits


def make_mlp(
    seed: int = 0,
    *,
    batch_size: int = 256,
    features: int = 1024,
    depth: int = 4,
    task: MlpTask = "classification",
    num_classes: int = 16,
) -> Workload:
    """The MLP workload: Gaussian inputs, targets from a fixed random "teacher" projection of the inputs.

    Args:
        seed: determines the weights, the inputs and the teacher.
        batch_size, features, depth: the batch is ``(batch_size, features)``; ``depth`` hidden blocks.
        task: ``"classification"`` (``num_classes`` logits, cross-entropy against the teacher's argmax) or
            ``"regression"`` (``num_classes`` outputs, MSE against the teacher's tanh outputs).
        num_classes: width of the head.
    """
    _check_positive(batch_size=batch_size, features=features, depth=depth, num_classes=num_classes)
    if task not in ("classification", "regression"):
        raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(features, depth, num_classes)
        inputs = torch.randn(batch_size, features)
        teacher = torch.randn(features, num_classes) / math.sqrt(features)
    scores = inputs @ teacher
    if task == "classification":
        return Workload(model, inputs, scores.argmax(dim=1), nn.CrossEntropyLoss())
    return Workload(model, inputs, torch.tanh(scores), nn.MSELoss())


# -- (b) checkerboard CNN ------------------------------------------------------------------------------------
class FourierFeatures(nn.Module):
    """Appends ``sin`` and ``cos`` of ``2^k * pi * c`` (k < ``octaves``) to the coordinate channels ``c``.

    Parameter-free, so every layer that learns is still a 1x1 convolution. With 8 squares per side the
    boundaries lie at multiples of 1/4, which the ``4 * pi`` octave expresses directly: the task becomes easy
    to learn without changing what the benchmark measures.
    """

    def __init__(self, octaves: int) -> None:
        super().__init__()
        self.octaves = octaves

    @property
    def out_channels(self) -> int:
        return 2 + 4 * self.octaves

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        if self.octaves == 0:
            return coords
        scales = math.pi * 2.0 ** torch.arange(self.octaves, dtype=coords.dtype, device=coords.device)
        # (B, 2, H, W) -> (B, 2 * octaves, H, W): every coordinate channel times every frequency.
        angles = (coords.unsqueeze(2) * scales.view(1, 1, -1, 1, 1)).flatten(1, 2)
        return torch.cat([coords, angles.sin(), angles.cos()], dim=1)


class CheckerboardNet(nn.Module):
    """Fourier features, ``depth`` x (1x1 Conv2d + BatchNorm2d + activation), then a 1-channel 1x1 conv."""

    def __init__(self, width: int, depth: int, octaves: int, activation: Literal["relu", "gelu"]) -> None:
        super().__init__()
        features = FourierFeatures(octaves)
        layers: list[nn.Module] = [features]
        channels = features.out_channels
        for _ in range(depth):
            act: nn.Module = nn.ReLU() if activation == "relu" else nn.GELU()
            layers += [nn.Conv2d(channels, width, kernel_size=1, bias=False), nn.BatchNorm2d(width), act]
            channels = width
        layers.append(nn.Conv2d(channels, 1, kernel_size=1))
        self.net = nn.Sequential(*layers)

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.net(coords)
        return logits


def coordinate_grid(height: int, width: int) -> torch.Tensor:
    """The ``(2, height, width)`` pixel-centre coordinates ``(x, y)`` of a ``[-1, 1]^2`` image."""
    ys = (torch.arange(height) + 0.5) * (2.0 / height) - 1.0
    xs = (torch.arange(width) + 0.5) * (2.0 / width) - 1.0
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_x, grid_y])


def checkerboard(coords: torch.Tensor, squares: int) -> torch.Tensor:
    """1.0 on the "white" squares of a ``squares x squares`` board over ``[-1, 1]^2``, else 0.0.

    ``coords`` is ``(..., 2, H, W)``; the result is ``(..., 1, H, W)``.
    """
    cells = ((coords + 1.0) * (squares / 2.0)).floor().clamp(0, squares - 1)
    parity = (cells[..., 0:1, :, :] + cells[..., 1:2, :, :]).remainder(2)
    return parity.to(torch.float32)


def make_checkerboard(
    seed: int = 0,
    *,
    batch_size: int = 8,
    grid: int = 32,
    width: int = 96,
    depth: int = 5,
    squares: int = 8,
    octaves: int = 4,
    activation: Literal["relu", "gelu"] = "relu",
) -> Workload:
    """The checkerboard workload: ``(B, 2, grid, grid)`` coordinates in, a ``(B, 1, grid, grid)`` board out.

    Each batch item samples the same board at jittered points (every pixel's coordinate moves uniformly within
    its cell), so the items differ while the target stays an exact function of the input. The loss is
    ``BCEWithLogitsLoss``: the network outputs one logit per pixel.

    Args:
        seed: determines the weights and the jitter.
        batch_size, grid: the input is ``(batch_size, 2, grid, grid)``.
        width, depth: channels and number of hidden Conv + BatchNorm + activation blocks.
        squares: squares per side of the board.
        octaves: Fourier-feature octaves added by the model (0: raw coordinates only).
        activation: ``"relu"`` or ``"gelu"``.
    """
    _check_positive(batch_size=batch_size, grid=grid, width=width, depth=depth, squares=squares)
    if octaves < 0:
        raise ValueError(f"octaves must be >= 0, got {octaves!r}")
    if activation not in ("relu", "gelu"):
        raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CheckerboardNet(width, depth, octaves, activation)
        jitter = (torch.rand(batch_size, 2, grid, grid) - 0.5) * (2.0 / grid)
    coords = (coordinate_grid(grid, grid) + jitter).clamp(-1.0, 1.0)
    return Workload(model, coords, checkerboard(coords, squares), nn.BCEWithLogitsLoss())


# -- (c) classifier on a synthetic dataset ------------------------------------------------------------------
class Classifier(NamedTuple):
    """A model and a labelled dataset: train on ``(train_inputs, train_target)``, measure on the test split."""

    model: nn.Module
    train_inputs: torch.Tensor
    train_target: torch.Tensor
    test_inputs: torch.Tensor
    test_target: torch.Tensor
    loss_fn: LossFn


def make_classifier(
    seed: int = 0,
    *,
    train_size: int = 8192,
    test_size: int = 2048,
    in_features: int = 16,
    hidden: int = 512,
    depth: int = 3,
    num_classes: int = 10,
) -> Classifier:
    """Gaussian points labelled by a fixed random two-layer "teacher" network, and an MLP to learn the labels.

    The labels are the teacher's argmax, a nonlinear function of the input: learnable, but not in a few steps.
    The model is ``Linear(in_features, hidden)`` followed by :class:`MLP` (``depth`` blocks of ``hidden``
    features) and a ``num_classes`` head; the loss is cross-entropy.

    Args:
        seed: determines the weights, the points and the teacher.
        train_size, test_size: points in each split.
        in_features: dimension of the points.
        hidden, depth: width and number of Linear + LayerNorm + GELU blocks of the model.
        num_classes: number of labels.
    """
    _check_positive(
        train_size=train_size,
        test_size=test_size,
        in_features=in_features,
        hidden=hidden,
        depth=depth,
        num_classes=num_classes,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(in_features, hidden), MLP(hidden, depth, num_classes))
        inputs = torch.randn(train_size + test_size, in_features)
        teacher_in = torch.randn(in_features, 4 * num_classes) / math.sqrt(in_features)
        teacher_out = torch.randn(4 * num_classes, num_classes)
    labels = (torch.tanh(inputs @ teacher_in) @ teacher_out).argmax(dim=1)
    return Classifier(
        model,
        inputs[:train_size],
        labels[:train_size],
        inputs[train_size:],
        labels[train_size:],
        nn.CrossEntropyLoss(),
    )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
