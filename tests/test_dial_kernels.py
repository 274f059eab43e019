"""The dial's Triton kernels (``ampinit._masters.triton_dial``) bit for bit against the reference step
(``reference.adam_dial_`` / ``sgd_dial_``, itself pinned by tests/test_dial_step.py), through Triton's interpreter
on CPU: every storage of the masters and the moments, Adam, AdamW and SGD, several tensors of different sizes in
one launch (a partial kernel block, partial 8-bit blocks, a tensor smaller than a block), and a raised flag."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from ampinit._masters import precision, remainder
from ampinit._masters import reference as ref
from tests import _triton
from tests._dial_storages import Storages

SIZES = (1300, 300, 5)  # two kernel blocks, the second partial; partial 8-bit blocks
SEED = 77
KINDS = ["fp32", "fp32+weights", "remainder", "remainder8", "stochastic"]
FORMATS = ["fp32", "bf16", "8bit"]
ADAM = ref.AdamSettings(1e-2, 0.9, 0.999, 1e-8, 0.01, decoupled=False, maximize=False)
ADAMW = ref.AdamSettings(3e-3, 0.8, 0.99, 1e-6, 0.1, decoupled=True, maximize=True)
SGD = ref.SgdSettings(0.05, 0.9, 0.1, nesterov=False, weight_decay=0.01, maximize=False)
NESTEROV = ref.SgdSettings(0.05, 0.9, 0.0, nesterov=True, weight_decay=0.0, maximize=False)
OPTIMIZERS = {"adam": ADAM, "adamw": ADAMW, "sgd": SGD, "nesterov": NESTEROV}


@pytest.fixture(scope="module")
def dial() -> Iterator[ModuleType]:
    """``triton_dial`` built on the interpreted ``triton_kernels`` helpers, and built back afterwards."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels need it")
    import ampinit._masters.triton_dial as module

    try:
        with _triton.interpreted_kernels():
            yield importlib.reload(module)
    finally:
        importlib.reload(module)


class State(Storages):
    """One list's storages: the tensors both implementations update, and how to view them."""

    def view(self, step: int) -> tuple[ref.Masters, list[ref.Moments]]:
        keys = [
            precision.keys(SEED, torch.tensor(step), torch.arange(len(SIZES)) * 4 + purpose) for purpose in range(3)
        ]
        if self.kind.startswith("fp32"):
            masters = ref.Masters.fp32(self.masters, self.weights)
        elif self.kind == "remainder":
            masters = ref.Masters.remainder(self.weights, self.remainders)
        elif self.kind == "remainder8":
            masters = ref.Masters.remainder8(self.weights, self.remainders, keys[0])
        else:
            masters = ref.Masters.stochastic(self.weights, keys[0])
        moments = []
        for slot, values in enumerate(self.moments):
            if self.fmt == "bf16":
                moments.append(ref.Moments.bf16(values, keys[1 + slot]))
            elif self.fmt == "8bit":
                qmap = precision.QuantMap.build(signed=slot == 0)
                moments.append(ref.Moments.eight_bit(values, self.absmax[slot], qmap))
            else:
                moments.append(ref.Moments.fp32(values))
        return masters, moments


def initial(kind: str, fmt: str, n_moments: int) -> State:
    gen = torch.Generator().manual_seed(3)
    fp32 = [torch.randn(n, generator=gen) for n in SIZES]
    masters: list[torch.Tensor] = []
    weights = [x.to(torch.bfloat16) for x in fp32]
    remainders: list[torch.Tensor] = []
    if kind.startswith("fp32"):
        masters = fp32
        weights = weights if kind == "fp32+weights" else []
    elif kind == "remainder":
        remainders = [remainder.split(x)[1] for x in fp32]
        weights = [remainder.split(x)[0] for x in fp32]
    elif kind == "remainder8":
        remainders = [torch.empty(n, dtype=torch.int8) for n in SIZES]
        for x, w, r in zip(fp32, weights, remainders):
            precision.split8_(x.clone(), w, r, torch.zeros(x.shape, dtype=torch.int64))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[fmt]
    moments = [[torch.zeros(n, dtype=dtype) for n in SIZES] for _ in range(n_moments)]
    absmax = [[torch.zeros(precision.absmax_blocks(n)) for n in SIZES] for _ in range(n_moments)]
    return State(kind, fmt, masters, weights, remainders, moments, absmax if fmt == "8bit" else [])


