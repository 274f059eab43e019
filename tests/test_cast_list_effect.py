"""Which of Apex's extra cast-list entries change results: the benchmark's verdicts on hand-built cases, its ulp
measure, and the private hook that registers "native autocast plus a chosen few entries"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import ampinit
from ampinit._casting import kernels
from ampinit._casting.policy import CastPolicy
from benchmarks import cast_list_effect as effect

SUM_DIM = torch.ops.aten.sum.dim_IntList
NEAREST = (torch.ops.aten.upsample_nearest2d.vec, torch.ops.aten.upsample_nearest2d.default)


def _half_rows(d: torch.device, t: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(d, t)


def test_ulp_difference_counts_representable_steps() -> None:
    one = torch.tensor([1.0])
    next_up = torch.tensor([1.0 + 2.0**-7])  # bf16 keeps 7 fraction bits: the next bf16 after 1.0
    assert effect.ulp_difference(one, next_up, torch.bfloat16) == 1
    assert effect.ulp_difference(one, one + 2.0**-9, torch.bfloat16) == 0  # rounds back to 1.0
    assert effect.ulp_difference(one, one + 2.0**-9, torch.float32) == 2**14  # fp32 has 16 more fraction bits
    assert effect.ulp_difference(torch.tensor([0.0]), torch.tensor([-0.0]), torch.float16) == 0
    tiny = torch.tensor([2.0**-24])  # fp16's smallest subnormal: two steps from its negative, across zero
    assert effect.ulp_difference(tiny, -tiny, torch.float16) == 2
    nan = torch.tensor([float("nan")])
    assert effect.ulp_difference(nan, nan, torch.float16) == 0
    assert effect.ulp_difference(nan, one, torch.float16) > 2**15


def test_an_accumulating_reduction_changes_and_a_copying_op_does_not() -> None:
    # sum over 256 bf16 values: native CPU autocast returns the sum rounded to bf16, Apex's fp32 entry the fp32 sum,
    # which its fp32 consumer keeps. Nearest upsampling copies values: fp32 copies of bf16 values round back to
    # the same bits, whatever the consumer.
    probes = [
        effect.Probe("rows.sum(-1)", lambda d, t: _half_rows(d, t).sum(-1), "fp32"),
        effect.Probe("nearest x2", lambda d, t: F.interpolate(_half_rows(d, t).view(1, 1, 4, 256), scale_factor=2),
                     "fp32"),
    ]  # fmt: skip
    x = _half_rows(torch.device("cpu"), torch.bfloat16)
    assert not torch.equal(x.sum(-1).float(), x.float().sum(-1))  # the case is one where the sums differ
    entries = {SUM_DIM: "fp32", **dict.fromkeys(NEAREST, "fp32")}
    results = {r.entry: r for r in effect.op_level(torch.device("cpu"), torch.bfloat16, entries, probes)}  # type: ignore[arg-type]

    summed = results[str(SUM_DIM)]
    assert summed.verdict == "changes"
    assert [p["probe"] for p in summed.probes] == ["rows.sum(-1)"]  # reached by its probe only
    assert summed.probes[0]["max_ulp"] > 0 and summed.probes[0]["rounding"] == "float32"
    reached = [results[str(op)] for op in NEAREST if results[str(op)].probes]
    assert reached, "the nearest-upsampling probe reaches one of its overloads"
    assert all(r.verdict == "no change" and r.probes[0]["max_ulp"] == 0 for r in reached)


def test_a_native_error_the_entry_avoids_is_a_change() -> None:
    # torch.dot refuses bf16 with fp32 natively; Apex's promote entry widens the bf16 vector.
    probe = effect.Probe("dot", lambda d, t: torch.dot(torch.ones(8, dtype=t), torch.ones(8)), "fp32")
    results = effect.op_level(torch.device("cpu"), torch.bfloat16, {torch.ops.aten.dot.default: "promote"}, [probe])
    assert results[0].verdict == "changes"
    assert results[0].probes[0]["native_error"] is not None and results[0].probes[0]["error"] is None


def test_restricted_sessions_register_only_the_chosen_overloads() -> None:
    x = torch.randn(4, 8)
    with kernels.KERNELS.restricted_to([SUM_DIM]):
        policy = CastPolicy(["cpu"], torch.bfloat16, policy="apex")
        policy.activate()
    try:
        assert x.bfloat16().sum(-1).dtype == torch.float32  # the chosen entry casts
        with torch.autocast("cpu", dtype=torch.bfloat16):
            native_gelu = F.gelu(x.bfloat16()).dtype
        assert F.gelu(x.bfloat16()).dtype == native_gelu == torch.bfloat16  # the others stay native
    finally:
        policy.deactivate()
    assert kernels.KERNELS.registered() == {}
    # Outside the block, sessions register the whole plan again: Apex's gelu is fp32.
    ampinit.initialize(torch.nn.Linear(8, 8), opt_level="O4", verbosity=0)
    try:
        assert F.gelu(x.bfloat16()).dtype == torch.float32
    finally:
        ampinit.deinitialize()


def test_restriction_refuses_bad_input_and_mixed_sessions_and_restores_on_error() -> None:
    with pytest.raises(TypeError, match=r"aten overloads.*'sum'"):
        with kernels.KERNELS.restricted_to(["sum"]):  # type: ignore[list-item]
            pass
    with pytest.raises(ValueError, match="boom"), kernels.KERNELS.restricted_to([SUM_DIM]):
        with pytest.raises(RuntimeError, match="do not nest"), kernels.KERNELS.restricted_to([SUM_DIM]):
            pass
        raise ValueError("boom")
    full = CastPolicy(["cpu"], torch.bfloat16, policy="apex")
    full.activate()
    try:
        with kernels.KERNELS.restricted_to([SUM_DIM]):
            restricted = CastPolicy(["cpu"], torch.bfloat16, policy="apex")
            with pytest.raises(RuntimeError, match="restricted_to"):
                restricted.activate()
            assert not restricted.active
        assert kernels.KERNELS.registered() == {"cpu": 1}
    finally:
        full.deactivate()
    assert kernels.KERNELS.registered() == {}


def test_tiny_run_writes_the_table_naming_the_machine(tmp_path: Path) -> None:
    argv = ["--tiny", "--device", "cpu", "--dtype", "bf16", "--steps", "1", "--out", str(tmp_path)]
    assert effect.main([*argv, "--only", "sum.dim_IntList", "upsample_nearest2d"]) == 0
    report = json.loads((tmp_path / "cast_list_effect_cpu_bf16.json").read_text())
    assert report["complete"] and report["machine"].endswith(f"torch {torch.__version__}")
    assert {e["entry"] for e in report["entries"]} == {str(SUM_DIM), *map(str, NEAREST)}
    summed = next(e for e in report["entries"] if e["entry"] == str(SUM_DIM))
    assert summed["verdict"] == "changes" and summed["us_native"] and summed["us_entry"]
    assert set(summed["models"]) == set(report["models"]) and len(report["models"]) == 2
    table = (tmp_path / "cast_list_effect_cpu_bf16.md").read_text()
    assert "CPU: the default is decided on CUDA, not here." in table
    assert "`aten.upsample_nearest2d" in table.split("Candidates to leave out")[1]


def test_an_entry_that_changes_only_the_backward_changes() -> None:
    # On the CPU, layer_norm of bf16 activations with fp32 affine weights: native autocast's bf16 kernel and Apex's
    # fp32 entry round to the same bf16 output, but the fp32 weight's gradient differs (the check below shows it
    # on plain tensors); the verdict must see the backward, not only the forward.
    def ln(d: torch.device, t: torch.dtype) -> torch.Tensor:
        weight, bias = effect._rand(64, device=d, seed=1), effect._rand(64, device=d, seed=2)
        return F.layer_norm(effect._rand(8, 64, device=d, dtype=t), (64,), weight + 1, bias)

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    w = torch.ones(64, requires_grad=True)
    up = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    F.layer_norm(x, (64,), w.bfloat16()).backward(up)
    in_bf16, w.grad = w.grad, None
    F.layer_norm(x.float(), (64,), w).backward(up.float())
    assert in_bf16 is not None and w.grad is not None and not torch.equal(in_bf16, w.grad)

    entries = {torch.ops.aten.layer_norm.default: "fp32", torch.ops.aten.native_layer_norm.default: "fp32"}
    probe = effect.Probe("F.layer_norm", ln, "half")
    results = effect.op_level(torch.device("cpu"), torch.bfloat16, entries, [probe])  # type: ignore[arg-type]
    reached = [r for r in results if r.probes]
    assert reached and all(r.verdict == "changes" for r in reached)
    for row in (r.probes[0] for r in reached):
        assert row["equal"] and row["max_ulp"] == 0  # the forward is unchanged
        assert row["grad_equal"] is False and row["grad_max_ulp"] > 0


def test_op_level_hands_over_its_results_after_every_entry() -> None:
    # A run cut by the GPU check's time limit keeps the entries it finished: the caller saves after each one.
    seen: list[list[str]] = []
    probe = effect.Probe("rows.sum(-1)", lambda d, t: _half_rows(d, t).sum(-1), "fp32")
    entries = {SUM_DIM: "fp32", **dict.fromkeys(NEAREST, "fp32")}
    effect.op_level(
        torch.device("cpu"), torch.bfloat16, entries, [probe],  # type: ignore[arg-type]
        after_each=lambda results: seen.append([r.entry for r in results]),
    )  # fmt: skip
    names = [str(SUM_DIM), *map(str, NEAREST)]
    assert seen == [names[:1], names[:2], names[:3]]
