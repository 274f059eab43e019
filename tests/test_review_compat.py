"""Review of the Apex compatibility layer: behaviours that differ from Apex in ways legacy code hits.

Each test states the Apex rule it checks; the expected values come from that rule, not from ampinit's code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampinit
from ampinit.compat.apex import amp, apex_C
from ampinit.compat.apex.fp16_utils import (
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)
from ampinit.compat.apex.parallel import DistributedDataParallel, convert_syncbn_model


def test_to_python_float_returns_item_unchanged() -> None:
    """Apex's ``fp16util.to_python_float(t)`` is ``return t.item()`` (``t[0]`` without ``item``): an integer
    tensor gives a Python int and a bool tensor a bool, as ``Tensor.item()`` does. ImageNet-style scripts pass
    counts through it (``correct = to_python_float(pred.eq(target).sum())``) and format them with ``{:d}``,
    which raises ``ValueError`` for a float. ampinit wrapped the result in ``float()``."""
    count = to_python_float(torch.tensor(5))
    assert type(count) is int and count == 5
    assert f"{count:d}" == "5"
    assert type(to_python_float(torch.tensor(True))) is bool
    assert type(to_python_float(torch.tensor(2.5))) is float and to_python_float(torch.tensor(2.5)) == 2.5


def test_disabled_initialize_is_a_passthrough_every_time() -> None:
    """Apex's ``amp.initialize(..., enabled=False)`` returns its arguments at once (``if not enabled: return
    models, optimizers``), with nothing recorded on the model. A script that calls it again for the same model
    (a second training phase with a new optimizer, with ``enabled=args.fp16`` false) therefore runs under Apex.
    ampinit records the disabled session as the model's owner and refuses the second call ("already belongs to
    a live amp session")."""
    model = nn.Linear(4, 2)
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        assert amp.initialize(model, first, enabled=False) == (model, first)
        second = torch.optim.Adam(model.parameters(), lr=0.1)
        assert amp.initialize(model, second, enabled=False) == (model, second)
        loss = model(torch.randn(3, 4)).sum()
        with amp.scale_loss(loss, second) as scaled:
            assert scaled is loss
            scaled.backward()
        second.step()
    finally:
        while ampinit.current_session() is not None:
            ampinit.deinitialize()


def test_convert_syncbn_model_keeps_the_dtype_of_a_half_batchnorm() -> None:
    """Apex's ``convert_syncbn_model`` sets ``mod.weight.data = module.weight.data.clone().detach()`` (and the
    same for the bias) and hands over the running statistics: the SyncBatchNorm has the BatchNorm's dtype. ampinit
    copied a half BatchNorm's weights into new float32 parameters while keeping its half running statistics, so
    the converted layer of a ``.half()`` model failed in its forward ("mixed dtype")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).half().eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 5, 5).half()
    expected = model(x)
    converted = convert_syncbn_model(model).eval()
    bn = converted[1]
    assert bn.weight.dtype == bn.bias.dtype == bn.running_mean.dtype == torch.float16
    assert torch.equal(converted(x), expected)


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)  # type: ignore[operator]
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_disable_and_enable_allreduce(process_group: None) -> None:
    """Apex's ``DistributedDataParallel`` has ``disable_allreduce()`` and ``enable_allreduce()`` (they set
    ``self._disable_allreduce``, which its forward and its backward hooks check): gradient-accumulation loops
    call ``disable_allreduce()`` on the micro-batches that must not communicate. ampinit's class had neither
    method (AttributeError).

    One process shows the difference through Apex's reduction rule: with ``gradient_average=False`` and
    ``gradient_predivide_factor=2`` a reduced gradient is the local one divided by 2; a gradient that is not
    reduced is the local one."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ddp = DistributedDataParallel(model, gradient_average=False, gradient_predivide_factor=2.0)
    x = torch.randn(4, 3)
    local = torch.autograd.grad(model(x).sum(), model.weight)[0]

    ddp.disable_allreduce()
    ddp(x).sum().backward()
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.grad, local)

    model.weight.grad = None
    ddp.enable_allreduce()
    ddp(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, local / 2)


def test_apex_c_unflatten_accepts_a_padded_buffer() -> None:
    """Apex's ``apex_C.unflatten(flat, tensors)`` is ``torch::utils::unflatten_dense_tensors`` (csrc/
    flatten_unflatten.cpp), which narrows ``flat`` tensor by tensor: a flat buffer longer than the tensors (padded
    to an alignment, as contiguous gradient buffers are) gives views of its leading elements. ampinit raised
    ValueError unless the sizes were equal. Expected values: torch's own C++ function."""
    tensors = [torch.zeros(2, 3), torch.zeros(4)]
    padded = torch.arange(16.0)
    views = apex_C.unflatten(padded, tensors)
    expected = torch._C._nn.unflatten_dense_tensors(padded, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    for view, want in zip(views, expected):
        assert torch.equal(view, want)
    views[1].fill_(-1.0)  # views, not copies
    assert torch.equal(padded[6:10], torch.full((4,), -1.0))


def test_flat_master_of_a_network_to_half_model_with_batchnorm() -> None:
    """Apex's ``prep_param_lists(model, flat_master=True)`` is ``_flatten_dense_tensors([p.data for p in
    model_params]).float()``; it re-raises only if the flattening fails, and on torch >= 1.5 ``torch.cat`` promotes
    mixed dtypes, so a ``network_to_half`` model (half Linear, fp32 BatchNorm) gets one float32 flat master, and
    ``model_grads_to_master_grads`` / ``master_params_to_model_params`` work on it. ampinit raised TypeError."""
    torch.manual_seed(0)
    model = network_to_half(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    model_params, (flat,) = prep_param_lists(model, flat_master=True)
    assert {p.dtype for p in model_params} == {torch.float16, torch.float32}
    assert flat.dtype == torch.float32 and flat.numel() == 12 + 4 + 4 + 4 and flat.grad is not None
    torch.testing.assert_close(flat.detach(), torch.cat([p.detach().float().reshape(-1) for p in model_params]))
    model(torch.randn(5, 3)).float().sum().backward()
    model_grads_to_master_grads(model_params, [flat], flat_master=True)
    assert flat.grad is not None
    torch.testing.assert_close(flat.grad, torch.cat([p.grad.float().reshape(-1) for p in model_params]))  # type: ignore[union-attr]
    with torch.no_grad():
        flat.add_(1.0)
    master_params_to_model_params(model_params, [flat], flat_master=True)
    offset = 0
    for p in model_params:
        n = p.numel()
        assert torch.equal(p, flat[offset : offset + n].view_as(p).to(p.dtype))
        offset += n
