"""The fp32-master Triton kernels (``ampinit._masters.triton_kernels``) against the pure-torch reference
(``_masters.reference``), bit for bit, on CPU through Triton's interpreter; and amp's step taking them
(``_masters.kernel_step``): the same bits as the reference step, torch's state layout, a skip on the device,
the optimizers left to torch, and the one switch. The remainder kernels are tested in test_remainder_masters.py.

Every comparison is bitwise: the kernels do the reference's fp32 operations in the same order, each rounded
(no fused multiply-add), with correctly rounded division and square root, so no ulp of slack is needed.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from ampinit._masters import reference as ref
from ampinit.optimizers import FusedAdam, FusedSGD
from tests import _triton
from tests._host_work import NoLaunch
from tests._kernels_vs_reference import SIZES, assert_same, call, clone, run_both, same_bits

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels are tested through it")


def test_interpreted_kernels_are_built_back_on_the_way_out() -> None:
    """The interpreter is for CPU tensors only: a later CUDA O2/O5 step in the same process (pytest-xdist runs many
    files in one) must find compiled kernels again, also when the body raised."""
    import ampinit._masters.triton_kernels as module

    was, flag = _triton.interpreted(module), os.environ.get(_triton.FLAG)
    with pytest.raises(ZeroDivisionError), _triton.interpreted_kernels():
        assert _triton.interpreted(module) and os.environ[_triton.FLAG] == "1"
        _ = 1 / 0
    assert _triton.interpreted(module) is was and os.environ.get(_triton.FLAG) == flag


@pytest.fixture(scope="module")
def kernels(triton_interpreter: ModuleType) -> ModuleType:
    """The shared interpreted kernels (tests/conftest.py), under the name these tests compare with ``ref``."""
    return triton_interpreter


def make(seed: int, weight_dtype: torch.dtype, grad_dtype: torch.dtype, scale: float) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=gen) for n in SIZES]
    return {
        "weights": [m.to(weight_dtype) for m in masters],
        "grads": [(torch.randn(n, generator=gen) * scale).to(grad_dtype) for n in SIZES],
        "masters": masters,
        "m": [torch.randn(n, generator=gen) * 0.1 for n in SIZES],
        "v": [torch.rand(n, generator=gen) * 0.01 for n in SIZES],
    }


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", ["half", torch.float32])
@pytest.mark.parametrize(
    ("weight_decay", "decoupled", "maximize"), [(0.0, True, False), (0.05, True, False), (0.05, False, True)]
)
def test_adam_matches_reference(
    kernels: ModuleType,
    weight_dtype: torch.dtype,
    grad_dtype: Any,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
) -> None:
    half_grads = grad_dtype == "half"
    state = make(0, weight_dtype, weight_dtype if half_grads else torch.float32, 1024.0 if half_grads else 1.0)
    inv_scale = torch.full((1,), 1 / 1024.0) if half_grads else None
    found_inf = torch.zeros(1)
    # Step counts differ per tensor (a parameter added later, or without a grad on some steps).
    steps = [torch.tensor(float(k)) for k in (1, 2, 3, 10, 1000)]
    for _ in range(3):
        for s in steps:
            s += 1
        scalars = ref.adam_step_scalars(steps, 0.9, 0.999, 1e-3)
        run_both(
            kernels,
            "adam_",
            state,
            scalars,
            ref.AdamSettings(
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=weight_decay,
                decoupled=decoupled,
                maximize=maximize,
            ),
            inv_scale=inv_scale,
            found_inf=found_inf,
        )


def test_adam_without_weights_updates_only_masters(kernels: ModuleType) -> None:
    state = make(1, torch.bfloat16, torch.float32, 1.0)
    state["weights"] = []
    scalars = ref.adam_step_scalars([torch.tensor(1.0)] * len(SIZES), 0.9, 0.999, 1e-2)
    run_both(
        kernels,
        "adam_",
        state,
        scalars,
        ref.AdamSettings(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False),
        inv_scale=None,
        found_inf=None,
    )


@pytest.mark.parametrize(
    "sizes",
    [
        [3000],  # one tensor: no search
        [0, 1025],  # an empty tensor first: the program 0 is the second tensor's
        [1025, 0, 0, 1, 2048],  # empties between, a tensor of exactly two blocks
        [1, 1024, 1025, 7, 3000, 0, 4],  # seven: the table padded to eight
        [5] * 8 + [1030, 0],  # ten tensors, the last empty, past a power of two
        [2049] * 17,  # seventeen: five halvings
    ],
)
def test_each_program_finds_its_tensor(kernels: ModuleType, sizes: list[int]) -> None:
    """Each program finds its tensor by a binary search of the tensors' first programs (``_span``): every element of
    every tensor is updated once, by its own tensor's step. Each tensor has a step count of its own, so a program that
    took a neighbour's tensor would use another step size, one that ran twice or never would leave other bits."""
    gen = torch.Generator().manual_seed(len(sizes))
    masters = [torch.randn(n, generator=gen) for n in sizes]
    state = {
        "weights": [m.bfloat16() for m in masters],
        "grads": [torch.randn(n, generator=gen).bfloat16() for n in sizes],
        "masters": masters,
        "m": [torch.randn(n, generator=gen) * 0.1 for n in sizes],
        "v": [torch.rand(n, generator=gen) * 0.01 for n in sizes],
    }
    scalars = ref.adam_step_scalars([torch.tensor(float(1 + i)) for i in range(len(sizes))], 0.9, 0.999, 1e-2)
    settings = ref.AdamSettings(
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False
    )
    run_both(kernels, "adam_", state, scalars, settings, inv_scale=None, found_inf=None)
    tables = kernels._tables_on(torch.device("cpu"), sizes)
    # One entry per tensor on the device (padded to a power of two), none per block.
    assert tables.first_blocks.numel() < 2 * len(sizes) and tables.numels.numel() == len(sizes)
    assert tables.n_blocks == sum(-(-n // kernels._BLOCK) for n in sizes)
    # And the finite check finds a bad value in any one tensor's last element, whatever its neighbours' sizes.
    for bad in [i for i, n in enumerate(sizes) if n]:
        grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        grads[bad][-1] = float("inf")
        flag = torch.zeros(1)
        kernels.check_finite_(grads, flag)
        assert flag.item() == 1.0, (sizes, bad)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "weight_decay"),
    [(0.0, 0.0, False, 0.0), (0.9, 0.0, False, 0.0), (0.9, 0.1, False, 1e-4), (0.9, 0.0, True, 1e-4)],
)
def test_sgd_matches_reference(
    kernels: ModuleType,
    weight_dtype: torch.dtype,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
) -> None:
    state = make(2, weight_dtype, weight_dtype, 256.0)
    state.pop("v")
    if momentum == 0:
        state["m"] = []
    inv_scale = torch.full((1,), 1 / 256.0)
    for step in range(3):
        run_both(
            kernels,
            "sgd_",
            state,
            ref.SgdSettings(
                lr=0.1,
                momentum=momentum,
                dampening=dampening,
                nesterov=nesterov,
                weight_decay=weight_decay,
                maximize=step == 2,
            ),
            first_step=step == 0,
            inv_scale=inv_scale,
            found_inf=torch.zeros(1),
        )


