"""Summarise a scripts/gpu_check.sh run:

    python scripts/gpu_check_summary.py OUT_DIR SUITE_RC BENCH_RC [--limits suite=S,bench=S] [--seconds ...]

Reads OUT_DIR/logs: pytest.xml (JUnit, partial when the run was cut), pytest.txt (how many tests were collected,
and the counts when no JUnit file was written), gpu_train_step.json (partial when cut) and machine.txt. Writes
OUT_DIR/summary.json, summary.md and verdict.txt (one line: the suite's counts and each performance target met, not
met or not measured, with its figure), prints the Markdown and then the verdict, and exits 0 only when the suite
passed whole and every target was met.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# The names of the benchmark's targets (benchmarks/gpu_train_step.TARGETS, in its order; a test keeps the two
# equal), so that a run whose benchmark wrote nothing still lists each target as not measured: this script must
# not need torch to say so.
_O2 = ("O2 AdamW foreach", "O2 AdamW fused", "O2 FusedAdam")
_O5 = ("O5 AdamW foreach", "O5 AdamW fused", "O5 FusedAdam")
_DIAL = ("O5 remainder + 8bit", "O5 remainder8 + 8bit", "O5 stochastic + 8bit")
_BF16, _FP16 = "native autocast bf16", "native autocast fp16 + GradScaler"
TARGET_NAMES = (
    *(f"{name} speed >= 1.08x {_BF16}" for name in _O5),
    f"O5 remainder speed >= 1.05x {_BF16}",
    *(f"{name} speed >= 1.08x {_FP16}" for name in _O2),
    f"O1 time <= 1.03x {_FP16}",
    f"O4 time <= 1.03x {_BF16}",
    f"O1 Apex lists time <= 1.1x {_FP16}",
    f"O4 Apex lists time <= 1.1x {_BF16}",
    *(f"{name} peak memory <= {_FP16}" for name in _O2),
    *(f"{name} peak memory <= {_BF16}" for name in _O5),
    "O5 remainder + bf16 state peak memory <= pure bf16 + 2 B/param",
    "O5 remainder peak memory <= pure bf16 + 6 B/param",
    "O5 remainder + clip peak memory <= pure bf16 + 6 B/param",
    *(
        f"{name} host syncs per step <= 0"
        for name in (
            "O1",
            "O2 AdamW fused",
            "O4",
            *_O5,
            "O1 sync_free",
            "O2 sync_free",
            "O4 AdamW foreach",
            "O5 remainder + bf16 state",
            "O5 AdamW fused + clip",
            "O5 remainder + clip",
        )
    ),
    "O2 host decision host syncs per step <= 1",
    *(f"{name} time <= 1.05x O5 AdamW fused" for name in _DIAL),
    f"O5 AdamW fused + clip speed >= 1.08x {_BF16} + clip",
    f"O5 remainder + clip speed >= 1.05x {_BF16} + clip",
    "O2 master step <= 1.1x plain fused AdamW (fp32)",
    "O5 master step <= 1.1x plain fused AdamW (fp32)",
)
TIMED_OUT = (124, 137)  # timeout(1): the limit was reached (SIGINT sent), or it had to kill after KILL_AFTER
MAX_FAILURES_LISTED = 200


def junit(xml_path: Path) -> tuple[dict[str, int], list[str]]:
    """Counts (tests, failures, errors, skipped, passed) and one ``id: reason`` line per failure or error."""
    if not xml_path.exists():
        return {}, []
    try:
        root = ET.parse(xml_path).getroot()
    except ET.ParseError:
        return {}, []
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failures = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            for problem in case.findall(kind):
                reason = (problem.get("message") or problem.text or "").strip().splitlines()
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failures.append(f"{kind.upper()} {name}: {reason[0] if reason else '(no message)'}")
    return counts, failures


def terminal_counts(text: str) -> dict[str, int]:
    """The counts of pytest's last summary line ("3 failed, 10 passed, 2 skipped in 5.0s"), when no JUnit file
    was written (the run was killed, or crashed)."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1])}
    counts = {
        "passed": found.get("passed", 0),
        "failures": found.get("failed", 0),
        "errors": found.get("error", 0) + found.get("errors", 0),
        "skipped": found.get("skipped", 0),
    }
    counts["tests"] = sum(counts.values())
    return counts


def collected(text: str) -> int | None:
    """How many tests the run had to do (pytest-xdist prints "N workers [M items]"; plain pytest "collected M
    items")."""
    match = re.search(r"\[(\d+) items?\]", text) or re.search(r"collected (\d+) items?", text)
    return int(match.group(1)) if match else None


def suite_summary(logs: Path, rc: int, limit: int | None, seconds: int | None) -> dict[str, Any]:
    text = (logs / "pytest.txt").read_text(errors="replace") if (logs / "pytest.txt").exists() else ""
    counts, failures = junit(logs / "pytest.xml")
    source = "junit"
    if not counts:
        counts, source = terminal_counts(text), "terminal"
    if not counts:
        source = "none"
    total = collected(text)
    state = "complete"
    if rc in TIMED_OUT:
        state = "cut"
    elif rc not in (0, 1):
        # 0/1: pytest finished (1: some tests failed); anything else is an interrupted or crashed run
        state = "crashed"
    elif source == "none":
        state = "gave no results"
    elif total is not None and counts.get("tests", 0) < total:
        state = "incomplete"
    return {
        "exit_status": rc,
        "state": state,
        "counts_from": source,
        "collected": total,
        "seconds": seconds,
        "limit_s": limit,
        **counts,
        "failure_list": failures,
        "last_lines": text.splitlines()[-5:],
    }


