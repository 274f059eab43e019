"""``cast_policy="auto"``, ``initialize``'s default: Apex's lists less the entries measured to change no result on a
device (``ampinit._casting.lists.UNCHANGED``), while the Apex API keeps Apex's exact lists.

Where a device has no measurement (the CPU) the default must register exactly what ``"apex"`` does. To see an entry
left out on the CPU, the tests put ``gelu`` in the CPU's measured set, and compare against plain ``torch.autocast``
(native behaviour: gelu in the input's half dtype) and Apex's rule (gelu in fp32).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampinit
from ampinit._casting import kernels as cast_kernels
from ampinit._casting import lists as cast_lists
from ampinit.compat.apex import amp as apex_amp
from ampinit.compat.apex.amp.amp import cast_devices
from ampinit.compat.apex.amp.lists import functional_overrides
from tests._device import device_under_test

GELU = "aten.gelu.default"
LEVEL_DTYPES = [pytest.param("O1", torch.float16, id="O1-fp16"), pytest.param("O4", torch.bfloat16, id="O4-bf16")]


def autocast_key(device_type: str) -> str:
    return cast_kernels.AUTOCAST_KEYS[device_type]


def has_kernel(op: torch._ops.OpOverload, device_type: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), autocast_key(device_type))


def leave_out(monkeypatch: pytest.MonkeyPatch, device_type: str, dtype: torch.dtype, *names: str) -> None:
    """Pretend ``names`` were measured to change nothing on ``device_type`` at ``dtype``."""
    monkeypatch.setattr(cast_lists, "UNCHANGED", {(device_type, dtype): frozenset(names)})


@pytest.fixture
def closing() -> Iterator[list[ampinit.AmpSession]]:
    """Sessions a test opens, closed in reverse order whatever happens."""
    sessions: list[ampinit.AmpSession] = []
    yield sessions
    for session in reversed(sessions):
        session.close()


def open_session(
    sessions: list[ampinit.AmpSession], model: nn.Module, level: str, **options: object
) -> ampinit.AmpSession:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ampinit.initialize(model, optimizer, opt_level=level, verbosity=0, **options)  # type: ignore[call-overload]
    session = ampinit.session_of(model)
    assert session is not None
    sessions.append(session)
    return session


def registered_overloads(device_type: str) -> set[str]:
    """Which overloads of ``"apex"``'s plan have a kernel on the device's autocast key right now."""
    return {str(op) for op in cast_lists.plan(autocast_key(device_type)) if has_kernel(op, device_type)}


# -- the default --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("level", "dtype"), LEVEL_DTYPES)
def test_default_is_auto_and_registers_what_apex_does_on_the_cpu(
    level: str, dtype: torch.dtype, closing: list[ampinit.AmpSession]
) -> None:
    """No measurement for the CPU: its native lists lack softmax, layer_norm, ..., so every Apex entry stays."""
    session = open_session(closing, nn.Linear(4, 4), level)
    assert session.options.cast_policy == "auto"
    by_default = registered_overloads("cpu")
    closing.pop().close()
    open_session(closing, nn.Linear(4, 4), level, cast_policy="apex")
    assert by_default == registered_overloads("cpu") == {str(op) for op in cast_lists.plan("AutocastCPU")}
    h = torch.randn(3, 4).to(dtype)
    assert F.gelu(h).dtype == torch.float32 and torch.softmax(h, -1).dtype == torch.float32  # Apex's fp32 list


def test_measured_set_names_overloads_that_apex_registers_on_cuda() -> None:
    """The data names real overloads of the CUDA plan (a misspelt or renamed one would silently stay registered):
    the 10 measured on the H100, the same at bf16 and fp16, and no interpolation whose CUDA backward accumulates
    in the half dtype (every mode but nearest: atomic adds in the gradient's dtype, where Apex's fp32 op sums in
    fp32)."""
    cuda_plan = {str(op) for op in cast_lists.plan("AutocastCUDA")}
    bf16, fp16 = cast_lists.unchanged("cuda", torch.bfloat16), cast_lists.unchanged("cuda", torch.float16)
    assert len(bf16) == 10 and bf16 <= cuda_plan and GELU in bf16 and bf16 == fp16
    interpolations = {name for name in cuda_plan if "upsample" in name}
    assert {name for name in interpolations if "nearest" not in name} <= cuda_plan - bf16  # kept by "auto"
    assert {name for name in bf16 if "upsample" in name} == {
        "aten.upsample_nearest1d.vec", "aten.upsample_nearest2d.vec", "aten.upsample_nearest3d.vec",
        "aten._upsample_nearest_exact2d.vec",
    }  # fmt: skip
    assert cast_lists.unchanged("cpu", torch.bfloat16) == cast_lists.unchanged("cpu", torch.float16) == frozenset()


# -- an entry left out is native autocast's, a kept one Apex's -------------------------------------------------------
class GeluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


def _gelu_net() -> tuple[GeluNet, torch.Tensor]:
    device = device_under_test()
    torch.manual_seed(0)
    return GeluNet().to(device), torch.randn(4, 8, device=device)


def test_left_out_entry_runs_as_native_autocast(
    monkeypatch: pytest.MonkeyPatch, closing: list[ampinit.AmpSession]
) -> None:
    model, x = _gelu_net()
    device_type = x.device.type
    reference = copy.deepcopy(model)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        expected = reference(x)
    expected.float().sum().backward()
    leave_out(monkeypatch, device_type, torch.bfloat16, GELU)

    open_session(closing, model, "O4")
    assert not has_kernel(torch.ops.aten.gelu.default, device_type)
    assert has_kernel(torch.ops.aten.softmax.int, device_type) or device_type == "cuda"  # the rest stays
    out = model(x)
    out.float().sum().backward()
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    assert reference.fc.weight.grad is not None and torch.equal(model.fc.weight.grad, reference.fc.weight.grad)  # type: ignore[arg-type]


def test_apex_keeps_the_left_out_entry_in_fp32(
    monkeypatch: pytest.MonkeyPatch, closing: list[ampinit.AmpSession]
) -> None:
    model, x = _gelu_net()
    with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16):
        expected = F.gelu(model.fc(x).float())  # Apex's rule: the linear in bf16, gelu in fp32
    leave_out(monkeypatch, x.device.type, torch.bfloat16, GELU)
    open_session(closing, model, "O4", cast_policy="apex")
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_an_entry_whose_policy_the_user_edited_keeps_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement is of Apex's own entries: gelu moved to ``FP16_FUNCS`` (an edit of ``apex.amp.lists``)
    is cast to bf16 as the edit says, although gelu in fp32 was measured to change nothing."""
    saved = list(functional_overrides.FP16_FUNCS)
    functional_overrides.FP16_FUNCS.append("gelu")
    try:
        leave_out(monkeypatch, "cpu", torch.bfloat16, GELU)
        model = nn.Linear(2, 2)
        ampinit.initialize(model, opt_level="O4", verbosity=0)
        try:
            x = torch.randn(3, 4)
            out = F.gelu(x)
        finally:
            ampinit.deinitialize()
    finally:
        functional_overrides.FP16_FUNCS = saved
    assert out.dtype == torch.bfloat16 and torch.equal(out, F.gelu(x.bfloat16()))


