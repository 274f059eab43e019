"""Host time of the CUDA master step, measured on CPU: ``optimizer.step()`` at O2/O5 through the Triton-kernel path
with every launch replaced by a no-op, against torch's fused AdamW step on the same tensors (issue 24's proxy).

On a GPU the kernels run asynchronously, so what ``optimizer.step()`` costs the host is its Python: the plan, the
optimizer state, the pointer and block tables, the launch arguments. Here the kernel path is forced onto CPU
tensors (``kernel_step.TRITON_ON_CPU``) and the launch itself does nothing, so a sample is exactly that host work.
The baseline is ``torch.optim.AdamW(fused=True)`` on fp32 copies of the same tensors, whose tiny tensors make its
sample mostly host work too (its C++ loop over the tensors). Tensors are small (``--numel``) so that arithmetic
does not hide the per-tensor cost; the tensor count varies (50, 150, 450) to show how each grows. Two more rows:
O4 with torch's foreach AdamW, whose step the kernels take at a static scale (docs/opt-levels.md, "The kernel step
without masters"), beside the torch foreach step it replaces (ratios against the fused baseline, as every row; on
CPU the foreach row includes its arithmetic, a dozen passes, so it overstates the host time it costs on a GPU).

Each sample times ``optimizer.step()`` alone; the grads it needs are put in place before it, outside the timing
(for amp, a ``scale_loss`` whose backward hands every half parameter a fixed half grad). Variants are interleaved
round by round with a rotating order; the report gives medians and the median of per-round ratios.

A second table times the whole iteration of a training loop without its forward and backward: ``zero_grad()``,
the grads handed over (for amp inside a ``scale_loss`` block, whose exit checks them and plans the step), and
``step()``, at O2/O5 beside torch's fused AdamW doing the same (``zero_grad()``, a scalar's backward standing for
the loss's, the same Python loop setting the grads, ``step()``; the backward since the fourteenth session: it was
amp's alone, so earlier figures of this table charged it to amp). This is the master step alone of
benchmarks/gpu_train_step.py, where nothing hides the host.

``--check-routes`` adds O5's iteration as it runs on CUDA, whose unscale kernel refuses bf16: the bf16 grads'
finite check by the master step's check kernel (its launch a no-op too) and by the inf-norms route it replaced
(one output tensor per grad, a ``stack`` and five small ops). On CPU the norms also do their arithmetic; on a GPU
they are launches, so this overstates what the route saves there, as the foreach row does.

``--without-kernels`` adds whole iterations against torch's fused AdamW with its own kernels no-ops too (the fused
step and the counts' ``_foreach_add_``): the host work of both sides and nothing else. On CPU tensors both run
tensor by tensor, host work a GPU's multi-tensor launches do not have, so the plain baseline overstates what
torch's step costs a GPU's host; this one does not.

``--launch-path`` adds the same iterations with amp's launches made for real: Triton's whole launch path (amp's
keys and tables, its launch path, kernels compiled for an H100) down to a stand-in CUDA launcher that records its
calls (benchmarks/_fake_driver.py). Everything but the driver's own launch of a CUDA step's host work.

``--clip`` adds clipped iterations under the same rule: O5 clipping through ``amp.clip_grad_norm_`` (the norm
from the half grads, the clip in the kernel's multiplier) and through Apex's line over ``amp.master_params``
(fp32 master grads made, clipped by torch, read by the step), against torch's fused AdamW iteration clipping its
fp32 parameters with torch's ``clip_grad_norm_``. On CPU the norms and multiplies do their arithmetic too.

``--phases`` times the launch path's iterations (``--launch-path``'s variants) by phase: ``zero_grad``, the backward
and the grads' hand-over, the ``scale_loss`` exit, the step, the phases ``gpu_train_step --profile`` times on a GPU.

    PYTHONPATH=. python benchmarks/kernel_step_host.py [--tensors 50,150,450] [--rounds 15] [--steps 20]
        [--iterations-only] [--check-routes] [--without-kernels] [--launch-path] [--clip] [--phases]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampinit import _torch_kernels, amp
from ampinit._masters import grads as grads_module
from ampinit._masters import kernel_step
from benchmarks._fake_driver import FakeDriver, fake_driver

TARGET = 1.2  # issue 24: host time of the kernel step <= 1.2x torch's fused AdamW at 150 tensors
ITERATION_AIM = 1.5  # the whole iteration's host time against torch's fused AdamW's zero_grad + step
CLIP_NORM = 1e-3  # below the benchmark grads' norm at every tensor count: every clip scales
Clip = Callable[[torch.optim.Optimizer], object]


class _NoLaunch:
    """Stands in for a ``triton.jit`` kernel: ``kernel[grid](...)`` is accepted and does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def kernel_path_without_launches() -> Iterator[None]:
    """The kernel step taken for CPU tensors, its launches no-ops; both restored on exit."""
    from ampinit._masters import triton_kernels

    kernels = ("_adam_kernel", "_sgd_kernel", "_check_kernel", "_step_scalars_kernel", "_scale_update_kernel")
    saved = kernel_step.TRITON_ON_CPU, [getattr(triton_kernels, name) for name in kernels]
    kernel_step.TRITON_ON_CPU = True
    for name in kernels:
        setattr(triton_kernels, name, _NoLaunch())
    try:
        yield
    finally:
        kernel_step.TRITON_ON_CPU = saved[0]
        for name, kernel in zip(kernels, saved[1]):
            setattr(triton_kernels, name, kernel)


