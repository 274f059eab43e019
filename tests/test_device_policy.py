"""The O1/O4 cast policy on the test device against ``torch.autocast`` of that device: with
``cast_policy="native"`` every op must come out in the dtype native autocast gives it there."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampinit import amp

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OPS: dict[str, Op] = {
    "linear": lambda a, b: F.linear(a, b),
    "matmul": torch.matmul,
    "mm": torch.mm,
    "addmm": lambda a, b: torch.addmm(a @ b, a, b),
    "softmax": lambda a, b: torch.softmax(a @ b, -1),
    "log_softmax": lambda a, b: torch.log_softmax(a @ b, -1),
    "layer_norm": lambda a, b: F.layer_norm(a @ b, (a.shape[0],)),
    "mse_loss": lambda a, b: F.mse_loss(a @ b, a @ b),
    "exp": lambda a, b: torch.exp(a @ b),
    "sum": lambda a, b: (a @ b).sum(),
    "add fp32 + half": lambda a, b: a + (a @ b).half(),
    "cat": lambda a, b: torch.cat([a, b.t()]),
}


@pytest.mark.parametrize(("level", "dtype"), [("O1", torch.float16), ("O4", torch.bfloat16)])
@pytest.mark.parametrize("name", list(OPS))
def test_native_policy_matches_autocast_of_the_device(
    device: torch.device, level: str, dtype: torch.dtype, name: str
) -> None:
    op = OPS[name]
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 4, generator=gen).to(device), torch.randn(4, 4, generator=gen).to(device)
    with torch.autocast(device.type, dtype=dtype):
        expected = op(a, b)
    marker = nn.Linear(1, 1).to(device)  # the session casts on the devices its models live on
    amp.initialize(marker, opt_level=level, cast_policy="native", verbosity=0)
    try:
        actual = op(a, b)
    finally:
        amp.deinitialize()
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected)
