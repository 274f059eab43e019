"""Summarise a scripts/gpu_check.sh run: ``python scripts/gpu_check_summary.py OUT_DIR SUITE_RC BENCH_RC``.

Reads OUT_DIR/pytest.xml (JUnit) and OUT_DIR/gpu_train_step.json, writes OUT_DIR/summary.json and summary.md,
prints the Markdown, and exits 0 only when the suite passed and every benchmark target was met.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def suite_counts(xml_path: Path) -> dict[str, int]:
    if not xml_path.exists():
        return {}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def summarize(out: Path, suite_rc: int, bench_rc: int) -> tuple[dict[str, Any], bool]:
    bench_path = out / "gpu_train_step.json"
    bench = json.loads(bench_path.read_text()) if bench_path.exists() else None
    targets = bench["targets"] if bench else []
    ok = suite_rc == 0 and bench_rc == 0 and bool(targets)
    ok = ok and all(t["time_met"] and t["peak_memory_met"] is not False for t in targets)
    summary = {
        "ok": ok,
        "suite": {"exit_status": suite_rc, **suite_counts(out / "pytest.xml")},
        "benchmark": {"exit_status": bench_rc, "targets": targets},
        "machine": (out / "machine.txt").read_text().splitlines()[0] if (out / "machine.txt").exists() else None,
    }
    return summary, ok


def markdown(summary: dict[str, Any]) -> str:
    suite = summary["suite"]
    lines = [
        "# GPU check",
        "",
        f"machine: {summary['machine']}",
        "",
        f"suite (`pytest --device cuda`): exit {suite['exit_status']}, "
        + ", ".join(f"{k} {suite[k]}" for k in ("tests", "failures", "errors", "skipped") if k in suite),
        "",
        f"benchmark: exit {summary['benchmark']['exit_status']} (tables in gpu_train_step.md)",
        "",
        "| level | vs | time ratio | target | time | peak memory |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for t in summary["benchmark"]["targets"]:
        memory = "n/a" if t["peak_memory_met"] is None else ("met" if t["peak_memory_met"] else "NOT met")
        lines.append(
            f"| {t['level']} | {t['baseline']} | {t['time_ratio']:.3f} | <= {t['max_time_ratio']:.3f} | "
            f"{'met' if t['time_met'] else 'NOT met'} | {memory} |"
        )
    lines += ["", f"overall: {'PASS' if summary['ok'] else 'FAIL'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out, suite_rc, bench_rc = Path(argv[0]), int(argv[1]), int(argv[2])
    summary, ok = summarize(out, suite_rc, bench_rc)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    sys.stdout.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
