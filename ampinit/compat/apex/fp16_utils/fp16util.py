"""``apex.fp16_utils.fp16util``: Apex's manual mixed-precision helpers (casting networks, master param lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ampinit import _torch_kernels

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


class tofp16(nn.Module):
    """A layer that casts its input to half."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Bring affine BatchNorm layers (recursively) back to fp32, for a model that was ``.half()``-ed."""
    if isinstance(module, _BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))``."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating params (and their grads) and buffers of ``module`` itself, not its children."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.is_floating_point():
            setattr(module, name, buffer.to(dtype))


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module except affine BatchNorm to ``dtype`` (Apex's rule for ``keep_batchnorm_fp32``)."""
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """A half-precision copy of ``network`` (affine BatchNorm kept fp32) whose forward halves its inputs."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(model_params, master_params)``: the trainable params and fp32 copies of them (one flat copy if asked)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        # Mixed dtypes (a network_to_half model keeps BatchNorm in fp32) are promoted by the flattening, as in
        # Apex on torch >= 1.5: the master is float32 either way.
        flat_data = _torch_kernels.flatten_dense_tensors([p.data for p in model_params])
        flat = nn.Parameter(flat_data.float())
        flat.grad = torch.empty_like(flat)
        return model_params, [flat]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(
    model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor], flat_master: bool = False
) -> None:
    """Copy the model's grads into the masters' grads (a master whose model param has no grad gets none)."""
    if flat_master:
        grad = master_params[0].grad
        assert grad is not None, "prep_param_lists(flat_master=True) preallocates the flat master's grad"
        grads = [p.grad for p in model_params if p.grad is not None]
        grad.copy_(_torch_kernels.flatten_dense_tensors(grads))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
        elif master.grad is None:
            master.grad = model.grad.detach().to(master.dtype).clone()
        else:
            master.grad.copy_(model.grad)


def master_params_to_model_params(
    model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor], flat_master: bool = False
) -> None:
    """Copy the (updated) masters' values into the model's params."""
    with torch.no_grad():
        if flat_master:
            values = _torch_kernels.unflatten_dense_tensors(master_params[0].data, model_params)
            for model, master in zip(model_params, values):
                model.copy_(master)
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master)


def to_python_float(t: Any) -> Any:
    """``t.item()``, or ``t[0]`` for objects without ``item``, as Apex: the value keeps its Python type (an
    integer tensor gives an ``int``, which scripts format with ``{:d}``)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]