@contextlib.contextmanager
def kernel_path_with_launches() -> Iterator[FakeDriver]:
    """The kernel step taken for CPU tensors with Triton's whole launch path (amp's keys and tables, Triton's binding
    or amp's launch path, the compiled kernels for an H100) down to a stand-in CUDA launcher that records its calls
    (benchmarks/_fake_driver.py, the driver yielded): the host work of a CUDA step but the driver's own launch."""
    saved = kernel_step.TRITON_ON_CPU
    kernel_step.TRITON_ON_CPU = True
    try:
        with fake_driver() as driver:
            yield driver
    finally:
        kernel_step.TRITON_ON_CPU = saved


@contextlib.contextmanager
def cuda_unscale_rule() -> Iterator[None]:
    """CPU's unscale kernel taken to refuse bf16, as CUDA's does, so O5's grads take the route they take on CUDA."""
    table = dict(_torch_kernels.KERNEL_DTYPES)
    table[_torch_kernels.UNSCALE, "cpu"] = table[_torch_kernels.UNSCALE, "cuda"]
    saved, _torch_kernels.KERNEL_DTYPES = _torch_kernels.KERNEL_DTYPES, table
    try:
        yield
    finally:
        _torch_kernels.KERNEL_DTYPES = saved


class CheckRoute:
    """An O5 iteration whose bf16 grads are checked as on CUDA (under :func:`cuda_unscale_rule`): by the master
    step's check kernel (``"kernel"``, the route since the twelfth session) or by the inf-norms it replaced."""

    def __init__(self, tensors: int, numel: int, route: str) -> None:
        self.amp_step, self.route = AmpStep("O5", tensors, numel), route

    def iteration(self) -> None:
        saved = grads_module._kernel_check
        if self.route == "norms":
            grads_module._kernel_check = lambda grads, flag, checked, keys=None: False
        try:
            self.amp_step.iteration()
        finally:
            grads_module._kernel_check = saved

    def close(self) -> None:
        self.amp_step.close()


class AmpStep:
    """An O2/O5 session over ``tensors`` half parameters (O4: fp32 ones); :meth:`prepare` leaves their grads in
    place. ``foreach``: torch's foreach AdamW (the default on CUDA), else its fused one."""

    def __init__(self, level: str, tensors: int, numel: int, foreach: bool = False, clip: Clip | None = None) -> None:
        self.clip = clip
        gen = torch.Generator().manual_seed(0)
        self.params = nn.ParameterList([nn.Parameter(torch.randn(numel, generator=gen) * 0.02) for _ in range(tensors)])
        flags = {"foreach": True} if foreach else {"fused": True}
        self.opt = torch.optim.AdamW(self.params.parameters(), lr=1e-3, **flags)
        amp.initialize(self.params, self.opt, opt_level=level, verbosity=0, loss_scale=1.0)  # type: ignore[arg-type]
        self.session = amp.current_session()
        self.weights = list(self.params)  # a plain list: iterating a ParameterList is a Python call per tensor
        half = self.weights[0].dtype
        self.grads = [torch.randn(numel, generator=gen).to(half) * 0.01 for _ in range(tensors)]
        self.anchor = torch.zeros((), requires_grad=True)

    def prepare(self) -> None:
        assert self.session is not None
        with self.session.scale_loss(self.anchor * 1.0, self.opt) as scaled:
            scaled.backward()
            for p, g in zip(self.weights, self.grads):
                p.grad = g

    def step(self) -> None:
        self.opt.step()

    def iteration(self) -> None:
        self.opt.zero_grad()
        self.prepare()
        if self.clip is not None:
            self.clip(self.opt)
        self.opt.step()

    def marked_iteration(self, mark: Callable[[], None]) -> None:
        """:meth:`iteration` (without a clip) with ``mark`` called at the end of each of :data:`PHASES`."""
        assert self.session is not None
        self.opt.zero_grad()
        mark()
        with self.session.scale_loss(self.anchor * 1.0, self.opt) as scaled:
            scaled.backward()
            for p, g in zip(self.weights, self.grads):
                p.grad = g
            mark()
        mark()
        self.opt.step()
        mark()

    def close(self) -> None:
        assert self.session is not None
        self.session.close()


