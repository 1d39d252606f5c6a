"""The filter of trend's zoom-in holds the op it names as the cause and the first change, wherever they are: the
record --module/--op rule (an op must match both, and --module selects no op outside a module) decides which filter
can (the end-to-end path: tests/integration/test_trend_nan_zoom.py)."""
from __future__ import annotations

import pytest

from replaydiff.record.options import in_filter
from replaydiff.trend.analysis import Cause, Change, Zoom


def change(module: str | None, op: str = "aten.addmm.default", step: int = 17) -> Change:
    return Change(step=step, module=module, op=op, index=1524, phase="forward", statistic="l2", score=720.0,
                  value=1.4e37, baseline=13.5)


def cause(module: str | None, op: str = "aten.mul.Tensor", step: int = 17, args_since: int | None = None) -> Cause:
    return Cause(step=step, index=1522, op=op, module=module, phase="forward", source="nanloop.py:11", how="made",
                 statistic="l2", value=1.2e37, baseline=11.2, history=0, args_since=args_since)


@pytest.mark.parametrize("first, why", [
    (change("Sequential.0"), cause(None)),  # a mul in the training loop, read by a module's addmm
    (change("Sequential.0"), cause("Sequential.2", op="aten.relu.default")),  # two modules
    (change("Sequential.0"), cause("Sequential.0", op="aten.t.default")),  # one module
    (change(None, op="aten.mse_loss.default"), cause("Sequential.3", op="aten.addmm.default")),  # first in none
    (change("Sequential.0"), None),  # no cause found
], ids=["cause-in-no-module", "two-modules", "same-module", "first-in-no-module", "no-cause"])
def test_the_zoom_in_selects_the_cause_and_the_first_change(first, why):
    z = Zoom.of(first, why)
    assert (z.steps, z.step) == ("16-17", 17)
    for place in [(first.module, first.op)] + ([] if why is None else [(why.module, why.op)]):
        assert in_filter(place[1], place[0], z.modules, z.ops), (place, z)
    assert (z.modules is None) != (z.ops is None)  # one filter, the one the printed command gives
    if z.modules is not None:
        assert len(z.modules) == len(set(z.modules)) <= 2
    else:  # an op outside any module: selected by name, never by --module
        assert first.module is None or (why is not None and why.module is None)


def test_an_update_whose_arguments_changed_a_step_before_is_zoomed_at_that_step_without_the_later_change():
    """The first change shows at step 13, the learning rate changed at 12: the zoom-in is of 11-12 and holds the
    optimizer op; the first change, at step 13, is in neither step."""
    z = Zoom.of(change("Sequential.0", step=13), cause(None, op="aten.add_.Tensor", step=13, args_since=12))
    assert (z.steps, z.modules, z.ops) == ("11-12", None, ["aten.add_.Tensor"])


def test_a_gradient_rises_only_above_twice_its_window_s_highest():
    """The healthy seq2seq's backward tanh (a new-user trial): its l2 at step 48 was 5x its window's median, z 12.2,
    but 1.4x its highest: no change for a gradient; the same values in an output are one, and a gradient 10x over its
    highest is one."""
    from replaydiff.trend.analysis import score_point

    def pt(v: float) -> dict[str, float]:
        return {"l2": v, "absmax": v, "nan": 0.0, "inf": 0.0}

    past = [pt(v) for v in (1.16e-4, 1.19e-4, 1.26e-4, 1.14e-4, 2.38e-4, 1.13e-4, 0.906e-4, 4.56e-4, 3.33e-4,
                            1.35e-4)]
    now = pt(6.28e-4)
    assert score_point(now, past, 12.0, gradient=True) is None
    hit = score_point(now, past, 12.0, gradient=False)
    assert hit is not None and hit[0] == "l2" and hit[1] >= 12, hit
    assert score_point(pt(4.6e-3), past, 12.0, gradient=True) is not None