def test_a_raised_flag_changes_nothing(kernels: ModuleType) -> None:
    state = make(3, torch.float16, torch.float16, 1.0)
    before = {key: clone(value) for key, value in state.items()}
    scalars = ref.adam_step_scalars([torch.tensor(1.0)] * len(SIZES), 0.9, 0.999, 1e-3)
    call(
        kernels,
        "adam_",
        state,
        scalars,
        ref.AdamSettings(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False),
        inv_scale=torch.ones(1),
        found_inf=torch.ones(1),
    )
    call(
        kernels,
        "sgd_",
        state,
        ref.SgdSettings(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
        first_step=False,
        inv_scale=None,
        found_inf=torch.ones(1),
    )
    for key in state:
        assert_same(state[key], before[key])


# numpy, under the interpreter, warns when 65520 rounds to fp16's inf (as it must).
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_weights_round_to_nearest_even(kernels: ModuleType) -> None:
    """fp32 -> bf16/fp16 as torch rounds: ties to even, overflow to inf, NaN stays NaN (the interpreter truncates)."""
    one = 1.0
    bf16_ties = [one + 2**-8, one + 2**-8 + 2**-9, one + 2**-9, -(one + 3 * 2**-9), 3.3895e38, 1e-40, float("nan")]
    fp16_ties = [one + 2**-11, one + 3 * 2**-11, 65520.0, 1e-6, float("-inf")]
    for dtype, values in ((torch.bfloat16, bf16_ties), (torch.float16, fp16_ties)):
        masters = [torch.tensor(values), torch.randn(5000) * torch.logspace(-20, 20, 5000)]
        weights = [torch.zeros(len(values), dtype=dtype), torch.zeros(5000, dtype=dtype)]
        # lr 0, no decay: the master stays exactly as it is and is only written out.
        kernels.sgd_(
            [torch.zeros_like(m) for m in masters],
            ref.Masters.fp32(masters, weights),
            [],
            ref.SgdSettings(lr=0.0, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
            first_step=False,
            inv_scale=None,
            found_inf=None,
        )
        for master, weight in zip(masters, weights):
            expected = master.to(dtype)
            # NaN's bits are torch's choice per code path (0x7FC0 scalar, 0xFFFF vectorised on AVX2): NaN-ness only.
            nan = expected.isnan()
            assert torch.equal(weight.isnan(), nan)
            assert same_bits(weight[~nan], expected[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["end of a whole block", "end of the partial last block"])
def test_check_finite_matches_reference(kernels: ModuleType, dtype: torch.dtype, bad: float | None, where: str) -> None:
    # A tensor over two and a half blocks, the bad value where only a program reading its whole block finds it.
    block = kernels._BLOCK
    grads = [torch.randn(n).to(dtype) for n in (*SIZES, 2 * block + block // 2)]
    if bad is not None:
        grads[-1][2 * block - 1 if where == "end of a whole block" else -1] = bad
    before = clone(grads)
    flags = torch.zeros(1), torch.zeros(1)
    ref.check_finite_(grads, flags[0])
    kernels.check_finite_(grads, flags[1])
    assert flags[0].item() == flags[1].item() == (0.0 if bad is None else 1.0)
    assert_same(grads, before)  # a check, not an unscale: the grads are untouched


def test_check_finite_never_clears_the_flag(kernels: ModuleType) -> None:
    flag = torch.ones(1)
    kernels.check_finite_([torch.ones(10, dtype=torch.bfloat16)], flag)
    assert flag.item() == 1.0


def test_lists_of_mixed_dtypes_are_refused(kernels: ModuleType) -> None:
    with pytest.raises(ValueError, match="one dtype per list"):
        kernels.check_finite_([torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16)], torch.zeros(1))


# -- the fused step inside amp ----------------------------------------------------------------------------------
HALF = {"O2": torch.float16, "O5": torch.bfloat16}


def train(
    monkeypatch: pytest.MonkeyPatch,
    backend: ModuleType | None,
    level: str,
    make_opt: Any,
    sync_free: bool = False,
    poison_step: int | None = None,
    switched: bool = False,
) -> tuple[list[torch.Tensor], dict[str, Any], int]:
    """Four amp steps; the fused step runs on ``backend`` (None: torch's own step). Returns weights, state, launches.

    ``switched``: ``backend`` is not imposed; amp's own ``kernels_for`` picks the kernels (counted all the same).
    """
    from torch import nn

    from ampinit import amp
    from ampinit._masters import kernel_step

    calls = []

    picked = kernel_step.kernels_for

    def kernels(device: torch.device) -> ModuleType | None:
        calls.append(device)
        return picked(device) if switched else backend

    monkeypatch.setattr(kernel_step, "kernels_for", kernels)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, sync_free=sync_free)
    session = amp.current_session()
    assert session is not None
    try:
        for step in range(4):
            data = torch.randn(32, 8, generator=gen)
            with amp.scale_loss(model(data).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
                if step == poison_step:
                    model[0].weight.grad[0, 0] = float("inf")
            opt.step()
            opt.zero_grad()
        masters = [p.detach().clone() for p in amp.master_params(opt)]
        weights = [p.detach().clone() for p in model.parameters()]
        state = opt.state_dict()
    finally:
        session.close()
    return [*weights, *masters], state, len(calls)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, maximize=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, fused=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
}


def state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for _, per_param in sorted(state["state"].items()) for _, v in sorted(per_param.items())]


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("sync_free", [False, True])
def test_amp_fused_step_matches_the_reference_step(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, level: str, name: str, sync_free: bool
) -> None:
    tensors, state, launches = train(monkeypatch, kernels, level, OPTIMIZERS[name], sync_free)
    ref_tensors, ref_state, _ = train(monkeypatch, ref, level, OPTIMIZERS[name], sync_free)
    assert launches > 0
    assert_same(tensors, ref_tensors)
    assert_same(state_tensors(state), state_tensors(ref_state))


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_amp_fused_step_agrees_with_torch_and_keeps_its_state_layout(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, level: str, name: str
) -> None:
    tensors, state, _ = train(monkeypatch, kernels, level, OPTIMIZERS[name])
    torch_tensors, torch_state, _ = train(monkeypatch, None, level, OPTIMIZERS[name])
    # torch's fused CPU kernels round differently (their scalar tails run in float64): close, not bitwise.
    for ours, theirs in zip(tensors, torch_tensors):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-2, atol=1e-3)
    assert state["param_groups"] == torch_state["param_groups"]
    assert state["state"].keys() == torch_state["state"].keys()
    for index, ours in state["state"].items():
        theirs = torch_state["state"][index]
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert (ours[key].dtype, ours[key].shape, ours[key].device) == (
                theirs[key].dtype,
                theirs[key].shape,
                theirs[key].device,
            )
            if key == "step":
                assert torch.equal(ours[key], theirs[key])


def test_amp_fused_step_skips_an_overflow_on_the_device(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """An inf grad on step 2 (sync-free: the kernel reads the flag): as if step 2 never happened, step counts too."""
    tensors, state, _ = train(monkeypatch, kernels, "O2", OPTIMIZERS["adamw"], sync_free=True, poison_step=2)
    ref_tensors, ref_state, _ = train(monkeypatch, ref, "O2", OPTIMIZERS["adamw"], sync_free=True, poison_step=2)
    assert_same(tensors, ref_tensors)
    assert_same(state_tensors(state), state_tensors(ref_state))
    assert all(per_param["step"].item() == 3.0 for per_param in state["state"].values())


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    ],
)
def test_amp_fused_step_leaves_other_optimizers_to_torch(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, make_opt: Any
) -> None:
    _, _, launches = train(monkeypatch, kernels, "O2", make_opt)
    assert launches == 0