class PlainStep:
    """``torch.optim.AdamW(fused=True)`` (or ``foreach=True``) on fp32 tensors of the same sizes, grads fixed."""

    def __init__(self, tensors: int, numel: int, foreach: bool = False, clip: bool = False) -> None:
        self.clip = clip
        gen = torch.Generator().manual_seed(0)
        self.params = [(torch.randn(numel, generator=gen) * 0.02).requires_grad_() for _ in range(tensors)]
        self.grads = [torch.randn(numel, generator=gen) * 0.01 for _ in range(tensors)]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, **({"foreach": True} if foreach else {"fused": True}))
        self.anchor = torch.zeros((), requires_grad=True)

    def prepare(self) -> None:
        pass

    def step(self) -> None:
        self.opt.step()

    def iteration(self) -> None:
        self.opt.zero_grad()
        (self.anchor * 1.0).backward()  # the loss's backward, a scalar's, as amp's iteration runs it
        for p, g in zip(self.params, self.grads):
            p.grad = g
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, CLIP_NORM)
        self.opt.step()

    def close(self) -> None:
        pass


def takes_kernel_path(level: str, numel: int, foreach: bool = False) -> bool:
    """Whether a step of an :class:`AmpStep` at ``level`` runs ``kernel_step.run_kernels``."""
    calls: list[object] = []
    run_kernels = kernel_step.run_kernels

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        run_kernels(*args, **kwargs)

    probe = AmpStep(level, 2, numel, foreach)
    kernel_step.run_kernels = spy
    try:
        probe.prepare()
        probe.step()
    finally:
        kernel_step.run_kernels = run_kernels
        probe.close()
    return bool(calls)


