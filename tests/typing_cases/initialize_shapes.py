"""Checked by mypy in tests/test_typing.py (never run): initialize returns what it was given, typed."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import assert_type

import ampinit


class Net(nn.Module):
    pass


net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
assert_type(ampinit.initialize(net), Net)
assert_type(ampinit.initialize([net, net]), list[Net])
assert_type(ampinit.initialize(net, opt), tuple[Net, torch.optim.SGD])
assert_type(ampinit.initialize(net, [opt]), tuple[Net, list[torch.optim.SGD]])
assert_type(ampinit.initialize([net], opt, opt_level="O2"), tuple[list[Net], torch.optim.SGD])
assert_type(ampinit.initialize([net], [opt], True, "O2"), tuple[list[Net], list[torch.optim.SGD]])
with ampinit.scale_loss(torch.zeros(()), [opt], loss_id=0) as scaled:
    assert_type(scaled, torch.Tensor)