def bench_summary(logs: Path, rc: int) -> dict[str, Any]:
    path = logs / "gpu_train_step.json"
    report: dict[str, Any] | None = None
    if path.exists():
        try:
            report = json.loads(path.read_text())
        except json.JSONDecodeError:
            report = None
    judged = {v["target"]: v for v in (report or {}).get("verdicts", [])}
    why = "no benchmark results" if report is None else "not in the benchmark's report"
    targets = [
        judged.get(name, {"target": name, "status": "not measured", "figure": "", "why": why}) for name in TARGET_NAMES
    ]
    failed_rows = [
        f"{name}: {row[key]}"
        for name, row in (report or {}).get("rows", {}).items()
        for key in ("error", "memory_error")
        if row.get(key)
    ]
    return {
        "exit_status": rc,
        "complete": bool(report and report.get("complete")),
        "judged": bool(report and report.get("judged")),
        "targets": targets,
        "failed_variants": failed_rows,
        # Apex's fp32 gelu (O1/O4 with Apex's lists): fused or not per device and dtype, as the check decided.
        "fused_gelu": (report or {}).get("fused_gelu", {}),
    }


def target_text(t: dict[str, Any]) -> str:
    text = f"{t['target']}: {t['status']}"
    details = [part for part in (t.get("figure"), t.get("why")) if part]
    return text + (f" ({'; '.join(details)})" if details else "")


def suite_text(suite: dict[str, Any]) -> str:
    if suite["counts_from"] == "none":
        return f"no counts (the suite {suite['state']}, exit {suite['exit_status']})"
    text = f"{suite['passed']} passed, {suite['failures']} failed, {suite['errors']} errors, {suite['skipped']} skipped"
    if suite["collected"] is not None:
        text += f" of {suite['collected']} collected"
    if suite["state"] == "cut":
        text += f" (cut at the {suite['limit_s']} s limit)"
    elif suite["state"] != "complete":
        text += f" ({suite['state']}, exit {suite['exit_status']})"
    return text


def summarize(
    out: Path, suite_rc: int, bench_rc: int, limits: dict[str, int], seconds: dict[str, int]
) -> dict[str, Any]:
    logs = out / "logs"
    suite = suite_summary(logs, suite_rc, limits.get("suite"), seconds.get("suite"))
    bench = bench_summary(logs, bench_rc)
    suite_ok = suite["state"] == "complete" and suite_rc == 0 and suite.get("tests", 0) > 0
    targets_ok = all(t["status"] == "met" for t in bench["targets"])
    ok = suite_ok and targets_ok and bench_rc == 0
    machine = (logs / "machine.txt").read_text().splitlines() if (logs / "machine.txt").exists() else []
    host = next((text for text in machine if text.startswith("host speed:")), None)
    verdict = " | ".join(
        [
            f"gpu_check verdict: {'PASS' if ok else 'FAIL'}",
            f"suite: {suite_text(suite)}",
            *(target_text(t) for t in bench["targets"]),
        ]
    )
    return {
        "ok": ok,
        "machine": machine[0] if machine else None,
        "host": host,
        "suite": suite,
        "benchmark": bench,
        "verdict": verdict,
    }


def markdown(summary: dict[str, Any]) -> str:
    suite, bench = summary["suite"], summary["benchmark"]
    lines = [
        "# GPU check",
        "",
        f"machine: {summary['machine']}",
        "",
        f"{summary['host'] or 'host speed: not recorded'} (scripts/host_speed.py: read O2/O5's figures against it)",
        "",
        f"suite (`pytest --device cuda`): {suite_text(suite)}; exit {suite['exit_status']}, {suite['seconds']} s",
        "",
    ]
    if suite["failure_list"]:
        listed = suite["failure_list"][:MAX_FAILURES_LISTED]
        lines += ["## Failures", "", *(f"- {line}" for line in listed)]
        if len(suite["failure_list"]) > len(listed):
            lines.append(f"- ... {len(suite['failure_list']) - len(listed)} more in pytest.txt")
        lines.append("")
    if suite["counts_from"] != "junit":
        lines += ["## Last lines of pytest.txt", "", "```", *suite["last_lines"], "```", ""]
    lines += [
        f"benchmark: exit {bench['exit_status']}, {'complete' if bench['complete'] else 'partial'} "
        "(tables in gpu_train_step.md, in gpu_check_logs.tar.gz)",
        "",
        *(f"- failed variant {row}" for row in bench["failed_variants"]),
        "",
        "## Targets (issue 24)",
        "",
        *(f"- {target_text(t)}" for t in bench["targets"]),
        "",
    ]
    if bench["fused_gelu"]:
        lines += [
            "## Apex's fp32 gelu (O1/O4 with Apex's lists)",
            "",
            *(f"- {where}: {decision}" for where, decision in bench["fused_gelu"].items()),
            "",
        ]
    lines.append(f"overall: {'PASS' if summary['ok'] else 'FAIL'}")
    return "\n".join(lines) + "\n"


def _pairs(text: str) -> dict[str, int]:
    return {key: int(value) for key, value in (item.split("=", 1) for item in text.split(",") if item)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Summarise a scripts/gpu_check.sh run")
    parser.add_argument("out", type=Path)
    parser.add_argument("suite_rc", type=int)
    parser.add_argument("bench_rc", type=int)
    parser.add_argument("--limits", type=_pairs, default={}, help="suite=S,bench=S: the time limits applied")
    parser.add_argument("--seconds", type=_pairs, default={}, help="suite=S,bench=S: how long each half ran")
    args = parser.parse_args(argv)
    summary = summarize(args.out, args.suite_rc, args.bench_rc, args.limits, args.seconds)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = markdown(summary)
    (args.out / "summary.md").write_text(text)
    (args.out / "verdict.txt").write_text(summary["verdict"] + "\n")
    sys.stdout.write(text + "\n" + summary["verdict"] + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
