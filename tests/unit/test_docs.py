"""The documents a user reads stay true to the code: the key table is the TUI's own, links resolve, and the README
stays a short guide whose commands are the ones CI runs."""
from __future__ import annotations

import re
from pathlib import Path

from replaydiff.tui.keys import markdown_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "tests" / "bench" / "README.md"]


def test_key_table_in_docs_is_generated_from_the_keys_the_app_binds() -> None:
    text = (ROOT / "docs" / "tui.md").read_text()
    assert markdown_table() in text
    assert text.count("| key | what it does |") == 1  # one table, not a stale copy beside it
    assert "| key | what it does |" not in (ROOT / "README.md").read_text()


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_no_file_cites_a_path_outside_the_repository() -> None:
    hits = []
    for path in [*ROOT.glob("replaydiff/**/*.py"), *ROOT.glob("tui/**/*.py"), *ROOT.glob("tests/**/*.py"), *DOCS]:
        if path.name == "test_docs.py":
            continue
        if re.search(r"\.\./shared/|/work/", path.read_text()):
            hits.append(str(path.relative_to(ROOT)))
    assert hits == []


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -n 2\n"
    assert command in readme and command in ci
