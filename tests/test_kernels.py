"""ampinit._torch_kernels: the one grouping rule, the engine's multi-tensor ops against plain torch, and the boundary
itself (no other module names a private torch kernel)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ampinit import _torch_kernels

PACKAGE = Path(_torch_kernels.__file__).resolve().parent
PRIVATE_PREFIXES = ("_foreach_", "_fused_", "_amp_")

# Call sites in modules owned by other branches, to be rerouted to the named _torch_kernels function when they merge.
# When this set is empty the boundary holds without exception.
NOT_YET_REROUTED: set[tuple[str, str]] = set()


def private_kernel_uses() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_torch_kernels.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
                and node.attr.startswith(PRIVATE_PREFIXES)
            ):
                found.add((str(path.relative_to(PACKAGE)), node.attr))
    return found


def test_only_kernels_names_private_torch_kernels() -> None:
    assert private_kernel_uses() == NOT_YET_REROUTED
    for _, name in NOT_YET_REROUTED:
        assert hasattr(_torch_kernels, name.lstrip("_")), (
            f"_torch_kernels offers no {name.lstrip('_')} to reroute {name} to"
        )


def test_group_indices_keys_by_device_and_the_dtypes_at_each_position() -> None:
    a = [torch.zeros(1), torch.zeros(1, dtype=torch.float16), torch.zeros(2), torch.zeros(1)]
    b = [torch.zeros(1), torch.zeros(1), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1)]
    cpu = torch.device("cpu")
    assert _torch_kernels.group_indices([a, b]) == {
        (cpu, (torch.float32, torch.float32)): [0, 3],
        (cpu, (torch.float16, torch.float32)): [1],
        (cpu, (torch.float32, torch.bfloat16)): [2],
    }
    assert _torch_kernels.grouped([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_and_check_matches_its_plain_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, generator=gen).to(dtype), torch.randn(3, 4, generator=gen).to(torch.float32)]
    expected = [g.float() * 0.125 for g in grads]
    found = torch.zeros(1)
    _torch_kernels.unscale_and_check_(grads, found, torch.tensor(0.125))
    assert found.item() == 0.0
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.float(), e.to(g.dtype).float(), rtol=0, atol=0)
    grads[1][2, 1] = float("nan")
    _torch_kernels.unscale_and_check_(grads, found, torch.tensor(1.0))
    assert found.item() == 1.0
    _torch_kernels.unscale_and_check_([grads[0]], found, torch.tensor(1.0))
    assert found.item() == 1.0  # raised, never cleared


def test_update_scale_is_gradscalers_rule() -> None:
    scale, tracker = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32)
    history = []
    for overflow in (False, False, True, False, False, False):
        _torch_kernels.update_scale_(scale, tracker, torch.tensor([float(overflow)]), 2.0, 0.5, 2)
        history.append((scale.item(), tracker.item()))
    assert history == [(8.0, 1), (16.0, 0), (8.0, 0), (8.0, 1), (16.0, 0), (16.0, 1)]


def test_copy_add_mul_and_flatten() -> None:
    dst = [torch.zeros(3), torch.zeros(2, dtype=torch.float16)]
    src = [torch.arange(3.0), torch.tensor([1.5, -2.0])]
    _torch_kernels.copy_(dst, src)
    _torch_kernels.add_(dst, src)
    _torch_kernels.mul_(dst, torch.tensor(0.5))
    assert dst[0].tolist() == [0.0, 1.0, 2.0] and dst[1].tolist() == [1.5, -2.0]
    flat = _torch_kernels.flatten_dense_tensors(src)
    assert flat.tolist() == [0.0, 1.0, 2.0, 1.5, -2.0]
    assert [t.tolist() for t in _torch_kernels.unflatten_dense_tensors(flat, src)] == [t.tolist() for t in src]


# -- the route for a dtype the unscale kernel refuses (bf16 on CUDA) ------------------------------------------
@pytest.fixture
def without_cpu_unscale_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU treated as a device whose unscale kernel takes no dtype, so every group takes the other route."""
    table = {key: rule for key, rule in _torch_kernels.KERNEL_DTYPES.items() if key != (_torch_kernels.UNSCALE, "cpu")}
    monkeypatch.setattr(_torch_kernels, "KERNEL_DTYPES", table)


