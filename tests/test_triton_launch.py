"""``triton_launch.launch``: a kernel launched again through the compiled kernel Triton returned, with what Triton
would have passed, and through Triton wherever Triton's own specialisation could differ.

Run on Triton's whole launch path with a stand-in driver (benchmarks/_fake_driver.py): binding, specialisation and
compilation for an H100 are Triton's, only the CUDA launcher records its calls instead of launching. On a GPU the
same kernels run for real in every CUDA test of the master step (``--device cuda``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch

from ampinit._masters.reference import AdamSettings, Masters, SgdSettings
from benchmarks._fake_driver import STREAM, Call, FakeDriver, fake_driver
from tests._host_work import NoLaunch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")


@pytest.fixture
def driver() -> Iterator[FakeDriver]:
    with fake_driver() as fake:
        yield fake


class _Runs:
    """Counts ``JITFunction.run`` calls of one kernel (Triton's binding path), passing them on."""

    def __init__(self, kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        run = kernel.run

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counted)


def _tensors(seed: int = 0, sizes: tuple[int, ...] = (3000, 17, 1024)) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=gen) for n in sizes]
    return {
        "grads": [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes],
        "masters": masters,
        "weights": [m.to(torch.bfloat16) for m in masters],
        "m": [torch.zeros(n) for n in sizes],
        "v": [torch.zeros(n) for n in sizes],
        "scalars": torch.rand(len(sizes), 2, generator=gen),
    }


ADAM = AdamSettings(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)


def _adam(kernels: ModuleType, t: dict[str, Any], flag: torch.Tensor | None, inv_scale: torch.Tensor | None) -> None:
    masters = Masters.fp32(t["masters"], t["weights"])
    kernels.adam_(t["grads"], masters, t["m"], t["v"], t["scalars"], ADAM, inv_scale=inv_scale, found_inf=flag)


def _same_call(first: Call, second: Call) -> bool:
    """The same grid, stream and compiled kernel, and the same arguments (tensors: the same objects)."""
    if (first.grid, first.stream, first.kernel, len(first.args)) != (second.grid, second.stream, second.kernel,
                                                                     len(second.args)):  # fmt: skip
        return False
    return all(a is b if isinstance(a, torch.Tensor) else (type(a) is type(b) and a == b)
               for a, b in zip(first.args, second.args))  # fmt: skip


@pytest.mark.parametrize("with_flag", [False, True])
@pytest.mark.parametrize("with_scale", [False, True])
def test_a_second_adam_launch_skips_triton_and_calls_its_launcher_as_triton_did(
    driver: FakeDriver, monkeypatch: pytest.MonkeyPatch, with_flag: bool, with_scale: bool
) -> None:
    import ampinit._masters.triton_kernels as kernels

    runs = _Runs(kernels._adam_kernel, monkeypatch)
    t = _tensors()
    flag = torch.zeros(1) if with_flag else None
    inv_scale = torch.full((1,), 0.5) if with_scale else None
    _adam(kernels, t, flag, inv_scale)
    _adam(kernels, t, flag, inv_scale)
    _adam(kernels, t, flag, inv_scale)
    assert runs.count == 1
    assert len(driver.calls) == 3
    first, *again = driver.calls
    assert first.grid == (1 + 3 + 1, 1, 1) and first.stream == STREAM  # 3000 / 1024 -> 3 programs, 17 -> 1, 1024 -> 1
    assert all(_same_call(first, call) for call in again)


