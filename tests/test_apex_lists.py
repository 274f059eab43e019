"""``apex.amp.lists``: Apex's O1 lists as module attributes that O1 honours when code edits them before initialize.

Apex's rule (shared/reference/apex-amp.md, section 3): ``init`` wraps every name of ``FP16_FUNCS`` so that its
floating arguments are cast to half, every name of ``FP32_FUNCS`` to float, and promotes ``CASTS``; a name on no
list is called as is. The expectations below are that rule, checked against the same op run on explicitly cast
inputs outside any session.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampinit as amp
import ampinit.compat.apex as compat_apex
from ampinit._casting import lists as cast_lists
from ampinit.compat.apex.amp import lists as apex_lists
from ampinit.compat.apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides

LEVELS = [pytest.param("O1", torch.float16, id="O1-fp16"), pytest.param("O4", torch.bfloat16, id="O4-bf16")]
MODULES = (functional_overrides, torch_overrides, tensor_overrides)
KINDS = ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS")


@pytest.fixture(autouse=True)
def restored_lists() -> Iterator[None]:
    """Each test edits the lists as user code would; they come back afterwards, as the leak check requires."""
    saved = {(m, k): list(getattr(m, k)) for m in MODULES for k in KINDS if hasattr(m, k)}
    try:
        yield
    finally:
        for (module, kind), names in saved.items():
            setattr(module, kind, names)


class Session:
    """An O1/O4 session for the duration of a ``with`` block."""

    def __init__(self, level: str) -> None:
        self.level = level

    def __enter__(self) -> None:
        model = nn.Linear(2, 2)
        amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=self.level, verbosity=0)

    def __exit__(self, *exc: object) -> None:
        amp.deinitialize()


def test_modules_hold_apexs_lists() -> None:
    assert functional_overrides.MODULE is torch.nn.functional
    assert torch_overrides.MODULE is torch
    assert tensor_overrides.MODULE is torch.Tensor
    # Apex's own entries (apex/amp/lists/*.py, as used on CUDA >= 9.1: bmm and friends in FP16_FUNCS).
    assert "linear" in functional_overrides.FP16_FUNCS and "softmax" in functional_overrides.FP32_FUNCS
    assert [name for name, _ in functional_overrides.BANNED_FUNCS] == ["binary_cross_entropy"]
    assert torch_overrides.SEQUENCE_CASTS == ["cat", "stack"]
    assert {"addbmm", "baddbmm", "bmm", "mm"} <= set(torch_overrides.FP16_FUNCS)
    # tensor_overrides: its own names, then the torch names that are Tensor methods, in that order.
    assert tensor_overrides.FP16_FUNCS[0] == "__matmul__"
    assert tensor_overrides.FP32_FUNCS[:4] == ["__ipow__", "__pow__", "__rpow__", "cpu"]
    assert tensor_overrides.FP32_FUNCS[4:] == [n for n in torch_overrides.FP32_FUNCS if hasattr(torch.Tensor, n)]
    assert "bilinear" in torch_overrides.CASTS and "bilinear" not in tensor_overrides.CASTS  # not a Tensor method
    assert tensor_overrides.SEQUENCE_CASTS == []
    assert not hasattr(functional_overrides, "CASTS")  # Apex promotes torch and Tensor functions only


def test_unedited_lists_are_the_engines_defaults() -> None:
    assert cast_lists.current_lists() == cast_lists.DEFAULT_LISTS


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_appending_to_fp32_funcs_runs_the_function_in_fp32(level: str, dtype: torch.dtype) -> None:
    half, original = torch.randn(8, 8).to(dtype), torch.sigmoid
    with Session(level):
        assert torch.sigmoid(half).dtype == dtype  # on no list: called as is
    torch_overrides.FP32_FUNCS.append("sigmoid")
    reference = torch.sigmoid(half.float())
    with Session(level):
        out = torch.sigmoid(half)
        assert half.sigmoid().dtype == dtype  # torch_overrides patches torch.sigmoid, not the Tensor method
    assert out.dtype == torch.float32
    assert torch.equal(out, reference)
    assert torch.sigmoid(half).dtype == dtype  # the patch ends with the session
    assert torch.sigmoid is original


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_tensor_overrides_patch_the_method(level: str, dtype: torch.dtype) -> None:
    half = torch.randn(8, 8).to(dtype)
    tensor_overrides.FP32_FUNCS.append("sigmoid")
    with Session(level):
        assert half.sigmoid().dtype == torch.float32
        assert torch.equal(half.sigmoid(), half.float().sigmoid())
    assert "sigmoid" not in vars(torch.Tensor)
    assert half.sigmoid().dtype == dtype


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_appending_to_fp16_funcs_runs_the_function_in_half(level: str, dtype: torch.dtype) -> None:
    x = torch.randn(8, 8)
    functional_overrides.FP16_FUNCS.append("relu")
    with Session(level):
        out = F.relu(x)
    assert out.dtype == dtype
    assert torch.equal(out, F.relu(x.to(dtype)))


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_removing_a_listed_op_leaves_it_uncast(level: str, dtype: torch.dtype) -> None:
    half = torch.randn(8, 8).to(dtype)
    with Session(level):
        assert F.softmax(half, -1).dtype == torch.float32  # Apex's default: FP32_FUNCS
    functional_overrides.FP32_FUNCS.remove("softmax")
    with Session(level):
        out = F.softmax(half, -1)
    assert out.dtype == dtype  # on no list now: the CPU's own autocast leaves softmax alone
    assert torch.equal(out, F.softmax(half, -1))


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_a_name_on_two_lists_follows_the_first_as_in_apex(level: str, dtype: torch.dtype) -> None:
    # Apex wraps FP16_FUNCS first and FP32_FUNCS around them: the float cast runs first, the half cast last.
    functional_overrides.FP16_FUNCS.append("gelu")
    x = torch.randn(8, 8)
    with Session(level):
        out = F.gelu(x)
    assert out.dtype == dtype
    assert torch.equal(out, F.gelu(x.to(dtype)))


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_moving_an_op_to_casts_promotes_it(level: str, dtype: torch.dtype) -> None:
    # mv: on Apex's FP16_FUNCS and on no CPU autocast list. (An op on the device's own list, e.g. mm on the CPU,
    # keeps that native cast: the lists add to autocast and cannot take its own kernels away.)
    matrix, vector = torch.randn(4, 4).to(dtype), torch.randn(4)
    with pytest.raises(RuntimeError):  # natively, mixed dtypes are refused
        torch.mv(matrix, vector)
    with Session(level):
        assert torch.mv(matrix, vector).dtype == dtype
    torch_overrides.FP16_FUNCS.remove("mv")
    tensor_overrides.FP16_FUNCS.remove("mv")
    torch_overrides.CASTS.append("mv")
    torch_overrides.CASTS.append("hypot")  # promotes natively already: listing it must change nothing
    with Session(level):
        out = torch.mv(matrix, vector)
        assert torch.hypot(matrix, vector).dtype == torch.float32
        assert torch.mv(matrix, matrix[0]).dtype == dtype  # one dtype: nothing to promote
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.mv(matrix.float(), vector))


def test_edits_while_a_session_is_open_wait_for_the_next_initialize() -> None:
    half = torch.randn(4).half()
    with Session("O1"):
        torch_overrides.FP32_FUNCS.append("sigmoid")
        assert torch.sigmoid(half).dtype == torch.float16
    with Session("O1"):
        assert torch.sigmoid(half).dtype == torch.float32


def test_a_second_session_with_other_lists_is_refused() -> None:
    functional_overrides.FP32_FUNCS.remove("softmax")
    with Session("O1"):
        functional_overrides.FP32_FUNCS.append("softmax")
        model = nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match=re.escape("apex.amp.lists differ from those of the O1/O4 session")):
            amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O4", verbosity=0)


def test_native_cast_policy_ignores_the_lists() -> None:
    half = torch.randn(4).half()
    torch_overrides.FP32_FUNCS.append("sigmoid")
    model = nn.Linear(2, 2)
    amp.initialize(model, opt_level="O1", verbosity=0, cast_policy="native")
    try:
        assert torch.sigmoid(half).dtype == torch.float16
    finally:
        amp.deinitialize()


def test_a_list_entry_that_is_not_a_name_is_refused() -> None:
    torch_overrides.FP32_FUNCS.append(torch.sigmoid)
    model = nn.Linear(2, 2)
    message = "apex.amp.lists.torch_overrides.FP32_FUNCS must hold function names (str), found <built-in"
    with pytest.raises(TypeError, match=re.escape(message)):
        amp.initialize(model, opt_level="O1", verbosity=0)


def test_importable_under_apex_names() -> None:
    was_installed = compat_apex.is_installed()
    compat_apex.install()
    try:
        import apex.amp.lists.torch_overrides as under_apex  # type: ignore[import-not-found]
        from apex.amp.lists import functional_overrides as functional  # type: ignore[import-not-found]

        assert under_apex is torch_overrides
        assert functional is functional_overrides
        assert apex_lists.torch_overrides is torch_overrides
    finally:
        if not was_installed:
            compat_apex.uninstall()
