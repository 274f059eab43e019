"""One master step through the pure-torch reference (``ampinit._masters.reference``) and through the Triton
kernels on a copy, compared bit for bit: shared by test_master_kernels.py (fp32 masters) and
test_remainder_masters.py (remainder masters). A step's ``state`` is a dict of tensor lists: ``weights``,
``grads``, the moments ``m`` (and ``v`` for Adam), and either ``masters`` (fp32) or ``remainders``."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from ampinit._masters import reference

#: Tensor lengths of a step's lists: one element, a partial block, one block exactly, one past it, several blocks.
SIZES = [1, 7, 1024, 1025, 3000]

State = dict[str, list[torch.Tensor]]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    view = {
        torch.float32: torch.int32,
        torch.float16: torch.int16,
        torch.bfloat16: torch.int16,
        torch.int16: torch.int16,
    }
    return torch.equal(a.view(view[a.dtype]), b.view(view[a.dtype]))


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: object = None) -> None:
    assert len(got) == len(want), what
    for x, y in zip(got, want):
        assert same_bits(x, y), (what, x, y)


def clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def masters_of(state: State) -> reference.Masters:
    """The masters ``state`` holds: remainder masters where it has ``remainders``, else fp32 ``masters`` written
    into the ``weights``."""
    if "remainders" in state:
        return reference.Masters.remainder(state["weights"], state["remainders"])
    return reference.Masters.fp32(state["masters"], state["weights"])


def call(module: ModuleType, name: str, state: State, *args: Any, **kwargs: Any) -> None:
    """``module``'s ``adam_`` or ``sgd_`` on the masters of ``state``, and its moments."""
    moments = [state[key] for key in (("m", "v") if name == "adam_" else ("m",))]
    getattr(module, name)(state["grads"], masters_of(state), *moments, *args, **kwargs)


def run_both(kernels: ModuleType, name: str, state: State, *args: Any, **kwargs: Any) -> None:
    """The reference on ``state``, the kernel on a copy: every tensor must end with the same bits."""
    copy = {key: clone(value) for key, value in state.items()}
    call(reference, name, state, *args, **kwargs)
    call(kernels, name, copy, *args, **kwargs)
    for key in state:
        assert_same(copy[key], state[key], key)


def count_launches(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...] = ("adam_", "sgd_")
) -> dict[str, int]:
    """How often amp launches each update kernel ``names`` of ``module`` (``triton_kernels``' by default; the
    interpreted kernels on CPU) from now on."""
    calls = dict.fromkeys(names, 0)
    for name in calls:
        launch = getattr(module, name)

        def counted(*args: Any, _name: str = name, _launch: Any = launch, **kwargs: Any) -> None:
            calls[_name] += 1
            _launch(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls
