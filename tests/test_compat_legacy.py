"""What real Apex-era code imports besides ``amp``, provided by ampinit's Apex layer: ``apex.normalization``,
``apex_C``, ``apex.parallel.distributed.flat_dist_call``, ``apex.optimizers.FP16_Optimizer`` (its older home), and
``delay_allreduce=True`` honoured as ``find_unused_parameters=True``. Each is checked against torch's own modules or
a plain re-implementation, and reached through the ``import apex`` alias that ``ampinit run`` installs."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ampinit.compat import apex as compat
from ampinit.compat.apex import apex_C
from ampinit.compat.apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, dims: int, eps: float) -> torch.Tensor:
    axes = tuple(range(-dims, 0))
    out = x.double() / torch.sqrt(x.double().pow(2).mean(axes, keepdim=True) + eps)
    return out if weight is None else out * weight.double()


@pytest.fixture
def alias() -> Iterator[None]:
    compat.install()
    try:
        yield
    finally:
        compat.uninstall()


@pytest.mark.parametrize("shape", [8, [4, 8], torch.Size([4, 8])])
@pytest.mark.parametrize("affine", [True, False])
def test_fused_layer_norm_matches_torch_layer_norm(shape: object, affine: bool) -> None:
    torch.manual_seed(0)
    ours = FusedLayerNorm(shape, eps=1e-6, elementwise_affine=affine)  # type: ignore[arg-type]
    reference = nn.LayerNorm(shape, eps=1e-6, elementwise_affine=affine)  # type: ignore[arg-type]
    assert ours.state_dict().keys() == reference.state_dict().keys()
    if affine:
        with torch.no_grad():
            reference.weight.normal_()
            reference.bias.normal_()
        ours.load_state_dict(reference.state_dict())
    x = torch.randn(3, 4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(ours(x), reference(x_ref))
    ours(x).square().sum().backward()
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    if affine:
        torch.testing.assert_close(ours.weight.grad, reference.weight.grad)  # type: ignore[union-attr]


@pytest.mark.parametrize("affine", [True, False])
def test_fused_rms_norm_matches_a_plain_rms_norm(affine: bool) -> None:
    torch.manual_seed(0)
    norm = FusedRMSNorm([4, 8], elementwise_affine=affine)
    assert norm.eps == 1e-5  # Apex's default
    if affine:
        with torch.no_grad():
            norm.weight.normal_()  # type: ignore[union-attr]
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(norm(x), _plain_rms_norm(x, norm.weight, 2, 1e-5).float())


def test_output_dtypes_follow_apex_fused_input_mixed_weight() -> None:
    x = torch.randn(2, 8).bfloat16()
    fused, mixed = FusedLayerNorm(8), MixedFusedLayerNorm(8)
    rms, mixed_rms = FusedRMSNorm(8), MixedFusedRMSNorm(8)
    assert fused(x).dtype == torch.bfloat16 and rms(x).dtype == torch.bfloat16
    assert mixed(x).dtype == torch.float32 and mixed_rms(x).dtype == torch.float32  # the fp32 weights' dtype
    # statistics in fp32, as Apex's kernels compute them: the mixed output is the fp32 norm of the bf16 input
    torch.testing.assert_close(mixed(x), nn.functional.layer_norm(x.float(), (8,)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused(torch.randn(2, 8)).dtype == torch.bfloat16  # Apex casts its inputs to the autocast dtype


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_float64_norms_compute_in_float64_as_apex_kernels_and_torch_do(cls: type[nn.Module]) -> None:
    """Apex's kernels accumulate in ``acc_type<double>`` = double, and its autocast cast leaves float64 alone."""
    torch.manual_seed(0)
    norm = cls(16).double()
    with torch.no_grad():
        norm.weight.normal_()  # type: ignore[operator]
    reference = (nn.LayerNorm if "Layer" in cls.__name__ else nn.RMSNorm)(16, eps=1e-5).double()
    reference.load_state_dict(norm.state_dict())
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    out = norm(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(x), rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradcheck(norm, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x).dtype == torch.float64


def test_mixed_variants_keep_apex_constructor_rules() -> None:
    with pytest.raises(RuntimeError, match="does not support elementwise_affine=False"):
        MixedFusedLayerNorm(8, elementwise_affine=False)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bias'\]"):
        MixedFusedRMSNorm(8, bias=False)
    with pytest.warns(UserWarning, match="always True"):
        MixedFusedRMSNorm(8, elementwise_affine=True)
    with pytest.raises(TypeError, match=r"a sequence of ints or a torch\.Size, got str"):
        FusedLayerNorm("8")  # type: ignore[arg-type]
    assert FusedLayerNorm(8, memory_efficient=True).memory_efficient


def test_apex_c_flattens_like_torch() -> None:
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    flat = compat.apex_C.flatten(tensors)
    torch.testing.assert_close(flat, torch.cat([t.reshape(-1) for t in tensors]))
    for back, original in zip(compat.apex_C.unflatten(flat, tensors), tensors):
        torch.testing.assert_close(back, original)
    with pytest.raises(ValueError, match="flat has 3 elements but the tensors hold 12"):
        compat.apex_C.unflatten(torch.zeros(3), tensors)


def test_legacy_names_resolve_through_the_import_alias(alias: None) -> None:
    normalization = importlib.import_module("apex.normalization")
    fused_layer_norm = importlib.import_module("apex.normalization.fused_layer_norm")
    assert normalization.FusedLayerNorm is fused_layer_norm.FusedLayerNorm is FusedLayerNorm
    assert importlib.import_module("apex_C").flatten is compat.apex_C.flatten
    with pytest.warns(FutureWarning, match="2018-12..2019-10"):
        assert importlib.import_module("apex.optimizers").FP16_Optimizer is compat.fp16_utils.FP16_Optimizer
    assert importlib.import_module("apex.parallel.distributed").flat_dist_call is not None
    from amp_C import multi_tensor_l2norm  # type: ignore[import-not-found]

    assert multi_tensor_l2norm is compat.amp_C.multi_tensor_l2norm


def test_flat_dist_call_runs_one_call_per_dtype_and_copies_back(gloo_group: None) -> None:
    import torch.distributed as dist

    from ampinit.compat.apex.parallel.distributed import flat_dist_call

    tensors = [torch.ones(2, 2), torch.full((3,), 2.0), torch.ones(2, dtype=torch.float64)]
    seen: list[tuple[torch.dtype, int]] = []

    def double(flat: torch.Tensor, factor: float) -> None:
        seen.append((flat.dtype, flat.numel()))
        flat.mul_(factor)

    flat_dist_call(tensors, double, (2.0,))
    assert seen == [(torch.float32, 7), (torch.float64, 2)]
    torch.testing.assert_close(tensors[1], torch.full((3,), 4.0))
    flat_dist_call(tensors, dist.all_reduce)  # world size 1: the average is the tensor itself
    torch.testing.assert_close(tensors[0], torch.full((2, 2), 2.0))


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 1)
        self.unused = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_delay_allreduce_is_find_unused_parameters(gloo_group: None) -> None:
    """Apex users set delay_allreduce=True for models with parameters that get no gradient; torch's DDP fails on
    the second iteration of such a model unless find_unused_parameters=True."""
    ddp = compat.parallel.DistributedDataParallel(_WithUnused(), delay_allreduce=True)
    for _ in range(2):
        ddp(torch.randn(4, 3)).sum().backward()
    assert ddp.module.unused.weight.grad is None
    plain = compat.parallel.DistributedDataParallel(_WithUnused())
    plain(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"unused parameters|did not receive grad|finished reduction"):
        plain(torch.randn(4, 3)).sum().backward()


