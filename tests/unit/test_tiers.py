"""The test tiers are folders: tests/unit/ (pure functions), tests/integration/ (record, replay and diff in this
process on tiny models) and tests/e2e/ (processes, torchrun, compiles, real models, the TUI). tests/conftest.py marks
every test under tests/e2e/ ``slow``, so that the quick tier, ``-m "not slow"``, is unit + integration."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e")


def test_every_test_module_is_in_a_tier_folder() -> None:
    outside = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")
               if p.relative_to(TESTS).parts[0] not in TIERS]
    assert outside == []


def test_test_module_names_are_unique_across_the_tiers() -> None:
    """The folders have no __init__.py: pytest imports each test module by its file name alone."""
    names = sorted(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n in set(names) if names.count(n) > 1] == []


def test_no_module_of_the_quick_tiers_marks_a_test_slow() -> None:
    """A test that needs ``slow`` belongs in tests/e2e/ (its folder marks it)."""
    marked = [p.relative_to(TESTS).as_posix() for tier in ("unit", "integration")
              for p in (TESTS / tier).glob("test_*.py") if re.search(r"mark\.slow\b", p.read_text())]
    assert marked == []


def test_the_collected_tests_marked_slow_are_exactly_those_under_e2e(request) -> None:
    """In a run that selects by marker the deselected tests are not here; in the whole suite every test is."""
    e2e = TESTS / "e2e"
    wrong = [item.nodeid for item in request.session.items
             if (item.get_closest_marker("slow") is not None) != item.path.is_relative_to(e2e)]
    assert wrong == []