def grads_of(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return [(torch.randn(n, generator=gen) * 64).to(torch.bfloat16) for n in SIZES]


def step(
    module: ModuleType,
    name: str,
    state: State,
    n: int,
    found_inf: torch.Tensor | None = None,
    grads: list[torch.Tensor] | None = None,
) -> None:
    settings = OPTIMIZERS[name]
    grads = grads_of(n) if grads is None else [g.clone() for g in grads]
    masters, moments = state.view(n)
    inv_scale = torch.tensor([1 / 64])
    if isinstance(settings, ref.AdamSettings):
        steps = [torch.tensor(float(n))] * len(SIZES)
        scalars = ref.adam_step_scalars(steps, settings.beta1, settings.beta2, settings.lr)
        module.adam_dial_(grads, masters, *moments, scalars, settings, inv_scale=inv_scale, found_inf=found_inf)
    else:
        module.sgd_dial_(
            grads, masters, moments[0], settings, first_step=n == 1, inv_scale=inv_scale, found_inf=found_inf
        )


def assert_same(a: State, b: State) -> None:
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (x.dtype, tuple(x.shape))


# Every storage pair for AdamW and SGD with momentum; Adam (L2 decay) and Nesterov on each kind once, formats in
# turn (the interpreter is slow: the whole grid twice over would double the file's time).
COMBINATIONS = [(name, kind, fmt) for name in ("adamw", "sgd") for kind in KINDS for fmt in FORMATS] + [
    (name, kind, FORMATS[(i + shift) % 3])
    for shift, name in enumerate(("adam", "nesterov"))
    for i, kind in enumerate(KINDS)
]


@pytest.mark.parametrize(("name", "kind", "fmt"), COMBINATIONS)
def test_kernel_matches_the_reference_bitwise(dial: ModuleType, name: str, kind: str, fmt: str) -> None:
    ours = initial(kind, fmt, 2 if name.startswith("adam") else 1)
    theirs = ours.clone()
    for n in (1, 2):
        step(ref, name, theirs, n)
        step(dial, name, ours, n)
        assert_same(ours, theirs)


@pytest.mark.parametrize(("kind", "fmt"), [("remainder8", "8bit"), ("stochastic", "bf16")])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_raised_flag_writes_nothing(dial: ModuleType, name: str, kind: str, fmt: str) -> None:
    state = initial(kind, fmt, 2 if name.startswith("adam") else 1)
    step(dial, name, state, 1)
    before = state.clone()
    step(dial, name, state, 2, found_inf=torch.ones(1))
    assert_same(state, before)
    step(dial, name, state, 2, found_inf=torch.zeros(1))
    with pytest.raises(AssertionError):
        assert_same(state, before)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_nan_grad_makes_its_8bit_block_nan_as_the_reference_does(dial: ModuleType, name: str) -> None:
    """Unflagged (bf16 without a loss scaler), a NaN grad reaches the moments: the reference's absmax (torch's
    amax) is NaN for that block, where a NaN-dropping maximum would keep the NaN as a finite code."""
    grads = grads_of(1)
    grads[0][7] = float("nan")
    ours = initial("remainder8", "8bit", 2 if name.startswith("adam") else 1)
    theirs = ours.clone()
    step(ref, name, theirs, 1, grads=grads)
    step(dial, name, ours, 1, grads=grads)
    assert theirs.absmax[0][0][0].isnan()
    assert_same(ours, theirs)


def test_one_launch_takes_one_moment_format(dial: ModuleType) -> None:
    state = initial("fp32", "fp32", 2)
    masters, (m, _) = state.view(1)
    v = ref.Moments.bf16([x.to(torch.bfloat16) for x in state.moments[1]], torch.zeros(len(SIZES), dtype=torch.int64))
    scalars = ref.adam_step_scalars([torch.tensor(1.0)] * len(SIZES), 0.9, 0.999, 1e-3)
    with pytest.raises(ValueError, match=r"one launch stores its moments in one format, got \['bf16', 'fp32'\]"):
        dial.adam_dial_(grads_of(1), masters, m, v, scalars, ADAM)
