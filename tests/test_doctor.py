"""ampinit doctor: the report is measured here, and the recommendation follows the measured figures."""

from __future__ import annotations

import json

import pytest
import torch

from ampinit.cli import main
from ampinit.doctor import DeviceReport, _recommend, diagnose, format_report


def device(
    bf16: float, fp16: float, dtypes: tuple[str, ...] = ("float16", "bfloat16"), probe: float = 1.0
) -> DeviceReport:
    return DeviceReport(
        "cpu",
        "test",
        list(dtypes),
        {},
        {},
        {"bfloat16": bf16, "float16": fp16},
        {"matmul": 1.0, "conv fwd+bwd": probe},
        {},
    )


@pytest.mark.parametrize(
    ("bf16", "fp16", "dtypes", "probe", "level", "says"),
    [
        (1.4, 0.03, ("float16", "bfloat16"), 48.0, "O5", "ran 1.40x as fast with bf16"),  # AMX CPU, emulated fp16
        (1.0, 2.5, ("float16", "bfloat16"), 1.0, "O1", "ran 2.50x as fast with fp16"),  # fp16-only tensor cores
        (3.0, 2.5, ("float16",), 1.0, "O1", "ran 2.50x as fast with fp16"),  # bf16 fast, autocast cannot use it
        (1.05, 0.9, ("float16", "bfloat16"), 1.0, "O0", "bf16 (1.05x) or fp16 (0.90x)"),  # nothing clearly faster
        (1.0, 1.5, ("float16", "bfloat16"), 48.0, "O0", "conv fwd+bwd 48.0x"),  # fp16 fast for matmuls only
    ],
)
def test_recommendation_follows_measurements(
    bf16: float, fp16: float, dtypes: tuple[str, ...], probe: float, level: str, says: str
) -> None:
    recommended, reason = _recommend([device(bf16, fp16, dtypes, probe)])
    assert recommended == level
    assert says in reason
    assert ("avoid O1-O3" in reason) == (probe > 2.0)


def test_diagnose_measures_this_machine() -> None:
    report = diagnose(budget_s=0.1)
    assert report.torch == torch.__version__
    cpu = report.devices[0]
    assert cpu.device == "cpu" and "bfloat16" in cpu.autocast_dtypes  # CPU autocast accepts bf16 since 1.10
    assert set(cpu.step_ms) == {"float32", *cpu.autocast_dtypes}
    assert set(cpu.speedup_vs_fp32) == set(cpu.autocast_dtypes)
    assert set(cpu.fp16_probe) == {"matmul", "conv fwd+bwd"}
    assert all(ms > 0 for ms in cpu.step_ms.values())
    assert cpu.fused_optimizers["AdamW"] is True  # CPU fused AdamW exists in torch >= 2.4
    text = format_report(report)
    assert f"Recommended opt level: {report.recommendation}" in text
    assert "training step   :" in text and "fp16 time / fp32: matmul" in text
    if report.cpu_flags:
        assert "avx512_bf16" in text and "amx_bf16" in text and "avx512_fp16" in text and "amx_fp16" in text
    assert ("THIS MACHINE IS BUSY" in text) == bool(report.busy)


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--budget", "0.1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["cpu_flags"]) <= {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}
    assert data["recommendation"] in ("O0", "O1", "O5")