def sample(variant: Any, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``variant.step()``, each after an untimed ``prepare()``."""
    times = []
    for _ in range(steps):
        variant.prepare()
        start = time.perf_counter()
        variant.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sample_iterations(variant: Any, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``variant.iteration()``."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        variant.iteration()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_iterations(tensors: int, numel: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Whole iterations at O2/O5 against torch's fused AdamW's, interleaved as :func:`measure`'s steps."""
    variants: dict[str, Any] = {
        "torch fused AdamW": PlainStep(tensors, numel),
        "O2 iteration": AmpStep("O2", tensors, numel),
        "O5 iteration": AmpStep("O5", tensors, numel),
    }
    return _iterations(variants, rounds, steps, contextlib.nullcontext())


class PlainStepNoKernel(PlainStep):
    """:class:`PlainStep` (fused AdamW) with torch's fused kernel and its step counts' ``_foreach_add_`` no-ops
    during its step, as amp's launches are here: both sides' host work and nothing else. On CPU the fused kernel
    does its arithmetic tensor by tensor, and ``_foreach_add_`` over 0-d CPU counts is a loop of one ``add_`` per
    tensor (about 240 us of a 480 us step at 150 tensors on the development CPU), where on a GPU each is one
    multi-tensor launch: the plain baseline overstates the host time torch's step costs on a GPU. Until the
    sixteenth session the iteration table had only that baseline, and read parity (1.00x) where the H100 measured
    1.41-1.56x. (amp's own count advance, one ``add_`` on a packed tensor, stays counted.)"""

    def iteration(self) -> None:
        with _without_torch_kernels():
            super().iteration()

    def marked_iteration(self, mark: Callable[[], None]) -> None:
        """:meth:`iteration` with ``mark`` at the end of each of :data:`PHASES` (the exit's phase empty: torch's loop
        has no ``scale_loss`` block)."""
        with _without_torch_kernels():
            self.opt.zero_grad()
            mark()
            (self.anchor * 1.0).backward()
            for p, g in zip(self.params, self.grads):
                p.grad = g
            mark()
            mark()
            self.opt.step()
            mark()


@contextlib.contextmanager
def _without_torch_kernels() -> Iterator[None]:
    """torch's fused AdamW kernel and its counts' ``_foreach_add_`` no-ops inside (:class:`PlainStepNoKernel`)."""
    saved = torch._fused_adamw_, torch._foreach_add_
    torch._fused_adamw_ = torch._foreach_add_ = _no_kernel
    try:
        yield
    finally:
        torch._fused_adamw_, torch._foreach_add_ = saved


def _no_kernel(*args: Any, **kwargs: Any) -> None:
    return None


def measure_without_kernels(tensors: int, numel: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Whole iterations with no kernel on either side (under CUDA's unscale rule): torch's fused AdamW with its
    kernels no-ops against O2/O5 with their launches no-ops."""
    variants: dict[str, Any] = {"torch fused, no kernel": PlainStepNoKernel(tensors, numel)}
    variants.update({f"{level} iteration": AmpStep(level, tensors, numel) for level in ("O2", "O5")})
    return _iterations(variants, rounds, steps, cuda_unscale_rule())


def measure_launch_path(tensors: int, numel: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """:func:`measure_without_kernels` with amp's launches made for real up to the CUDA driver
    (:func:`kernel_path_with_launches`; torch's kernels still no-ops): the CPU's closest look at the host time of the
    H100 checks' master step alone."""
    with kernel_path_with_launches():
        return measure_without_kernels(tensors, numel, rounds, steps)


#: The phases of an iteration, as ``benchmarks/gpu_train_step.py --profile`` times them on a GPU (its
#: ``MASTER_PHASES``): the same names, so that the CPU's figures and the GPU checks' sit side by side.
PHASES = ("zero_grad", "backward and grads", "scale_loss exit", "step")


def measure_phases(tensors: int, numel: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Host microseconds per phase of the launch path's iterations (:func:`measure_launch_path`'s variants: torch's
    fused AdamW without its kernels, O2, O5), medians over ``rounds`` x ``steps`` iterations in a rotating order."""
    with kernel_path_with_launches(), cuda_unscale_rule():
        variants: dict[str, Any] = {"torch fused, no kernel": PlainStepNoKernel(tensors, numel)}
        variants.update({f"{level} iteration": AmpStep(level, tensors, numel) for level in ("O2", "O5")})
        try:
            samples = {name: {phase: [] for phase in PHASES} for name in variants}
            marks: list[float] = []
            names = list(variants)
            for r in range(rounds + 1):  # the first round untimed (state, caches, compilation)
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    for _ in range(steps):
                        marks.clear()
                        start = time.perf_counter()
                        variants[name].marked_iteration(lambda: marks.append(time.perf_counter()))
                        if r:
                            for phase, begin, end in zip(PHASES, [start, *marks], marks):
                                samples[name][phase].append((end - begin) * 1e6)
            return {name: {p: statistics.median(v) for p, v in phases.items()} for name, phases in samples.items()}
        finally:
            for variant in variants.values():
                variant.close()


def measure_check_routes(tensors: int, numel: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """O5 iterations with CUDA's unscale rule, the bf16 check by the kernel and by inf-norms, against torch's fused
    AdamW iteration, interleaved."""
    variants: dict[str, Any] = {
        "torch fused AdamW": PlainStep(tensors, numel),
        "O5, norms check": CheckRoute(tensors, numel, "norms"),
        "O5, kernel check": CheckRoute(tensors, numel, "kernel"),
    }
    return _iterations(variants, rounds, steps, cuda_unscale_rule())


def measure_clips(tensors: int, numel: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Clipped iterations (``CLIP_NORM``, below the grads' norm), with CUDA's unscale rule: O5 clipping through
    ``amp.clip_grad_norm_`` and through Apex's line against torch's fused AdamW iteration clipping its fp32
    parameters with torch's ``clip_grad_norm_``, interleaved."""
    variants: dict[str, Any] = {
        "torch fused + clip": PlainStep(tensors, numel, clip=True),
        "O5 + amp clip": AmpStep("O5", tensors, numel, clip=lambda opt: amp.clip_grad_norm_(opt, CLIP_NORM)),
        "O5 + Apex clip": AmpStep("O5", tensors, numel, clip=apex_clip),
    }
    return _iterations(variants, rounds, steps, cuda_unscale_rule())


def _iterations(
    variants: dict[str, Any], rounds: int, steps: int, rule: contextlib.AbstractContextManager[None]
) -> dict[str, dict[str, float]]:
    """:func:`_interleaved` whole iterations of ``variants`` under ``rule``; the variants are closed after."""
    try:
        with rule:
            return _interleaved(variants, rounds, steps, sample_iterations)
    finally:
        for variant in variants.values():
            variant.close()


def apex_clip(opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), CLIP_NORM)


def _interleaved(
    variants: dict[str, Any], rounds: int, steps: int, take: Callable[[Any, int], float]
) -> dict[str, dict[str, float]]:
    """``take`` of every variant, round by round in a rotating order, after 3 untimed ones (state, caches):
    medians, and medians of per-round ratios to the first variant."""
    names = list(variants)
    for variant in variants.values():
        take(variant, 3)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(take(variants[name], steps))
    base = samples[names[0]]
    return {
        name: {"us": statistics.median(values) * 1e6, "ratio": statistics.median(v / b for v, b in zip(values, base))}
        for name, values in samples.items()
    }


def measure(tensors: int, numel: int, rounds: int, steps: int, o4: bool = False) -> dict[str, dict[str, float]]:
    """The O2/O5 rows against torch's fused AdamW, interleaved; ``o4``: the O4 rows instead, in rounds of their own
    (torch's foreach step does real arithmetic on CPU, and between the others' samples it moved their ratios)."""
    variants: dict[str, Any] = {"torch fused AdamW": PlainStep(tensors, numel)}
    if o4:
        # At O4 the kernels stand in for a foreach optimizer, whose skip would otherwise be read on the host: the
        # host time it would have cost is torch's foreach step (plus that read).
        variants["torch foreach AdamW"] = PlainStep(tensors, numel, foreach=True)
        variants["O4 foreach kernel step"] = AmpStep("O4", tensors, numel, foreach=True)
    else:
        variants["O2 kernel step"] = AmpStep("O2", tensors, numel)
        variants["O5 kernel step"] = AmpStep("O5", tensors, numel)
    try:
        return _interleaved(variants, rounds, steps, sample)
    finally:
        for variant in variants.values():
            variant.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", default="50,150,450", help="comma-separated parameter tensor counts")
    parser.add_argument("--numel", type=int, default=256, help="elements per tensor")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per sample (the sample is their median)")
    parser.add_argument("--iterations-only", action="store_true", help="only the whole-iteration table")
    parser.add_argument(
        "--check-routes",
        action="store_true",
        help="also O5's iteration with CUDA's unscale rule: bf16 grads checked by the kernel, and by inf-norms",
    )
    parser.add_argument(
        "--without-kernels",
        action="store_true",
        help="also whole iterations against torch's fused AdamW with its kernel a no-op too (both sides' host work)",
    )
    parser.add_argument(
        "--launch-path",
        action="store_true",
        help="also those iterations with amp's launches made through Triton to a stand-in CUDA launcher",
    )
    parser.add_argument(
        "--clip",
        action="store_true",
        help="also clipped iterations (CUDA's unscale rule): O5 with amp.clip_grad_norm_ and with Apex's line",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also the launch path's iterations timed by phase (zero_grad, backward and grads, exit, step)",
    )
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.tensors.split(",")]
    torch.set_num_threads(1)  # host work is single-threaded; threads on tiny tensors only wait for each other
    with kernel_path_without_launches():
        for level, foreach in (("O2", False), ("O5", False), ("O4", True)):
            if not takes_kernel_path(level, args.numel, foreach):
                raise SystemExit(f"the {level} step did not take the kernel path: the measure would be of another")
        print(f"torch {torch.__version__}, {args.numel} elements per tensor, {args.rounds} rounds x {args.steps} steps")
        print(f"{'tensors':>8} {'variant':<24} {'us/step':>9} {'x torch':>8} {'us/tensor':>10}")
        steps_only = not args.iterations_only
        results = {n: measure(n, args.numel, args.rounds, args.steps) for n in counts if steps_only}
        o4_results = {n: measure(n, args.numel, args.rounds, args.steps, o4=True) for n in counts if steps_only}
        iterations = {n: measure_iterations(n, args.numel, args.rounds, args.steps) for n in counts}
        routes = {n: measure_check_routes(n, args.numel, args.rounds, args.steps) for n in counts if args.check_routes}
        clips = {n: measure_clips(n, args.numel, args.rounds, args.steps) for n in counts if args.clip}
        bare = {
            n: measure_without_kernels(n, args.numel, args.rounds, args.steps) for n in counts if args.without_kernels
        }
    # Outside the no-op stand-ins: the launches are made, to the stand-in driver.
    launched = {n: measure_launch_path(n, args.numel, args.rounds, args.steps) for n in counts if args.launch_path}
    phased = {n: measure_phases(n, args.numel, args.rounds, args.steps) for n in counts if args.phases}
    _print_rows(results, o4_results)
    _print_verdicts("target", results, ("O2 kernel step", "O5 kernel step"), TARGET, "torch's fused AdamW")
    print("whole iteration: zero_grad, grads handed over (amp: in a scale_loss block), step")
    print(f"{'tensors':>8} {'variant':<24} {'us/iter':>9} {'x torch':>8} {'us/tensor':>10}")
    _print_rows(iterations)
    _print_verdicts("aim", iterations, ("O2 iteration", "O5 iteration"), ITERATION_AIM, "torch's fused AdamW iteration")
    if routes:
        print("O5 iteration with CUDA's unscale rule (bf16 refused): the bf16 grads' finite check, two routes")
        print(f"{'tensors':>8} {'variant':<24} {'us/iter':>9} {'x torch':>8} {'us/tensor':>10}")
        _print_rows(routes)
    if bare:
        print("whole iterations, no kernel on either side (torch's fused step and count advance no-ops; CUDA's rule)")
        print(f"{'tensors':>8} {'variant':<24} {'us/iter':>9} {'x torch':>8} {'us/tensor':>10}")
        _print_rows(bare)
    if launched:
        print("the same, amp's launches made through Triton to a stand-in CUDA launcher (benchmarks/_fake_driver.py)")
        print(f"{'tensors':>8} {'variant':<24} {'us/iter':>9} {'x torch':>8} {'us/tensor':>10}")
        _print_rows(launched)
    if clips:
        print(f"clipped iterations (max_norm {CLIP_NORM:g}; CUDA's unscale rule): amp.clip_grad_norm_ and Apex's line")
        print(f"{'tensors':>8} {'variant':<24} {'us/iter':>9} {'x torch':>8} {'us/tensor':>10}")
        _print_rows(clips)
    if phased:
        print("the launch path's iterations by phase (us, medians; gpu_train_step --profile's phases on a GPU)")
        print(f"{'tensors':>8} {'variant':<24}" + "".join(f" {phase:>18}" for phase in PHASES) + f" {'total':>8}")
        for n, rows in phased.items():
            for name, row in rows.items():
                cells = "".join(f" {row[phase]:>18.1f}" for phase in PHASES)
                print(f"{n:>8} {name:<24}{cells} {sum(row.values()):>8.1f}")


def _print_rows(*tables: dict[int, dict[str, dict[str, float]]]) -> None:
    for table in tables:
        for n, rows in table.items():
            for name, row in rows.items():
                print(f"{n:>8} {name:<24} {row['us']:>9.1f} {row['ratio']:>8.2f} {row['us'] / n:>10.2f}")


def _print_verdicts(
    kind: str, table: dict[int, dict[str, dict[str, float]]], names: tuple[str, ...], bound: float, baseline: str
) -> None:
    """Each of ``names``' ratio at 150 tensors against ``bound`` (nothing when 150 was not measured)."""
    if 150 not in table:
        return
    for name in names:
        ratio = table[150][name]["ratio"]
        verdict = "met" if ratio <= bound else "NOT met"
        print(f"{kind} {name} <= {bound}x {baseline} at 150 tensors: {ratio:.2f}x, {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
