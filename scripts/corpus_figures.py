"""The figures of tests/legacy_corpus (issue 25): for every file, ``--to ampinit`` clean or not, and for every file
that uses amp, ``--to torch`` migrated or refused with its reasons; the counts by reason at the end.

Run from the repository root: ``python scripts/corpus_figures.py`` (``--files`` adds one line per amp-using file).
The denominators are stated as the issue asks: every amp-using file, and the subset whose amp use has a native
torch.amp equivalent (``torch_native: "yes"`` in expectations.json, a human's reading of the file).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections import Counter
from pathlib import Path

from ampinit.migrate import migrate_source

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "legacy_corpus"


def _reason(message: str) -> str:
    """A reason without its advice: up to its first colon, or its second where the first ends a short subject
    (``amp.scale_loss: the GradScaler would be a local of main(), ...``)."""
    parts = message.split(": ")
    head = ": ".join(parts[:2]) if len(parts[0]) < 20 and len(parts) > 1 else parts[0]
    return head[:110]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="one line per amp-using file")
    files = parser.parse_args().files
    expected = json.loads((CORPUS / "expectations.json").read_text(encoding="utf-8"))
    clean = migrated = native = native_migrated = 0
    reasons: Counter[str] = Counter()
    amp_files = [name for name, e in expected.items() if "torch_native" in e]
    for name in sorted(expected):
        source = (CORPUS / name).read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old code's invalid escapes, parsed on the way
            to_ampinit = migrate_source(source, "ampinit", name)
            to_torch = migrate_source(source, "torch", name)
        clean += not to_ampinit.needs_human
        if name not in amp_files:
            continue
        is_native = expected[name]["torch_native"] == "yes"
        native += is_native
        done = not to_torch.refused and to_torch.changed
        migrated += done
        native_migrated += done and is_native
        why = sorted({_reason(s.message) for s in to_torch.needs_human}) if to_torch.refused else []
        reasons.update(why)
        if files:
            state = "migrated" if done else "refused" if to_torch.refused else "unchanged"
            print(f"{state:9} native={'yes' if is_native else 'no ':3} {name}")
            for reason in why:
                print(f"          - {reason}")
    print(f"files: {len(expected)}; --to ampinit clean: {clean}/{len(expected)}")
    print(f"amp-using files: {len(amp_files)}; --to torch migrated: {migrated}/{len(amp_files)}")
    print(f"with a native equivalent: {native}; migrated: {native_migrated}/{native}")
    print("refusals by reason (files):")
    for reason, count in reasons.most_common():
        print(f"  {count:3}  {reason}")


if __name__ == "__main__":
    main()
