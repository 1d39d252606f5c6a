"""The terminal UI coloured by a batch-invariance check (`replaydiff tui TRACE --invariance`): the batch-variant op
is the one red row, and `f` walks to it."""
from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

import replaydiff
from replaydiff.invariance import check_invariance
from replaydiff.trace import open_trace

textual = pytest.importorskip("textual")

from replaydiff.tui.app import make_app  # noqa: E402
from replaydiff.tui.model import invariance_rows  # noqa: E402


@torch.library.custom_op("invtui::batch_scaled", mutates_args=())
def batch_scaled(x: torch.Tensor) -> torch.Tensor:
    """Scales by a factor that follows the number of rows it is given."""
    return x * (1 + 1e-6 * x.shape[0])


@batch_scaled.register_fake
def _(x):
    return torch.empty_like(x)


def test_the_batch_variant_op_is_the_red_row_and_f_walks_to_it(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        a, x = nn.Linear(16, 16), torch.randn(4, 8, 16)
        with replaydiff.record(tmp_path / "t"), torch.no_grad():
            torch.ops.invtui.batch_scaled(a(x)).sum()
        rt = open_trace(tmp_path / "t").rank(0)
        planted = next(op.index for op in rt if op.name == "invtui.batch_scaled.default")
        rows = invariance_rows(check_invariance(rt))
    finally:
        torch.set_num_threads(before)

    async def drive():
        app = make_app(tmp_path / "t", rows=rows)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            await app.workers_done()
            await pilot.pause()
            assert app.replay_state == "report"
            assert app.model.divergent == [planted]
            await pilot.press("f")
            await pilot.pause()
            assert app.selected_op == planted

    asyncio.run(drive())