def test_the_finite_check_and_sgd_relaunch_as_triton_did(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    import ampinit._masters.triton_kernels as kernels

    checks, sgds = _Runs(kernels._check_kernel, monkeypatch), _Runs(kernels._sgd_kernel, monkeypatch)
    t = _tensors()
    flag = torch.zeros(1)
    settings = SgdSettings(0.1, 0.9, 0.0, False, 0.0, False)
    for _ in range(2):
        kernels.check_finite_(t["grads"], flag)
        kernels.sgd_(t["grads"], Masters.fp32(t["masters"], t["weights"]), t["m"], settings, first_step=False)
    assert (checks.count, sgds.count) == (1, 1)
    check, sgd, check_again, sgd_again = driver.calls
    assert check.kernel != sgd.kernel
    assert _same_call(check, check_again) and _same_call(sgd, sgd_again)


def test_a_launch_triton_would_specialise_otherwise_goes_through_triton(
    driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The flag and the scale are the launch's tensors that are not amp's own tables: a view off 16 bytes is compiled
    # without the alignment Triton assumes for the others, and a grad list of one tensor passes the count 1, which
    # Triton makes a compile-time constant.
    import ampinit._masters.triton_kernels as kernels

    runs = _Runs(kernels._adam_kernel, monkeypatch)
    t = _tensors()
    flags = torch.zeros(8)
    _adam(kernels, t, flags[:1], None)
    _adam(kernels, t, flags[1:2], None)  # 4 bytes in: not on 16
    _adam(kernels, t, flags[4:5], None)  # 16 bytes in: as the first
    single = _tensors(sizes=(100,))
    _adam(kernels, single, flags[:1], None)
    assert runs.count == 3
    aligned, unaligned, aligned_again, single_tensor = driver.calls
    assert len({aligned.kernel, unaligned.kernel, single_tensor.kernel}) == 3
    assert aligned_again.kernel == aligned.kernel


@pytest.mark.parametrize("kernel", [NoLaunch(), None])
def test_what_is_not_a_jit_function_is_launched_as_it_is(kernel: Any) -> None:
    from ampinit._masters import triton_launch

    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int]) -> Any:
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    chosen = Recorder() if kernel is None else kernel
    kept = len(triton_launch._compiled)
    for _ in range(2):
        triton_launch.launch(chosen, 7, (1.0, 2), {"A": 3}, {"enable_fp_fusion": False})
    if kernel is None:
        assert calls == [((7,), (1.0, 2), {"A": 3, "enable_fp_fusion": False})] * 2
    else:
        assert kernel.launches == 2
    assert len(triton_launch._compiled) == kept


def _check_launch(flag: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The finite check's arguments and constants over one grad of 10 elements, with ``flag`` as its flag."""
    import ampinit._masters.triton_kernels as kernels

    tables = kernels._size_tables(torch.device("cpu"), (10,))
    table, _ = kernels._grad_table(torch.device("cpu"), [torch.ones(10)], tables.sizes)
    constants = {"GRAD_T": triton.language.float32, "ALIGNED": True, "SEARCH": 0, "BLOCK": 1024}
    return (table, tables.numels, tables.first_blocks, flag), constants


class _Flag(torch.Tensor):
    """A tensor subclass: Triton takes its data pointer; amp's launches pass plain tensors only."""


def test_an_argument_without_a_rule_goes_through_triton_every_time(
    driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ampinit._masters.triton_kernels as kernels
    from ampinit._masters import triton_launch

    runs = _Runs(kernels._check_kernel, monkeypatch)
    args, constants = _check_launch(torch.zeros(1).as_subclass(_Flag))
    for _ in range(2):
        triton_launch.launch(kernels._check_kernel, 1, args, constants, kernels._OPTIONS)
    assert runs.count == 2 and len(driver.calls) == 2


def _samples() -> list[Any]:
    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int64),
               torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.bfloat16)[1:]]  # fmt: skip
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, 2**63 - 16, 2**63]
    return [*tensors, *ints, True, False, 0.0, 1.0, 0.5, 1e300, None]


def test_the_key_separates_every_specialisation_triton_makes() -> None:
    # Checked against Triton's own function (C++ since 3.3), for the kinds of argument amp's launches pass: two
    # arguments with one key must have one specialisation, else a kernel compiled for one would run the other.
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    from ampinit._masters import triton_launch

    backend = make_backend(GPUTarget("cuda", 90, 32))
    samples = _samples()
    keys = [triton_launch._arguments_key((a,)) for a in samples]
    specs = [native_specialize_impl(backend, a, False, True, True) for a in samples]
    clashes = [(a, b) for (a, ka, sa), (b, kb, sb) in itertools.combinations(zip(samples, keys, specs), 2)
               if ka == kb and sa != sb]  # fmt: skip
    assert not clashes
    # and not by keeping everything apart: floats of any value share one, as they share Triton's
    floats = [k for a, k in zip(samples, keys) if type(a) is float]
    assert len(floats) == 4 and len(set(floats)) == 1
    # a whole launch's key is its arguments' keys together
    together = triton_launch._arguments_key(samples)
    sixteen = next(i for i, a in enumerate(samples) if type(a) is int and a == 16)
    assert together is not None and together == triton_launch._arguments_key([*samples[:-2], 2.0, None])
    assert together != triton_launch._arguments_key([*samples[:sixteen], 17, *samples[sixteen + 1 :]])
    assert together != triton_launch._arguments_key([samples[1], *samples[1:]])  # an aligned tensor for an unaligned


