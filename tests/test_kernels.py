"""ampinit._kernels: the one grouping rule, the engine's multi-tensor ops against plain torch, and the boundary
itself (no other module names a private torch kernel)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ampinit import _kernels

PACKAGE = Path(_kernels.__file__).resolve().parent
PRIVATE_PREFIXES = ("_foreach_", "_fused_", "_amp_")

# Call sites in modules owned by other branches, to be rerouted to the named _kernels function when they merge.
# When this set is empty the boundary holds without exception.
NOT_YET_REROUTED: set[tuple[str, str]] = set()


def private_kernel_uses() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_kernels.py":
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
        assert hasattr(_kernels, name.lstrip("_")), f"_kernels offers no {name.lstrip('_')} to reroute {name} to"


def test_group_indices_keys_by_device_and_the_dtypes_at_each_position() -> None:
    a = [torch.zeros(1), torch.zeros(1, dtype=torch.float16), torch.zeros(2), torch.zeros(1)]
    b = [torch.zeros(1), torch.zeros(1), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1)]
    cpu = torch.device("cpu")
    assert _kernels.group_indices([a, b]) == {
        (cpu, (torch.float32, torch.float32)): [0, 3],
        (cpu, (torch.float16, torch.float32)): [1],
        (cpu, (torch.float32, torch.bfloat16)): [2],
    }
    assert _kernels.grouped([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_and_check_matches_its_plain_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, generator=gen).to(dtype), torch.randn(3, 4, generator=gen).to(torch.float32)]
    expected = [g.float() * 0.125 for g in grads]
    found = torch.zeros(1)
    _kernels.unscale_and_check_(grads, found, torch.tensor(0.125))
    assert found.item() == 0.0
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.float(), e.to(g.dtype).float(), rtol=0, atol=0)
    grads[1][2, 1] = float("nan")
    _kernels.unscale_and_check_(grads, found, torch.tensor(1.0))
    reference_flag = torch.zeros(1)
    _kernels._unscale_and_check_reference([g.clone() for g in grads], reference_flag, torch.ones(1))
    assert found.item() == reference_flag.item() == 1.0
    _kernels.unscale_and_check_([grads[0]], found, torch.tensor(1.0))
    assert found.item() == 1.0  # raised, never cleared


def test_update_scale_is_gradscalers_rule() -> None:
    scale, tracker = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32)
    history = []
    for overflow in (False, False, True, False, False, False):
        _kernels.update_scale_(scale, tracker, torch.tensor([float(overflow)]), 2.0, 0.5, 2)
        history.append((scale.item(), tracker.item()))
    assert history == [(8.0, 1), (16.0, 0), (8.0, 0), (8.0, 1), (16.0, 0), (16.0, 1)]


def test_copy_add_mul_and_flatten() -> None:
    dst = [torch.zeros(3), torch.zeros(2, dtype=torch.float16)]
    src = [torch.arange(3.0), torch.tensor([1.5, -2.0])]
    _kernels.copy_(dst, src)
    _kernels.add_(dst, src)
    _kernels.mul_(dst, torch.tensor(0.5))
    assert dst[0].tolist() == [0.0, 1.0, 2.0] and dst[1].tolist() == [1.5, -2.0]
    flat = _kernels.flatten_dense_tensors(src)
    assert flat.tolist() == [0.0, 1.0, 2.0, 1.5, -2.0]
    assert [t.tolist() for t in _kernels.unflatten_dense_tensors(flat, src)] == [t.tolist() for t in src]
