"""Apex's O1 tensor rules under the Apex API: ``.cpu()`` of a half tensor gives float32, and the in-place forms of
Apex's fp32 functions refuse fp16 tensors with Apex's ``NotImplementedError``.

The reference is Apex's rule as its source states it (shared/reference/apex-amp.md §3.2 steps 1, 3 and 3.5; the
names below are the in-place forms of its default ``torch_overrides``/``tensor_overrides.FP32_FUNCS`` that torch
has, written out here), not the library's own list. The native ``ampinit`` API keeps autocast's behaviour.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import ampinit
from ampinit.compat.apex import amp as apex_amp
from ampinit.compat.apex.amp.amp import cast_devices
from ampinit.compat.apex.amp.lists import tensor_overrides, torch_overrides

ROOT = Path(__file__).resolve().parent.parent

# Apex step 3.5 (``err_if_arg0_half`` on ``torch.Tensor``): with the arguments that make each call valid.
REFUSED_METHODS: dict[str, tuple[object, ...]] = {
    "acos_": (),
    "asin_": (),
    "cosh_": (),
    "erfinv_": (),
    "exp_": (),
    "expm1_": (),
    "log_": (),
    "log10_": (),
    "log2_": (),
    "reciprocal_": (),
    "rsqrt_": (),
    "sinh_": (),
    "tan_": (),
    "pow_": (2,),
    "cumprod_": (0,),
    "cumsum_": (0,),
    "renorm_": (2, 0, 1.0),
}
# Apex step 3 (``err_if_any_half`` on ``torch``): the ``torch.<name>_`` functions that exist.
REFUSED_FUNCTIONS = ("acos_", "asin_", "cosh_", "exp_", "expm1_", "log_", "log10_", "log2_", "reciprocal_", "rsqrt_",
                     "sinh_", "tan_")  # fmt: skip
# In-place methods on no fp32 list: Apex matched their other arguments to self (step 4) and never refused them.
ALLOWED_METHODS: dict[str, tuple[object, ...]] = {"add_": (1.0,), "mul_": (2.0,), "sqrt_": (), "sigmoid_": ()}


def values(dtype: torch.dtype) -> torch.Tensor:
    """A 2x3 tensor in (0.1, 0.9), where every function above is defined."""
    return torch.linspace(0.1, 0.9, 6).reshape(2, 3).to(dtype)


@pytest.fixture
def apex_o1() -> Iterator[nn.Module]:
    model = nn.Linear(3, 3)
    apex_amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
    try:
        yield model
    finally:
        ampinit.deinitialize()


@pytest.fixture
def native_o1() -> Iterator[nn.Module]:
    model = nn.Linear(3, 3)
    ampinit.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
    try:
        yield model
    finally:
        ampinit.deinitialize()


def method_message(name: str) -> str:
    return re.escape(f"Cannot call in-place method {name} on fp16 Tensors.")


def function_message(name: str) -> str:
    return re.escape(f"Cannot call in-place function {name} with fp16 arguments.")


# -- .cpu() ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_of_a_half_tensor_gives_float32_under_the_apex_api(apex_o1: nn.Module, dtype: torch.dtype) -> None:
    """``out.cpu().numpy()`` in code written for Apex gets fp32 values, as Apex's ``cpu`` patch gave them."""
    x = values(dtype)
    moved = x.cpu()
    assert moved.dtype == torch.float32
    assert torch.equal(moved, x.to(torch.float32))
    output = apex_o1(values(torch.float32))
    assert output.dtype == torch.float16  # O1 casts no output: the model's half output is what gets moved
    assert output.cpu().dtype == torch.float32


def test_cpu_keeps_the_graph_and_leaves_fp32_and_fp64_alone(apex_o1: nn.Module) -> None:
    """The cast is differentiable, as Apex's ``x.float()`` was; fp32 tensors are not copied, and fp64 stays fp64
    (Apex's ``maybe_float`` narrowed it to fp32, a loss nobody depends on: docs/migration.md)."""
    leaf = values(torch.float16).requires_grad_()
    leaf.cpu().sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.grad, torch.ones_like(leaf))
    fp32 = values(torch.float32)
    assert fp32.cpu() is fp32
    assert values(torch.float64).cpu().dtype == torch.float64