def test_the_fused_gelu_relaunches_as_triton_did(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """O1/O4's fused gelu (Apex's lists: two launches per gelu layer and step) takes the same path."""
    import ampinit._casting.triton_gelu as gelu

    forwards, backwards = _Runs(gelu._forward_kernel, monkeypatch), _Runs(gelu._backward_kernel, monkeypatch)
    x = torch.randn(3000).to(torch.bfloat16)
    for _ in range(2):
        gelu.forward(x, gelu.FORWARD_VARIANTS[0])
        gelu.backward(torch.ones(3000), x, gelu.BACKWARD_VARIANTS[0])
    assert (forwards.count, backwards.count) == (1, 1)
    forward, backward, forward_again, backward_again = driver.calls
    assert forward.grid == (3, 1, 1) and forward.args[2] == 3000  # x, y, n, then the constants
    # The outputs are fresh tensors each call: the same arguments but those.
    assert forward_again.kernel == forward.kernel and forward_again.args[0] is x
    assert forward_again.args[2:] == forward.args[2:] and backward_again.args[3:] == backward.args[3:]
    assert backward_again.kernel == backward.kernel


def test_the_step_scalars_relaunch_as_triton_did(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adam's step-scalars launch: its lr is a float64 parameter (annotated), keyed as any float; a new lr is the same
    compiled kernel with another argument."""
    import ampinit._masters.triton_kernels as kernels

    runs = _Runs(kernels._step_scalars_kernel, monkeypatch)
    powers, steps, flag = torch.rand(2, 150, dtype=torch.float64), torch.ones(150), torch.zeros(1)
    for lr in (1e-3, 1e-3, 1 / 3):
        kernels.step_scalars_(powers, lr, steps, flag)
    assert runs.count == 1
    first, again, other_lr = driver.calls
    assert first.grid == (1, 1, 1) and first.args[4:6] == (150, 1e-3)
    assert again.kernel == first.kernel and again.args[:3] == first.args[:3] and again.args[4:] == first.args[4:]
    assert other_lr.kernel == first.kernel and other_lr.args[5] == 1 / 3


def test_a_launch_for_another_cuda_device_is_made_with_that_device_current(
    driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton launches on the current CUDA device; amp's launches make the tensors' device current first where it is
    another (a model on cuda:1 in a process whose current device is 0), and only then."""
    import contextlib

    import ampinit._masters.triton_kernels as kernels
    from ampinit._masters import triton_launch
    from benchmarks._fake_driver import DEVICE

    entered: list[torch.device] = []

    @contextlib.contextmanager
    def guard(device: torch.device) -> Iterator[None]:
        # What torch.cuda.device does: the device current inside the block, the previous one after.
        entered.append(device)
        previous, driver.device = driver.device, device.index
        try:
            yield
        finally:
            driver.device = previous

    monkeypatch.setattr(triton_launch, "_device_guard", guard)
    args, constants = _check_launch(torch.zeros(1))
    for device in (torch.device("cuda", 3), torch.device("cuda", DEVICE), torch.device("cpu"), None):
        triton_launch.launch(kernels._check_kernel, 1, args, constants, kernels._OPTIONS, device)
    assert entered == [torch.device("cuda", 3)]
    assert len(driver.calls) == 4 and driver.device == DEVICE
    # The launch for cuda:3 was keyed by device 3, and kept apart from the current device's.
    assert {key[1] for key in triton_launch._compiled} == {3, DEVICE}
