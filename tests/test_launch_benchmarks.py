"""The sixteenth session's host-time benchmarks measure what they name: torch's fused AdamW baseline without its
kernels runs no kernel (and leaves torch as it was), amp's iteration on the launch path makes its launches to the
stand-in driver, and ``triton_launch_host.py``'s two paths of each launch hand the launcher the same call."""

from __future__ import annotations

import pytest
import torch

from benchmarks import kernel_step_host

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")


def test_the_baseline_without_kernels_runs_none_and_puts_torch_back() -> None:
    fused, foreach = torch._fused_adamw_, torch._foreach_add_
    bare, plain = kernel_step_host.PlainStepNoKernel(3, 16), kernel_step_host.PlainStep(3, 16)
    before = [p.detach().clone() for p in bare.params]
    bare.iteration()
    assert all(torch.equal(p, b) for p, b in zip(bare.params, before))  # no update ran
    assert all(float(bare.opt.state[p]["step"]) == 0.0 for p in bare.params)  # no count advanced
    plain.iteration()  # the real one does both
    assert not all(torch.equal(p, b) for p, b in zip(plain.params, before))
    assert all(float(plain.opt.state[p]["step"]) == 1.0 for p in plain.params)
    assert (torch._fused_adamw_, torch._foreach_add_) == (fused, foreach)


def test_the_launch_path_makes_the_iterations_launches_to_the_stand_in_driver() -> None:
    with kernel_step_host.kernel_path_with_launches() as driver, kernel_step_host.cuda_unscale_rule():
        step = kernel_step_host.AmpStep("O5", 4, 64)
        try:
            for _ in range(2):
                step.iteration()
        finally:
            step.close()
        names = [call.kernel.split(":")[0] for call in driver.calls]
    # Per iteration: the finite check at the scale_loss exit, then the step scalars and the Adam step.
    assert names == ["_check_kernel", "_step_scalars_kernel", "_adam_kernel"] * 2
    assert not kernel_step_host.kernel_step.TRITON_ON_CPU  # put back


def test_both_paths_of_each_timed_launch_make_the_same_call() -> None:
    from benchmarks import triton_launch_host
    from benchmarks._fake_driver import fake_driver

    with fake_driver() as driver:
        rows = triton_launch_host.workloads(5, 64)
        for label in ("Adam", "check"):
            driver.calls.clear()
            rows[f"{label}: kernel[grid]"]()
            rows[f"{label}: triton_launch"]()
            rows[f"{label}: triton_launch"]()  # the compiled kernel kept by the first
            through_triton, first, kept = driver.calls
            assert through_triton.kernel == first.kernel == kept.kernel
            assert through_triton.grid == kept.grid and through_triton.args == kept.args


def test_the_phases_split_each_iteration_where_the_gpu_benchmark_does() -> None:
    # The CPU's per-phase figures sit beside gpu_train_step --profile's: the same phases, the exit empty for torch
    # (no scale_loss block), amp's exit holding its check and plan, and the phases summing to about an iteration.
    from benchmarks import gpu_train_step

    assert kernel_step_host.PHASES == gpu_train_step.MASTER_PHASES
    phases = kernel_step_host.measure_phases(8, 64, 1, 3)
    assert set(phases) == {"torch fused, no kernel", "O2 iteration", "O5 iteration"}
    assert all(set(row) == set(kernel_step_host.PHASES) and min(row.values()) >= 0 for row in phases.values())
    torch_row, o5 = phases["torch fused, no kernel"], phases["O5 iteration"]
    assert torch_row["scale_loss exit"] < o5["scale_loss exit"]  # an empty phase against amp's check and plan
    assert not kernel_step_host.kernel_step.TRITON_ON_CPU  # put back
