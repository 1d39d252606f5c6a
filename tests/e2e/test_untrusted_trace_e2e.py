"""The fuzz test of tests/integration/test_untrusted_trace.py at a longer setting: many more crafted and damaged
files of every kind."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from untrusted_trace_helpers import fuzz_once, record_small

EXAMPLES = int(os.environ.get("REPLAYDIFF_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return record_small(tmp_path_factory.mktemp("untrusted") / "t")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_many_crafted_and_damaged_files_give_exit_0_1_or_3_and_one_line(small, data):
    fuzz_once(small, data)
