"""Checked by mypy in tests/test_typing.py (never run): opt_level takes the level literal. A line that mypy must
refuse ends with a comment naming the error code it must give; the others must pass."""

from __future__ import annotations

from typing import Any, cast

import torch

import ampinit

net = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
ampinit.initialize(net, opt, opt_level="O2")
ampinit.initialize(net, opt, opt_level="O5")
ampinit.initialize(net, opt, opt_level="O6")  # E: call-overload
ampinit.initialize(net, opt, opt_level="o2")  # E: call-overload
config: dict[str, Any] = {"opt_level": "O1"}
ampinit.initialize(net, opt, opt_level=config["opt_level"])  # a level read from a config: Any passes
level: str = "O3"
ampinit.initialize(net, opt, opt_level=level)  # E: call-overload
ampinit.initialize(net, opt, opt_level=cast(ampinit.OptLevel, level))  # a checked str, told to mypy