def test_the_one_switch_runs_fp32_masters_through_the_kernels_on_cpu(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kernel_step.TRITON_ON_CPU`` (set by the ``kernels_on_cpu`` fixture) serves fp32 masters as it serves
    remainder ones: with it on, amp's own choice of kernels gives the interpreted kernels and the reference's bits."""
    launched = []
    adam = kernels_on_cpu.adam_
    monkeypatch.setattr(kernels_on_cpu, "adam_", lambda *a, **k: launched.append(1) or adam(*a, **k))
    tensors, state, _ = train(monkeypatch, None, "O2", OPTIMIZERS["adamw"], switched=True)
    assert launched
    ref_tensors, ref_state, _ = train(monkeypatch, ref, "O2", OPTIMIZERS["adamw"])
    assert_same(tensors, ref_tensors)
    assert_same(state_tensors(state), state_tensors(ref_state))


UNFUSED = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam-single-tensor": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, foreach=False),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True),
}


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(UNFUSED))
def test_unfused_torch_optimizers_take_the_kernels_within_the_documented_tolerance(
    kernels_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, level: str, name: str
) -> None:
    """The kernels by default, whatever the group's foreach/fused flags (issue 24), within the bound
    docs/opt-levels.md gives against torch's own step: masters within 1e-5 x lr per step, half weights within one
    half ulp; the state in torch's layout (step counts exact)."""
    from ampinit._masters import kernel_step

    launches = []
    for fn in ("adam_", "sgd_"):
        real = getattr(kernels_on_cpu, fn)
        monkeypatch.setattr(kernels_on_cpu, fn, lambda *a, _real=real, **k: launches.append(1) or _real(*a, **k))
    tensors, state, _ = train(monkeypatch, None, level, UNFUSED[name], switched=True)
    assert len(launches) == 4 * 2  # four steps, each one launch for the half weights and one for the fp32 BN
    monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", False)
    torch_tensors, torch_state, _ = train(monkeypatch, None, level, UNFUSED[name], switched=True)
    assert len(launches) == 8
    lr = state["param_groups"][0]["lr"]
    half_ulp = {"O2": 2.0**-10, "O5": 2.0**-7}[level]
    for ours, theirs in zip(tensors, torch_tensors):
        if ours.dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=0.0, atol=1e-5 * lr * 4)
        else:
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=half_ulp, atol=0.0)
    assert state["param_groups"] == torch_state["param_groups"]
    for index, ours in state["state"].items():
        theirs = torch_state["state"][index]
        assert ours.keys() == theirs.keys()
        assert all(ours[k].device == theirs[k].device and ours[k].dtype == theirs[k].dtype for k in ours)
        if "step" in ours:
            assert torch.equal(ours["step"], theirs["step"])