def _grads(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randn(7, generator=gen).to(dtype),
        torch.empty(0, dtype=dtype),
        torch.randn(2, 3, generator=gen).to(dtype),
    ]


@pytest.mark.usefixtures("without_cpu_unscale_kernel")
def test_the_route_without_the_kernel_multiplies_by_the_unrounded_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, ``torch._foreach_mul_`` by a 0-d float32 tensor casts it to the tensors' dtype first: 1.5391 * 1/3
    in bf16 came out 0.5156 on the H100 check, where the float32 product rounds to 0.5117 (Apex's and the unscale
    kernel's rule). Here the CPU's foreach multiply is made to cast the same way, and both routes that multiply by
    a device factor must still give the float32 product's rounding."""

    def casts_the_factor(tensors: list[torch.Tensor], factor: torch.Tensor | float) -> None:
        if isinstance(factor, torch.Tensor):
            factor = factor.to(tensors[0].dtype)
        torch._foreach_mul_(tensors, factor)

    monkeypatch.setattr(_torch_kernels, "foreach_mul_", casts_the_factor)
    expected = torch.tensor([0.51171875], dtype=torch.bfloat16)  # round-to-nearest of 1.5390625 / 3 = 0.51302...
    grads = [torch.tensor([1.5390625], dtype=torch.bfloat16)]
    _torch_kernels.unscale_and_check_(grads, torch.zeros(1), torch.tensor(1 / 3))
    assert torch.equal(grads[0], expected)
    grads = [torch.tensor([1.5390625], dtype=torch.bfloat16)]
    _torch_kernels.mul_(grads, torch.tensor(1 / 3))
    assert torch.equal(grads[0], expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.usefixtures("without_cpu_unscale_kernel")
def test_unscale_route_without_the_kernel_is_the_kernels_rule(dtype: torch.dtype, bad: float | None) -> None:
    assert not _torch_kernels.takes(_torch_kernels.UNSCALE, torch.device("cpu"), dtype)
    grads = _grads(dtype)
    if bad is not None:
        grads[2][1, 2] = bad
    # The kernel's rule, written out: flag any non-finite input, and multiply in fp32, rounding once.
    expected_flag = float(any(not torch.isfinite(g).all() for g in grads))
    expected = [(g.float() * (1 / 3)).to(dtype) for g in grads]
    found = torch.zeros(1)
    _torch_kernels.unscale_and_check_(grads, found, torch.tensor(1 / 3))
    assert found.item() == expected_flag
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)

    before = [g.clone() for g in grads]
    checked = torch.zeros(1)
    _torch_kernels.check_finite_(grads, checked, torch.ones(1))
    assert checked.item() == expected_flag
    for g, b in zip(grads, before):
        torch.testing.assert_close(g, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.usefixtures("without_cpu_unscale_kernel")
def test_mul_route_without_the_kernel_rounds_once() -> None:
    grads = _grads(torch.bfloat16)
    expected = [(g.float() * 0.1).to(torch.bfloat16) for g in grads]
    _torch_kernels.mul_(grads, torch.tensor(0.1))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_the_unscale_kernel_takes_bf16_on_cpu_and_not_on_cuda() -> None:
    # ATen's AmpKernels.cu dispatches AT_DISPATCH_FLOATING_TYPES_AND_HALF; AmpGradScalerKernels.cpp adds the
    # reduced floating types (issue 21: O5 died on its first CUDA step).
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert all(
        _torch_kernels.takes(_torch_kernels.UNSCALE, cpu, d) for d in (torch.float16, torch.bfloat16, torch.float32)
    )
    assert [
        _torch_kernels.takes(_torch_kernels.UNSCALE, cuda, d) for d in (torch.float16, torch.bfloat16, torch.float32)
    ] == [
        True,
        False,
        True,
    ]
    assert not _torch_kernels.takes(_torch_kernels.UNSCALE, torch.device("meta"), torch.float32)