def test_functional_forms_match_torch() -> None:
    from ampinit.compat.apex.normalization import fused_layer_norm as module

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    expected = nn.functional.layer_norm(x, (8,), w, b, 1e-6)
    torch.testing.assert_close(module.fused_layer_norm_affine(x, w, b, (8,), 1e-6), expected)
    torch.testing.assert_close(module.FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-6), expected)
    torch.testing.assert_close(module.fused_layer_norm(x, 8), nn.functional.layer_norm(x, (8,), eps=1e-6))
    torch.testing.assert_close(module.fused_rms_norm_affine(x, w, [8]), _plain_rms_norm(x, w, 1, 1e-6).float())
    torch.testing.assert_close(module.fused_rms_norm(x, [8]), _plain_rms_norm(x, None, 1, 1e-6).float())
    half_x = x.bfloat16()
    assert module.mixed_dtype_fused_layer_norm_affine(half_x, w, b, (8,)).dtype == torch.float32
    assert module.mixed_dtype_fused_rms_norm_affine(half_x, w, (8,)).dtype == torch.float32


def test_apex_c_unflatten_accepts_a_padded_buffer() -> None:
    """Apex's ``apex_C.unflatten(flat, tensors)`` is ``torch::utils::unflatten_dense_tensors`` (csrc/
    flatten_unflatten.cpp), which narrows ``flat`` tensor by tensor: a flat buffer longer than the tensors (padded
    to an alignment, as contiguous gradient buffers are) gives views of its leading elements. ampinit raised
    ValueError unless the sizes were equal. Expected values: torch's own C++ function.

    Found by: the review of the Apex compatibility layer.
    """
    tensors = [torch.zeros(2, 3), torch.zeros(4)]
    padded = torch.arange(16.0)
    views = apex_C.unflatten(padded, tensors)
    expected = torch._C._nn.unflatten_dense_tensors(padded, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    for view, want in zip(views, expected):
        assert torch.equal(view, want)
    views[1].fill_(-1.0)  # views, not copies
    assert torch.equal(padded[6:10], torch.full((4,), -1.0))