APEX_OPTIMIZERS = {
    "fused-adam-w": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    "fused-adam-l2-no-bias-correction": lambda ps: FusedAdam(
        ps, lr=1e-2, weight_decay=0.01, adam_w_mode=False, bias_correction=False
    ),
    "fused-sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "fused-sgd-dampening": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
}


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", list(APEX_OPTIMIZERS))
def test_fused_adam_and_sgd_take_the_kernels_with_their_settings(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, level: str, name: str
) -> None:
    """ampinit's FusedAdam/FusedSGD map onto the kernels (adam_w_mode, bias_correction, dampening...): the
    kernels give the reference's bits, and train as the optimizer's own step does (within the bound of
    docs/opt-levels.md), its state where it keeps it."""
    tensors, state, launches = train(monkeypatch, kernels, level, APEX_OPTIMIZERS[name])
    ref_tensors, ref_state, _ = train(monkeypatch, ref, level, APEX_OPTIMIZERS[name])
    assert launches > 0
    assert_same(tensors, ref_tensors)
    assert_same(state_tensors(state), state_tensors(ref_state))
    own_tensors, own_state, _ = train(monkeypatch, None, level, APEX_OPTIMIZERS[name])
    half_ulp = {"O2": 2.0**-10, "O5": 2.0**-7}[level]
    lr = state["param_groups"][0]["lr"]
    for ours, theirs in zip(tensors, own_tensors):
        if ours.dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=0.0, atol=1e-5 * lr * 4)
        else:
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=half_ulp, atol=0.0)
    assert state["param_groups"] == own_state["param_groups"]  # FusedAdam's group step count included


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: FusedAdam(ps, lr=1e-2, capturable=True),
        lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, wd_after_momentum=True),
    ],
    ids=["capturable", "wd-after-momentum"],
)
def test_fused_optimizers_keep_their_own_step_where_the_kernels_lack_an_option(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, make_opt: Any
) -> None:
    _, _, launches = train(monkeypatch, kernels, "O2", make_opt)
    assert launches == 0


