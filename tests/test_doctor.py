"""ampinit doctor: the report is measured here, and the recommendation follows the measured speedups."""

from __future__ import annotations

import pytest
import torch

from ampinit.doctor import DeviceReport, _recommend, diagnose, format_report


def device(bf16: float, fp16: float, dtypes: tuple[str, ...] = ("float16", "bfloat16")) -> DeviceReport:
    return DeviceReport("cpu", "test", list(dtypes), {}, {"bfloat16": bf16, "float16": fp16}, {})


@pytest.mark.parametrize(
    ("bf16", "fp16", "dtypes", "level"),
    [
        (3.0, 0.1, ("float16", "bfloat16"), "O5"),  # AMX-like CPU
        (1.0, 2.5, ("float16", "bfloat16"), "O1"),  # fp16-only tensor cores
        (3.0, 2.5, ("float16",), "O1"),  # bf16 fast but autocast cannot use it
        (1.05, 0.9, ("float16", "bfloat16"), "O0"),  # no low-precision units
    ],
)
def test_recommendation_follows_measurements(bf16: float, fp16: float, dtypes: tuple[str, ...], level: str) -> None:
    recommended, reason = _recommend([device(bf16, fp16, dtypes)])
    assert recommended == level
    assert f"{max(bf16, fp16) if level != 'O0' else bf16:.1f}x" in reason


def test_diagnose_measures_this_machine() -> None:
    report = diagnose(budget_s=0.2)
    assert report.torch == torch.__version__
    cpu = report.devices[0]
    assert cpu.device == "cpu" and "bfloat16" in cpu.autocast_dtypes  # CPU autocast accepts bf16 since 1.10
    assert set(cpu.matmul_ms) >= {"float32", "bfloat16"}
    for dtype, speedup in cpu.speedup_vs_fp32.items():
        assert speedup == pytest.approx(cpu.matmul_ms["float32"] / cpu.matmul_ms[dtype])
    assert cpu.fused_optimizers["AdamW"] is True  # CPU fused AdamW exists in torch >= 2.4
    text = format_report(report)
    assert f"Recommended opt level: {report.recommendation}" in text
