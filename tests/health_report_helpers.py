"""What tests/integration/test_health_report.py and tests/e2e/test_health_report_e2e.py share: a replay's JSON, the
report made from it, and the causes it names."""
from __future__ import annotations

import re
from pathlib import Path

from replaydiff.cli.main import main


def _replay_json(trace: Path, *flags: str, into: Path | None = None) -> Path:
    """The replay's JSON report, written into ``into`` (default: beside the trace)."""
    out = (into or trace.parent) / (trace.name + "-" + "-".join(f.strip("-") for f in flags) + ".json")
    main(["replay", str(trace), "--json", str(out), *flags])
    return out


def _report(trace: Path, replay: Path, capsys, *flags: str) -> str:
    capsys.readouterr()
    main(["report", str(trace), "--replay", str(replay), *flags])
    return capsys.readouterr().out


def _causes(md: str) -> list[str]:
    return re.findall(r"^### (.+)$", md.split("## Likely causes", 1)[1].split("## Environment")[0], re.M)