def test_fused_adam_in_the_kernels_skips_an_overflow_on_the_device(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sync-free, an inf grad on step 2: the group's step count stays put, as the reference's."""
    make = APEX_OPTIMIZERS["fused-adam-w"]
    tensors, state, launches = train(monkeypatch, kernels, "O2", make, sync_free=True, poison_step=2)
    ref_tensors, ref_state, _ = train(monkeypatch, ref, "O2", make, sync_free=True, poison_step=2)
    assert launches > 0
    assert_same(tensors, ref_tensors)
    assert state["param_groups"][0]["step"].item() == 3.0 == ref_state["param_groups"][0]["step"].item()


def test_check_finite_of_empty_grads_launches_nothing(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = NoLaunch()
    monkeypatch.setattr(kernels, "_check_kernel", stand_in)
    flag = torch.zeros(1)
    kernels.check_finite_([torch.empty(0, dtype=torch.bfloat16), torch.empty(0, 3, dtype=torch.bfloat16)], flag)
    assert stand_in.launches == 0 and flag.item() == 0.0
    kernels.check_finite_([torch.empty(0, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)], flag)
    assert stand_in.launches == 1


def _fused_adam_group_counts(level: str, **options: Any) -> list[tuple[float, ...]]:
    """FusedAdam's group step counts over four amp steps of two groups, the second (the head) with grads on odd steps
    only: on even ones the output is taken before the head."""
    from ampinit import amp
    from tests.conftest import make_problem

    model, x, y = make_problem()
    head = list(model.head.parameters())
    rest = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = FusedAdam([{"params": rest}, {"params": head}], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dial's settings warn about what they round
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **options)
    session = amp.current_session()
    assert session is not None
    half = torch.float16 if level == "O2" else torch.bfloat16
    counts = []
    try:
        for i in range(4):
            opt.zero_grad()
            if i % 2:
                out = model(x)
            else:
                out = model.ln(model.fc2(torch.nn.functional.gelu(model.bn(model.fc1(x.to(half))))))[:, :4]
            with amp.scale_loss((out.float() - y).pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            counts.append(tuple(float(group.get("step", 0.0)) for group in opt.param_groups))
    finally:
        session.close()
    return counts


#: FusedAdam's own step (Apex's too) counts a step of every group with parameters, with or without grads
#: (docs/optimizers.md: "a frozen group's step counter still counts").
_EVERY_GROUP_COUNTED = [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0), (4.0, 4.0)]


@pytest.mark.parametrize("sync_free", [False, True])
def test_fused_adam_in_the_kernels_counts_a_step_of_a_group_without_grads(
    kernels_on_cpu: ModuleType, sync_free: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel step counted only the groups it launched on, so a group whose parameters had no grad on some steps
    # (a head used on some batches) was bias-corrected with a smaller count than FusedAdam's own step gives it.
    from ampinit._masters import kernel_step

    ours = _fused_adam_group_counts("O2", sync_free=sync_free)
    monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", False)
    own = _fused_adam_group_counts("O2", sync_free=sync_free)
    assert own == _EVERY_GROUP_COUNTED
    assert ours == own


@pytest.mark.parametrize(
    ("options", "on_kernels"),
    [
        (dict(master_weights="remainder"), False),
        (dict(master_weights="remainder"), True),
        (dict(master_weights="stochastic"), True),  # the dial's step (remainder8 takes the same one)
        (dict(optimizer_state="8bit"), False),  # the compressed state's step, fp32 masters
        (dict(master_weights="remainder", optimizer_state="bf16"), True),
    ],
    ids=["remainder-chunked", "remainder-kernels", "stochastic-kernels", "8bit-state-chunked", "remainder-bf16"],
)
def test_fused_adam_under_the_dial_counts_a_step_of_a_group_without_grads(
    triton_interpreter: ModuleType, options: dict[str, Any], on_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The remainder and dial steps skipped a group without grads, and FusedAdam's update counted only the groups
    # handed chunks: the same miscount, with or without amp's kernels.
    from ampinit._masters import kernel_step

    monkeypatch.setattr(kernel_step, "TRITON_ON_CPU", on_kernels)
    assert _fused_adam_group_counts("O5", **options) == _EVERY_GROUP_COUNTED
