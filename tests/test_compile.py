"""``torch.compile`` of the model ``initialize`` returned (docs/faq.md): training through the compiled model is
training through the eager one. With the ``aot_eager`` backend (torch's graph capture and autograd tracing,
without inductor's code generation, which fuses and reorders arithmetic) the weights agree bit for bit at every
level on CPU: amp's input and output casts, the half model, the masters and the skipped steps survive the capture.
On CUDA the captured BatchNorm may run torch's own kernel where eager runs cuDNN's, so there they agree to
rounding."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ampinit import amp
from tests._device import device_under_test, on_device
from tests.conftest import SmallNet

INPUT_DTYPE = {"O2": torch.float16, "O3": torch.float16, "O5": torch.bfloat16}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train(level: str, compiled: bool, steps: int = 3, poison_step: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = on_device(SmallNet())
    # fp16 Adam diverges at O3 (docs/faq.md): SGD there, AdamW elsewhere
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if level == "O3"
        else torch.optim.AdamW(model.parameters(), lr=1e-2)
    )
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    run: nn.Module = torch.compile(model, backend="aot_eager") if compiled else model  # type: ignore[assignment]
    try:
        for step in range(steps):
            x = on_device(torch.randn(32, 8, generator=gen)).to(INPUT_DTYPE.get(level, torch.float32))
            with amp.scale_loss(run(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
                if step == poison_step:
                    model.fc1.weight.grad[0, 0] = float("nan")
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()] + [p.detach().clone() for p in amp.master_params(opt)]
    finally:
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_a_compiled_model_trains_bit_for_bit_as_the_eager_one(level: str) -> None:
    poison = 1 if level in ("O2", "O5") else None  # a skipped step inside the compiled run too
    compiled, eager = train(level, True, poison_step=poison), train(level, False, poison_step=poison)
    assert len(compiled) == len(eager)
    for a, b in zip(compiled, eager):
        assert a.dtype == b.dtype
        if device_under_test().type == "cpu":
            assert torch.equal(a, b), (a, b)
        else:
            torch.testing.assert_close(a, b)


class _SoftmaxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return torch.softmax(h, -1), torch.layer_norm(h, (8,))


def test_a_model_compiled_in_an_earlier_session_follows_the_cast_policy_of_the_next() -> None:
    # The extra kernels' casts are traced into an AOT graph and Dynamo guards on the autocast state only: a graph
    # captured under "native" (softmax in fp16) was reused under "apex" (fp32), and the other way round.
    x = torch.randn(4, 8)  # on the CPU, where softmax and layer_norm are on neither of autocast's lists
    seen = []
    for policy in ["native", "apex", "native"]:
        torch.manual_seed(0)
        model = _SoftmaxHead()
        amp.initialize(model, opt_level="O1", cast_policy=policy, verbosity=0)
        try:
            compiled = torch.compile(model, backend="aot_eager")
            seen.append(([t.dtype for t in model(x)], [t.dtype for t in compiled(x)]))
        finally:
            amp.deinitialize()
    half, full = [torch.float16] * 2, [torch.float32] * 2
    assert seen == [(half, half), (full, full), (half, half)]