# -- the Apex API keeps Apex's exact lists ----------------------------------------------------------------------------
def test_apex_initialize_uses_apexs_exact_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _gelu_net()
    leave_out(monkeypatch, x.device.type, torch.bfloat16, GELU)
    apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O4", verbosity=0)
    try:
        session = ampinit.session_of(model)
        assert session is not None and session.options.cast_policy == "apex"
        assert F.gelu(x.bfloat16()).dtype == torch.float32
    finally:
        ampinit.deinitialize()


def test_old_amp_init_uses_apexs_exact_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    device_type = cast_devices()[0]
    leave_out(monkeypatch, device_type, torch.float16, GELU)
    handle = apex_amp.init()
    try:
        session = ampinit.current_session()
        assert session is not None and session.options.cast_policy == "apex"
        assert F.gelu(torch.randn(3, 4, device=device_type).half()).dtype == torch.float32
    finally:
        handle._deactivate()


# -- sessions sharing a device's kernels must agree on them -------------------------------------------------------
@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(("O4", "apex"), ("O4", "auto"), id="apex-then-auto"),
        pytest.param(("O4", "auto"), ("O4", "apex"), id="auto-then-apex"),
        pytest.param(("O4", "auto"), ("O1", "auto"), id="bf16-then-fp16"),
    ],
)
def test_sessions_with_different_sets_are_refused_and_the_first_keeps_working(
    first: tuple[str, str], second: tuple[str, str], monkeypatch: pytest.MonkeyPatch, closing: list[ampinit.AmpSession]
) -> None:
    leave_out(monkeypatch, "cpu", torch.bfloat16, GELU)
    first_level, first_policy = first
    open_session(closing, nn.Linear(4, 4), first_level, cast_policy=first_policy)
    gelu_before = F.gelu(torch.randn(3, 4).bfloat16()).dtype
    autocast_before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    second_model = nn.Linear(4, 4)
    second_level, second_policy = second
    second_dtype = "torch.bfloat16" if second_level == "O4" else "torch.float16"
    message = (
        f"An O1/O4 session with cast_policy={second_policy!r} ({second_dtype}) cannot open on 'cpu' while one with "
        f"cast_policy={first_policy!r} (torch.bfloat16) is open there: they register different sets of Apex's "
        f"kernels (differing: {GELU})"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        open_session(closing, second_model, second_level, cast_policy=second_policy)
    assert ampinit.session_of(second_model) is None and ampinit.current_session() is closing[0]
    assert cast_kernels.KERNELS.registered() == {"cpu": 1}
    assert not second_model._forward_pre_hooks and not second_model._forward_hooks
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == autocast_before
    assert F.gelu(torch.randn(3, 4).bfloat16()).dtype == gelu_before
    assert gelu_before == (torch.float32 if first_policy == "apex" else torch.bfloat16)


def test_apex_and_auto_share_the_cpus_kernels_when_nothing_is_left_out(closing: list[ampinit.AmpSession]) -> None:
    open_session(closing, nn.Linear(4, 4), "O4", cast_policy="apex")
    open_session(closing, nn.Linear(4, 4), "O1", cast_policy="auto")
    assert cast_kernels.KERNELS.registered() == {"cpu": 2}
