"""What only a CUDA device can show: no host sync in sync-free mode under CUDA's sync-debug mode, a CUDA-graph
captured FusedAdam step, cuDNN RNNs after teardown, an NCCL job, parameters split between the CPU and CUDA,
amp.init() casting CUDA only, the fp32 interpolations that "auto" keeps for their backward, and the fused fp32
gelu reproducing CUDA's bits. Every test here skips unless the suite runs with ``--device cuda``."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from ampinit import _torch_kernels, amp
from ampinit._casting import fused_gelu
from ampinit.compat.apex import amp as apex_amp
from ampinit.optimizers import FusedAdam
from benchmarks.cast_list_effect import ulp_difference
from tests import _device, _leaks
from tests._device import requires_cuda
from tests._host_work import counted_checks
from tests.conftest import make_problem

ROOT = Path(__file__).resolve().parent.parent


def cuda_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model, x, y = make_problem()
    return model.cuda(), x.cuda(), y.cuda()


# torch says once per process that the mode is a prototype; under filterwarnings=error that notice would raise with
# the mode already switched on.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
@requires_cuda("torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_sync_free_steps_never_synchronise(level: str) -> None:
    model, x, y = cuda_problem()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp.initialize(model, opt, opt_level=level, verbosity=0, sync_free=True)
    try:
        for _ in range(2):  # the first step creates optimizer state and master-grad buffers: warm up
            opt.zero_grad()
            with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
        previous = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("error")
            for _ in range(3):
                opt.zero_grad()
                with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
                    scaled.backward()
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    finally:
        amp.deinitialize()


def test_leak_check_sees_a_sync_debug_mode_left_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that leaves CUDA's sync-debug mode on fails every later CUDA test of its process: the leak check of a
    CUDA run names it. (On CPU, a stand-in for the mode's getter.)"""
    mode = [0]
    monkeypatch.setattr(_device, "_chosen", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    before = _leaks.snapshot()
    mode[0] = 2
    assert _leaks.differences(before, _leaks.snapshot()) == ["CUDA sync-debug mode: 0 -> 2"]


@requires_cuda("CUDA graphs")
def test_capturable_fused_adam_step_replays_in_a_cuda_graph() -> None:
    torch.manual_seed(0)
    params = [
        torch.randn(64, 32, device="cuda", requires_grad=True),
        torch.randn(32, device="cuda", requires_grad=True),
    ]
    reference = [p.detach().clone().requires_grad_() for p in params]
    grads = [torch.randn_like(p) for p in params]
    opt = FusedAdam(params, lr=1e-2, capturable=True)
    ref_opt = torch.optim.Adam(reference, lr=1e-2)
    for p, r, g in zip(params, reference, grads):
        p.grad, r.grad = g.clone(), g.clone()
    # Warm up on a side stream (creates the state), then capture one step and replay it.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    ref_opt.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(4):
        graph.replay()
        ref_opt.step()
    torch.cuda.synchronize()
    for p, r in zip(params, reference):
        torch.testing.assert_close(p, r)


@requires_cuda("cuDNN RNN weight buffers")
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_cudnn_rnn_runs_without_warnings_after_teardown(rnn: type[nn.RNNBase]) -> None:
    model = rnn(8, 16, num_layers=2).cuda()
    x = torch.randn(5, 3, 8, device="cuda")
    amp.initialize(model, opt_level="O2", verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)
        amp.deinitialize()
        out, _ = model(x)  # "not part of single contiguous chunk of memory" would be an error here
    assert out.dtype == torch.float32


@requires_cuda("NCCL")
def test_ddp_example_with_nccl_on_one_gpu() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
        "--master_port=29517", "examples/distributed/train_ddp.py", "--opt-level", "O2", "--steps", "20",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert re.search(r"rank 0 of 1: parameter checksum -?[0-9]", result.stdout), result.stdout


@requires_cuda("parameters on the CPU and on CUDA")
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_model_split_across_cpu_and_cuda_matches_fp32(level: str) -> None:
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cpu_part = nn.Linear(8, 16)
            self.cuda_part = nn.Linear(16, 4).cuda()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cuda_part(torch.relu(self.cpu_part(x.cpu())).cuda())

    torch.manual_seed(0)
    model = Split()
    reference = copy.deepcopy(model)
    x, y = torch.randn(32, 8), torch.randn(32, 4, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    try:
        for _ in range(5):
            opt.zero_grad()
            with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
    finally:
        amp.deinitialize()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert p.device == r.device
        torch.testing.assert_close(p.float(), r, rtol=3e-2, atol=3e-2)


@requires_cuda("a CPU/CUDA copy of the loss scale")
def test_unscale_is_exact_with_grads_and_scale_on_different_devices() -> None:
    gen = torch.Generator().manual_seed(0)
    for grad_device, scale_device in (("cpu", "cuda"), ("cuda", "cpu")):
        grads = [torch.randn(1000, generator=gen).to(grad_device) * 2.0**10 for _ in range(4)]
        expected = [g.cpu() * 2.0**-10 for g in grads]  # a power of two: exact
        grads[-1][7] = float("inf")
        expected[-1][7] = float("inf")
        found_inf = torch.zeros(1, device=scale_device)
        _torch_kernels.unscale_and_check_(grads, found_inf, torch.full((), 2.0**-10, device=scale_device))
        assert found_inf.item() == 1.0
        for g, e in zip(grads, expected):
            assert torch.equal(g.cpu(), e)


@requires_cuda("amp.init() on a GPU machine")
def test_amp_init_casts_cuda_and_leaves_the_cpu_alone() -> None:
    handle = apex_amp.init()
    try:
        assert torch.is_autocast_enabled("cuda")
        assert not torch.is_autocast_enabled("cpu")  # Apex only ever cast CUDA tensors
    finally:
        handle._deactivate()


@requires_cuda("the half-dtype atomics of CUDA's interpolation backward")
@pytest.mark.parametrize(
    ("mode", "dims", "antialias"),
    [("linear", 1, False), ("bilinear", 2, False), ("bilinear", 2, True), ("bicubic", 2, False),
     ("bicubic", 2, True), ("trilinear", 3, False)],
)  # fmt: skip
def test_auto_keeps_apex_fp32_interpolation_whose_cuda_backward_rounds_in_half(
    mode: str, dims: int, antialias: bool
) -> None:
    """Under the default ``cast_policy="auto"`` these interpolations still run in fp32, as Apex ran them: CUDA's
    half backward adds each output's share into the input gradient with atomics in the half dtype, so only the fp32
    entry gives Apex's gradient (fp32 sums rounded once; the fp32 atomics' order may move a rounding by one ulp)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *[9] * dims, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    options = {"antialias": True} if antialias else {}
    amp.initialize(nn.Linear(2, 2).cuda(), opt_level="O4", verbosity=0)
    try:
        y = nn.functional.interpolate(x, scale_factor=2, mode=mode, **options)
        upstream = torch.randn(y.shape, generator=gen).to("cuda", torch.bfloat16)
        y.backward(upstream.to(y.dtype))
    finally:
        amp.deinitialize()
    assert y.dtype == torch.float32  # Apex's fp32 entry, not native autocast's bf16 kernel
    reference = x.detach().float().requires_grad_()
    nn.functional.interpolate(reference, scale_factor=2, mode=mode, **options).backward(upstream.float())
    assert x.grad is not None and reference.grad is not None
    assert ulp_difference(x.grad, reference.grad.to(torch.bfloat16), torch.bfloat16) <= 1


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, any NaN equal to any NaN."""
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return bool(((a.view(as_int) == b.view(as_int)) | (a.isnan() & b.isnan())).all())


@requires_cuda("the fused fp32 gelu is exact only where it reproduces CUDA's kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_fused_fp32_gelu_is_taken_only_where_it_gives_torchs_bits(dtype: torch.dtype) -> None:
    """Whatever this GPU's check decides, a gelu gives torch's bits: where the check took a variant, the fused
    kernels on fresh inputs (a large random tensor with the dtype's extremes, a random upstream grad) equal
    ``gelu(x.float())`` and its backward rounded to half; where it took none, the fused path declines (Apex's
    unfused gelu runs). Which it is goes into the report (the GPU check's "Apex's fp32 gelu" lines): on the H200
    check of 2026-11-27 (torch 2.11+cu130, Triton 3.6) no variant matched, libdevice's erff differing from the
    erff of torch's build by one ulp for x in about [-1.7, -1.4]."""
    device = torch.device("cuda", torch.cuda.current_device())
    fused_gelu.forget()
    try:
        choice = fused_gelu.decide(device, dtype)
        generator = torch.Generator().manual_seed(3)
        x = (torch.randn(1 << 20, generator=generator) * 4).to(dtype)
        info = torch.finfo(dtype)
        x[:6] = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0]).to(dtype)
        x = x.to(device)
        dy = torch.randn(x.shape, generator=generator).to(device)
        wide = x.float()
        expected_y = torch.ops.aten.gelu.default(wide)
        expected_dx = torch.ops.aten.gelu_backward.default(dy, wide).to(dtype)
        if choice is None:
            assert fused_gelu.gelu(x, "none") is None
            assert fused_gelu.status()[f"{device} {str(dtype).removeprefix('torch.')}"] == "unfused"
            return
        leaf = x.clone().requires_grad_()
        y = fused_gelu.gelu(leaf, "none")
        assert y is not None and y.dtype == torch.float32
        y.backward(dy)
        assert leaf.grad is not None
        assert _same_bits(y, expected_y) and _same_bits(leaf.grad, expected_dx), choice
    finally:
        fused_gelu.forget()


def _train_gelu_net(monkeypatch: pytest.MonkeyPatch, *, fused: bool) -> list[torch.Tensor]:
    if not fused:
        monkeypatch.setattr(fused_gelu, "gelu", lambda x, approximate: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O4", cast_policy="apex", verbosity=0)
    data = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).cuda()
    try:
        for _ in range(3):
            opt.zero_grad()
            with amp.scale_loss(model(data).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
    finally:
        amp.deinitialize()
        monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()]


@requires_cuda("the fused fp32 gelu runs on CUDA only")
def test_o4_with_apex_lists_trains_as_apexs_unfused_gelu_through_what_the_check_decided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """O4 with Apex's lists trains bit for bit as with Apex's unfused fp32 gelu, and takes the fused kernels exactly
    where this GPU's check took a variant for bf16 (on the H200 check of 2026-11-27: nowhere)."""
    applied: list[object] = []
    apply = fused_gelu._apply_fused
    fused_gelu.forget()
    try:
        with pytest.MonkeyPatch.context() as patch:  # the training's fused calls (the check's own runs are not)
            patch.setattr(fused_gelu, "_apply_fused", lambda *a: applied.append(a) or apply(*a))
            fused = _train_gelu_net(monkeypatch, fused=True)
        device = f"cuda:{torch.cuda.current_device()}"
        taken = fused_gelu.status()[f"{device} bfloat16"].startswith("fused")
        unfused = _train_gelu_net(monkeypatch, fused=False)
    finally:
        fused_gelu.forget()
    for got, want in zip(fused, unfused, strict=True):
        assert torch.equal(got, want)
    assert bool(applied) == taken, (len(applied), fused_gelu.status())


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
@requires_cuda("torch.cuda.set_sync_debug_mode")
def test_an_unchecked_gelu_under_sync_debug_mode_takes_the_unfused_path_without_a_sync() -> None:
    fused_gelu.forget()
    x = torch.randn(8, 8, device="cuda").to(torch.bfloat16)
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        assert fused_gelu.gelu(x, "none") is None
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert fused_gelu.status() == {}  # left undecided: the first call outside the mode checks


@requires_cuda("torch's unscale kernel refusing bf16 (CUDA's rule)")
@pytest.mark.parametrize("master_weights", [True, "remainder"], ids=["fp32-masters", "remainder"])
def test_o5_checks_bf16_grads_in_the_kernels_one_launch_and_still_skips_an_overflow(
    master_weights: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the grads' finite check is the master step's Triton kernel, not inf-norms: one launch per backward
    for the bf16 weights' grads and one for BatchNorm's fp32 ones, no ``_foreach_norm``; an inf in the batch still
    raises the flag and the step is skipped."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ampinit._masters import triton_kernels

    launches = counted_checks(triton_kernels, monkeypatch)
    norms: list[str] = []

    class Norms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.__name__.startswith(("_foreach_norm", "linalg_vector_norm")):
                norms.append(func.__name__)
            return func(*args, **(kwargs or {}))

    model, x, y = cuda_problem()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O5", master_weights=master_weights, verbosity=0)
    try:
        stepped = []
        for step in range(3):
            batch = x.clone()
            if step == 1:
                batch[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(batch).float(), y)
            with Norms(), amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            stepped.append(not all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        assert stepped == [True, False, True]
        half = sum(p.dtype == torch.bfloat16 for p in model.parameters())
        assert launches == [half, 2] * 3 and norms == []  # BatchNorm's weight and bias stay fp32
    finally:
        amp.deinitialize()
