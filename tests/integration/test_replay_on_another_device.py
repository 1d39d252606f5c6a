"""Replay on another device, or at the recorded dtypes on the recording's own: ``--precision same`` runs under the
job's recorded TF32 and determinism settings (it forced TF32 off, so a TF32 step diverged on its own GPU), the other
precisions under the reference's; a random op whose draw depends on the multiprocessor count is not called divergent
on a device with another count."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff.rebuild_and_judge import fp32_precisions
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.replay.policy import random_draw_caveat

SEEN: list[tuple[str | None, bool]] = []  # (cuda matmul fp32 precision, deterministic) as each run of the op saw
# (deterministic algorithms stay on at `same` too: replay finds unwritten output positions through them)


@torch.library.custom_op("rdseam::probe", mutates_args=())
def probe(x: torch.Tensor) -> torch.Tensor:
    SEEN.append((fp32_precisions()["matmul_fp32_precision"], torch.are_deterministic_algorithms_enabled()))
    return x * 2


@probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.fixture
def tf32_trace(tmp_path: Path) -> Path:
    if fp32_precisions()["matmul_fp32_precision"] is None:
        pytest.skip("this torch has no per-backend fp32_precision API")  # torch < 2.9
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # what transformers' tf32 option sets
    try:
        with replaydiff.record(tmp_path / "t"):
            probe(torch.ones(3))
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    SEEN.clear()
    return tmp_path / "t"


@pytest.mark.parametrize("precision, expect", [("same", ("tf32", True)), ("fp64", ("ieee", True))])
def test_precision_same_runs_under_the_recorded_settings(tf32_trace: Path, precision: str, expect: tuple) -> None:
    settings_before = (fp32_precisions(), torch.are_deterministic_algorithms_enabled())
    report = replay_trace(str(tf32_trace), ReplayOptions(precision=precision))
    assert not report.found_problem
    assert SEEN and set(SEEN) == {expect}
    assert (fp32_precisions(), torch.are_deterministic_algorithms_enabled()) == settings_before  # put back


def test_a_random_draw_past_the_multiprocessor_cap_is_not_redone_on_another_count() -> None:
    # an H100 SXM (132 SMs) against an A100 (108): 108 x 2048 = 221,184 elements are drawn the same on both
    assert random_draw_caveat(221_184, 132, 108) is None
    why = random_draw_caveat(221_185, 132, 108)
    assert why is not None and "132" in why and "108" in why
    assert random_draw_caveat(10**9, 132, 132) is None  # the same count: the same mapping
    assert random_draw_caveat(10**9, None, 108) is None  # an older trace does not say: nothing to say either
