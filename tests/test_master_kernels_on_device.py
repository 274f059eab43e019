"""The master step's Triton kernels compiled on CUDA against the pure-torch reference, bit for bit.

test_master_kernels.py compares them on CPU through Triton's interpreter, and tests/test_triton_compile.py reads the
PTX built for sm_80/sm_90 (rounding, no fused multiply-add, vector accesses); until the seventeenth session no test
compared what the compiled kernels write on a GPU with the reference (the GPU checks ran test_master_kernels.py on
the interpreter: its kernels fixture is the interpreter's). Here the same updates run on CUDA tensors through the
compiled kernels, the reference on the same device (torch's elementwise ops, each rounded once, and the reference's
float64 division and square root).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ampinit._masters import reference as ref
from tests import _triton
from tests._device import requires_cuda
from tests._kernels_vs_reference import State, clone, run_both

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernel path needs it")

pytestmark = requires_cuda("the compiled master kernels")

DEVICE = "cuda"

#: One element, a partial block, one block, one past it, several blocks, and one tensor past 2**16 elements.
SIZES = [1, 7, 1024, 1025, 3000, 70001]


@pytest.fixture(scope="module")
def compiled() -> Any:
    from ampinit._masters import triton_kernels

    assert not _triton.interpreted(triton_kernels), "the kernels are built for the interpreter: the test would not test"
    return triton_kernels


def _state(seed: int, weight_dtype: torch.dtype, grad_dtype: torch.dtype, scale: float) -> State:
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=gen) for n in SIZES]
    state = {
        "weights": [m.to(weight_dtype) for m in masters],
        "grads": [(torch.randn(n, generator=gen) * scale).to(grad_dtype) for n in SIZES],
        "masters": masters,
        "m": [torch.randn(n, generator=gen) * 0.1 for n in SIZES],
        "v": [torch.rand(n, generator=gen) * 0.01 for n in SIZES],
    }
    return {key: [t.to(DEVICE) for t in tensors] for key, tensors in state.items()}


# Each case a compilation on the GPU check (a few seconds in a suite with a time limit): both weight dtypes, both
# kinds of grad (half, scaled; fp32), both decays, maximize, in two cases.
@pytest.mark.parametrize(
    ("weight_dtype", "half_grads", "weight_decay", "decoupled", "maximize"),
    [(torch.bfloat16, True, 0.05, True, False), (torch.float16, False, 0.05, False, True)],
)
def test_compiled_adam_writes_the_references_bits(
    compiled: Any, weight_dtype: torch.dtype, half_grads: bool, weight_decay: float, decoupled: bool, maximize: bool
) -> None:
    state = _state(0, weight_dtype, weight_dtype if half_grads else torch.float32, 1024.0 if half_grads else 1.0)
    inv_scale = torch.full((1,), 1 / 1024.0, device=DEVICE) if half_grads else None
    steps = [torch.tensor(float(k), device=DEVICE) for k in (1, 2, 3, 10, 1000, 7)]
    settings = ref.AdamSettings(1e-3, 0.9, 0.999, 1e-8, weight_decay, decoupled, maximize)
    for _ in range(3):
        for count in steps:
            count += 1
        scalars = ref.adam_step_scalars(steps, 0.9, 0.999, 1e-3)
        flag = torch.zeros(1, device=DEVICE)
        run_both(compiled, "adam_", state, scalars, settings, inv_scale=inv_scale, found_inf=flag)


@pytest.mark.parametrize(
    ("weight_dtype", "momentum", "nesterov"), [(torch.bfloat16, 0.9, True), (torch.float16, 0.0, False)]
)
def test_compiled_sgd_writes_the_references_bits(
    compiled: Any, weight_dtype: torch.dtype, momentum: float, nesterov: bool
) -> None:
    state = _state(2, weight_dtype, weight_dtype, 256.0)
    state.pop("v")
    if momentum == 0:
        state["m"] = []
    inv_scale = torch.full((1,), 1 / 256.0, device=DEVICE)
    for step in range(3):
        settings = ref.SgdSettings(0.1, momentum, 0.0, nesterov, 1e-4, step == 2)
        run_both(
            compiled, "sgd_", state, settings, first_step=step == 0, inv_scale=inv_scale,
            found_inf=torch.zeros(1, device=DEVICE),
        )  # fmt: skip


def test_a_raised_flag_keeps_every_tensor(compiled: Any) -> None:
    state = _state(3, torch.float16, torch.float16, 1.0)
    before = {key: clone(value) for key, value in state.items()}
    scalars = ref.adam_step_scalars([torch.tensor(1.0, device=DEVICE)] * len(SIZES), 0.9, 0.999, 1e-3)
    settings = ref.AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
    compiled.adam_(
        state["grads"], ref.Masters.fp32(state["masters"], state["weights"]), state["m"], state["v"], scalars,
        settings, found_inf=torch.ones(1, device=DEVICE),
    )  # fmt: skip
    for key, tensors in state.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, before[key], strict=True)), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_compiled_check_finds_what_the_reference_finds(compiled: Any, dtype: torch.dtype, bad: float | None) -> None:
    grads = [torch.randn(n).to(DEVICE, dtype) for n in SIZES]
    for index in range(len(SIZES)) if bad is not None else [None]:
        tried = clone(grads)
        if index is not None:
            tried[index][-1] = bad  # the last element: the last program of that tensor
        want, got = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
        ref.check_finite_(tried, want)
        compiled.check_finite_(tried, got)
        assert torch.equal(got, want), (index, got, want)
        assert want.item() == (0.0 if bad is None else 1.0)