def test_cpu_inside_disable_casts_keeps_the_dtype_as_in_apex(apex_o1: nn.Module) -> None:
    """Apex's cast wrappers called the original while ``disable_casts()`` was active; a body that raises leaves
    the rule on again afterwards."""
    with apex_amp.disable_casts():
        assert values(torch.float16).cpu().dtype == torch.float16
    assert values(torch.float16).cpu().dtype == torch.float32
    with pytest.raises(ValueError, match="body"), apex_amp.disable_casts():
        raise ValueError("body")
    assert values(torch.float16).cpu().dtype == torch.float32


def test_cpu_in_a_model_forward_in_another_thread_follows_the_apex_api() -> None:
    """The rules go where the session's casts go: a model forward in a serving thread too."""
    seen: list[torch.dtype] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.half().cpu().dtype)
            return x

    model = nn.Sequential(nn.Linear(3, 3), Probe())
    apex_amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
    try:
        worker = threading.Thread(target=model, args=(values(torch.float32),))
        worker.start()
        worker.join()
    finally:
        ampinit.deinitialize()
    assert seen == [torch.float32]


# -- in-place refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(REFUSED_METHODS))
def test_in_place_fp32_methods_refuse_fp16_tensors_as_apex_did(apex_o1: nn.Module, name: str) -> None:
    half = values(torch.float16)
    with pytest.raises(NotImplementedError, match=method_message(name)):
        getattr(half, name)(*REFUSED_METHODS[name])
    assert torch.equal(half, values(torch.float16))  # refused before anything was written
    # fp32 tensors run as in torch (Apex cast the other arguments to float, which changes no value here)
    fp32, expected = values(torch.float32), values(torch.float32)
    getattr(fp32, name)(*REFUSED_METHODS[name])
    with ampinit.disable_casts():
        getattr(torch.Tensor, name)(expected, *REFUSED_METHODS[name])
    torch.testing.assert_close(fp32, expected, equal_nan=True)


@pytest.mark.parametrize("name", REFUSED_FUNCTIONS)
def test_in_place_fp32_torch_functions_refuse_fp16_arguments_as_apex_did(apex_o1: nn.Module, name: str) -> None:
    with pytest.raises(NotImplementedError, match=function_message(name)):
        getattr(torch, name)(values(torch.float16))
    fp32 = values(torch.float32)
    assert getattr(torch, name)(fp32) is fp32


def test_refusals_hold_inside_disable_casts_and_for_bf16_not(apex_o1: nn.Module) -> None:
    """Apex's ``err_if_*`` wrappers ignored ``disable_casts()`` and looked for ``HalfTensor`` (fp16) only."""
    with apex_amp.disable_casts(), pytest.raises(NotImplementedError, match=method_message("exp_")):
        values(torch.float16).exp_()
    bf16 = values(torch.bfloat16)
    assert bf16.exp_().dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(ALLOWED_METHODS))
def test_in_place_methods_on_no_fp32_list_stay_allowed(apex_o1: nn.Module, name: str) -> None:
    half = values(torch.float16)
    assert getattr(half, name)(*ALLOWED_METHODS[name]).dtype == torch.float16


# -- where the rules do not apply --------------------------------------------------------------------------------
def test_the_native_api_keeps_autocasts_behaviour(native_o1: nn.Module) -> None:
    """``ampinit.initialize`` (not the Apex aliases): ``.cpu()`` is a copy and in-place ops keep the dtype."""
    assert values(torch.float16).cpu().dtype == torch.float16
    assert native_o1(values(torch.float32)).cpu().dtype == torch.float16
    assert values(torch.float16).exp_().dtype == torch.float16
    assert torch.exp_(values(torch.float16)).dtype == torch.float16


@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O4"])
def test_levels_without_fp16_function_casts_have_no_tensor_rules(level: str) -> None:
    """The rules were part of Apex's O1 patching; O4's casts are bf16, which Apex's rules never named."""
    model = nn.Linear(3, 3)
    apex_amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level=level, verbosity=0)
    try:
        assert values(torch.float16).cpu().dtype == torch.float16
        assert values(torch.float16).exp_().dtype == torch.float16
    finally:
        ampinit.deinitialize()


# -- the old API and edited lists --------------------------------------------------------------------------------
def test_the_old_init_api_follows_the_rules_until_deactivate() -> None:
    cpu, exp_ = torch.Tensor.cpu, torch.Tensor.exp_
    handle = apex_amp.init()
    try:
        # on the device amp.init() casts (CUDA where there is one, as Apex); the refusals hold on any device
        assert values(torch.float16).to(cast_devices()[0]).cpu().dtype == torch.float32
        with pytest.raises(NotImplementedError, match=method_message("log_")):
            values(torch.float16).log_()
    finally:
        handle._deactivate()
    assert torch.Tensor.cpu is cpu and torch.Tensor.exp_ is exp_
    assert values(torch.float16).cpu().dtype == torch.float16


@pytest.fixture
def edited_lists() -> Iterator[None]:
    """Apex read its lists at ``init``: code that removed or added a name changed what was patched."""
    saved = (list(tensor_overrides.FP32_FUNCS), list(torch_overrides.FP32_FUNCS))
    tensor_overrides.FP32_FUNCS.remove("cpu")
    tensor_overrides.FP32_FUNCS.remove("exp")
    torch_overrides.FP32_FUNCS.append("sigmoid")
    try:
        yield
    finally:
        tensor_overrides.FP32_FUNCS[:], torch_overrides.FP32_FUNCS[:] = saved


def test_edited_lists_decide_which_functions_follow_the_rules(edited_lists: None) -> None:
    model = nn.Linear(3, 3)
    apex_amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
    try:
        assert values(torch.float16).cpu().dtype == torch.float16  # "cpu" removed
        assert values(torch.float16).exp_().dtype == torch.float16  # "exp" removed from tensor_overrides only
        with pytest.raises(NotImplementedError, match=function_message("exp_")):
            torch.exp_(values(torch.float16))  # still on torch_overrides
        # "sigmoid" added to torch_overrides: torch.sigmoid_ is refused; Tensor.sigmoid_ is not (Apex built
        # tensor_overrides from torch_overrides once, at import)
        with pytest.raises(NotImplementedError, match=function_message("sigmoid_")):
            torch.sigmoid_(values(torch.float16))
        assert values(torch.float16).sigmoid_().dtype == torch.float16
    finally:
        ampinit.deinitialize()


# -- reversible --------------------------------------------------------------------------------------------------
def test_sessions_close_in_any_order_and_the_last_close_restores_torch() -> None:
    originals = {name: getattr(torch.Tensor, name) for name in ("cpu", *REFUSED_METHODS)}
    exp_ = torch.exp_
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    apex_amp.initialize(first, torch.optim.SGD(first.parameters(), 0.1), opt_level="O1", verbosity=0)
    apex_amp.initialize(second, torch.optim.SGD(second.parameters(), 0.1), opt_level="O1", verbosity=0)
    try:
        first_session = ampinit.session_of(first)
        assert first_session is not None
        first_session.close()
        assert values(torch.float16).cpu().dtype == torch.float32  # the second session still follows them
        with pytest.raises(NotImplementedError, match=method_message("exp_")):
            values(torch.float16).exp_()
    finally:
        ampinit.deinitialize()
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals
    assert torch.exp_ is exp_
    assert "cpu" not in vars(torch.Tensor)


def test_a_failure_while_following_the_rules_leaves_no_session_and_no_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampinit._casting import CastPolicy

    def broken(self: CastPolicy) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(CastPolicy, "follow_apex_tensor_rules", broken)
    model = nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match="injected"):
        apex_amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level="O1", verbosity=0)
    assert ampinit.session_of(model) is None and ampinit.current_session() is None
    assert "cpu" not in vars(torch.Tensor)
    assert not torch.is_autocast_enabled("cpu")


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "legacy.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the script's tensors are CPU tensors: keep amp.initialize on the CPU too
    return subprocess.run(
        [sys.executable, "-m", "ampinit", "run", str(path)], capture_output=True, text=True, env=env, timeout=300
    )


def test_ampinit_run_gives_legacy_scripts_the_apex_rules(tmp_path: Path) -> None:
    """A legacy script under ``ampinit run``: ``from apex import amp`` is the alias, so O1 follows Apex's rules."""
    script = (
        "import torch\nfrom torch import nn\nfrom apex import amp\n"
        "model = nn.Linear(3, 3)\n"
        "model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), 0.1), opt_level='O1', verbosity=0)\n"
        "print(model(torch.ones(2, 3)).detach().cpu().numpy().dtype)\n"
        "try:\n    torch.ones(2, dtype=torch.half).exp_()\nexcept NotImplementedError as e:\n    print(e)\n"
        "raise SystemExit(0)\n"
    )
    result = _run(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["float32", "Cannot call in-place method exp_ on fp16 Tensors."]
