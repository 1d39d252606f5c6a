"""NaN/Inf a model makes and then selects away are no origin: replay follows them forward through the ops that read
them and reports only those that reach the loss, a gradient, a parameter or an output of the step.

T5's relative-position bucketing takes log(0) and a where then picks other values: every T5 step makes -inf and
discards it. A NaN planted below the recorder in the same model reaches the loss and is still named at the op that
made it. Op numbers are read back from the trace, never typed in.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import replay_helpers as rh
from replaydiff.cli.main import main
from replaydiff.faults import PlantedFault
from replaydiff.record import record
from replaydiff.trace import open_trace
from replaydiff.trend import compute_trend

_NEVER_KEPT = "so they reach no loss, gradient, parameter or output of the step (information, not a fault)"


def _replay_cli(path: Path, capsys) -> tuple[int, str, dict, str]:
    """replay (text and JSON) and the health report read from that JSON: (exit code, replay text, JSON, report)."""
    capsys.readouterr()
    code = main(["replay", str(path), "--json", str(path.parent / "replay.json")])
    text = capsys.readouterr().out
    main(["report", str(path), "--replay", str(path.parent / "replay.json")])
    return code, text, json.loads((path.parent / "replay.json").read_text()), capsys.readouterr().out


def _nonfinite_row(report_md: str) -> str:
    return next(line for line in report_md.splitlines() if line.startswith("| NaN/Inf origin |"))


# -- the rule on hand-made steps ------------------------------------------------------------------------------------
def test_log_of_zero_selected_away_by_where_is_made_and_discarded(tmp_path, capsys):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    with record(tmp_path / "t"):
        (w * torch.where(x > 0, torch.log(x), torch.zeros_like(x))).sum().backward()
    ops = rh.trace_ops(tmp_path / "t")
    log = next(op for op in ops if op.name == "aten.log.default")
    where = next(op for op in ops if op.name == "aten.where.self")
    report = rh.replay(tmp_path / "t")
    assert report.nonfinite_origin is None and report.nonfinite_entry is None
    assert [(r.index, r.nonfinite_discarded_by) for r in report.nonfinite_discarded] == [(log.index, [where.index])]
    code, text, doc, md = _replay_cli(tmp_path / "t", capsys)
    assert code == 0
    assert "NaN/Inf origin" not in text
    assert f"NaN/Inf made and discarded: #{log.index} aten.log.default" in text
    assert f"followed forward, they end at #{where.index} aten.where.self (finite output), {_NEVER_KEPT}" in text
    assert doc["nonfinite_origin"] is None
    assert [(o["index"], o["nonfinite_discarded_by"]) for o in doc["nonfinite_discarded"]] == \
           [(log.index, [where.index])]
    assert _nonfinite_row(md) == f"| NaN/Inf origin | none; made and discarded: #{log.index} aten.log.default | " \
                                 f"none | pass |"


def test_additive_minus_inf_mask_made_in_the_step_through_softmax_is_made_and_discarded(tmp_path, capsys):
    """The mask is made inside the step from finite values (log of a 0/1 lower triangle): -inf from finite inputs,
    added to the scores, and the softmax's output is finite."""
    torch.manual_seed(0)
    q = torch.nn.Parameter(torch.randn(4, 4))
    with record(tmp_path / "t"):
        mask = torch.tril(torch.ones(4, 4)).log()
        (q @ q.t() + mask).softmax(-1).sum().backward()
    ops = rh.trace_ops(tmp_path / "t")
    log = next(op for op in ops if op.name == "aten.log.default")
    softmax = next(op for op in ops if op.name == "aten._softmax.default")
    report = rh.replay(tmp_path / "t")
    assert report.nonfinite_origin is None and report.nonfinite_entry is None
    assert [(r.index, r.nonfinite_discarded_by) for r in report.nonfinite_discarded] == \
           [(log.index, [softmax.index])]
    code, text, doc, md = _replay_cli(tmp_path / "t", capsys)
    assert code == 0 and "NaN/Inf origin" not in text and "| FAIL |" not in _nonfinite_row(md)


def test_nan_that_reaches_the_loss_is_the_origin(tmp_path, capsys):
    """log of negative values: NaN from finite inputs, summed into the loss (read by .item() and by the ones_like
    that starts the backward, which reads no value). Named as today, and nothing is called discarded."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8))
    with record(tmp_path / "t"):
        loss = torch.log(w - 10.0).sum()
        loss.backward()
        loss.item()
    log = next(op for op in rh.trace_ops(tmp_path / "t") if op.name == "aten.log.default")
    report = rh.replay(tmp_path / "t")
    assert report.nonfinite_origin is not None and report.nonfinite_origin.index == log.index
    assert report.nonfinite_discarded == []
    code, text, doc, md = _replay_cli(tmp_path / "t", capsys)
    assert f"NaN/Inf origin: #{log.index} aten.log.default" in text and "discarded" not in text
    assert doc["nonfinite_origin"]["index"] == log.index and doc["nonfinite_discarded"] == []
    assert _nonfinite_row(md) == f"| NaN/Inf origin | #{log.index} aten.log.default | none | FAIL |"


def test_nan_kept_only_as_an_output_of_the_step_is_the_origin(tmp_path):
    """No op reads the NaN after it is made: it leaves the step (an output the user keeps), so it is an origin."""
    x = torch.tensor([-1.0, 4.0])
    with record(tmp_path / "t"):
        out = torch.sqrt(x)
    sqrt = next(op for op in rh.trace_ops(tmp_path / "t") if op.name == "aten.sqrt.default")
    report = rh.replay(tmp_path / "t")
    assert torch.isnan(out).any()
    assert report.nonfinite_origin is not None and report.nonfinite_origin.index == sqrt.index


def test_where_over_log_of_zero_with_a_gradient_names_the_nan_of_the_backward(tmp_path):
    """The well-known trap: the forward's -inf is selected away, but the gradient through the log is 0/0 = NaN and
    reaches the parameter's gradient. The forward log is made and discarded; the origin is the backward op (of the
    log) that made the NaN from finite inputs."""
    w = torch.nn.Parameter(torch.tensor([0.0, 1.0, 2.0]))
    with record(tmp_path / "t"):
        torch.where(w > 0, torch.log(w), torch.zeros_like(w)).sum().backward()
    assert torch.isnan(w.grad).any()
    ops = rh.trace_ops(tmp_path / "t")
    log = next(op for op in ops if op.name == "aten.log.default")
    report = rh.replay(tmp_path / "t")
    origin = report.nonfinite_origin
    assert origin is not None and origin.phase == "backward" and origin.forward_index == log.index
    assert [r.index for r in report.nonfinite_discarded] == [log.index]


def test_trend_does_not_call_nan_inf_selected_away_a_change(tmp_path, capsys):
    """A where over a log that meets a zero at step 5 only: -inf appears from finite inputs in that step, and the
    where ends it. trend names no change and says it once, as information; a NaN at step 8 that reaches the loss is
    still the change, at the op that made it."""
    def train(nan_at: int | None) -> None:
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=1e-2)
        for step in range(1, 11):
            x = torch.rand(8, 4) + 0.5
            if step == 5:
                x[0, 0] = 0.0
            feats = torch.where(x > 0, torch.log(x), torch.zeros_like(x))
            if step == nan_at:
                feats = torch.sqrt(feats - 10.0)
            lin(feats).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    for name, nan_at in (("clean", None), ("nan", 8)):
        with record(tmp_path / name, tensors="stats", steps="1-10"):
            train(nan_at)
    rt = open_trace(tmp_path / "clean").rank(0)
    log5 = next(op for op in rt if op.name == "aten.log.default" and op.step == 5)
    t = compute_trend(rt)
    assert t.first_change is None
    assert (t.discarded.index, t.discarded.step, t.discarded.statistic) == (log5.index, 5, "inf")
    capsys.readouterr()
    assert main(["trend", str(tmp_path / "clean")]) == 0
    assert f"NaN/Inf made and discarded (not a change): step 5, module -, op #{log5.index} aten.log.default " \
           f"(forward): 1 INF value(s) appeared" in capsys.readouterr().out
    rt = open_trace(tmp_path / "nan").rank(0)
    sqrt = next(op for op in rt if op.name == "aten.sqrt.default")
    t = compute_trend(rt)
    assert (t.first_change.index, t.first_change.statistic) == (sqrt.index, "nan")
    assert (t.cause.index, t.cause.how, t.cause.from_finite) == (sqrt.index, "made", True)


# -- a softmax over a row masked whole: NaN made of -inf, read again by the backward ---------------------------------
def _masked_attention_step(tmp: Path, mask_in_step: bool, rows: list[bool], backward: bool = True) -> Path:
    """Scores from a Linear, an additive mask whose ``rows`` are -inf throughout (made inside the recorded step or
    before it), a softmax, and a masked_fill that sets those rows to 0 in the forward; then the loss, its backward and
    an SGD step. ``_softmax_backward_data`` reads the softmax's saved output, NaN rows included."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    masked = torch.tensor(rows)

    def mask() -> torch.Tensor:
        m = torch.zeros(4, 4).masked_fill(masked[:, None], float("-inf"))
        return m + torch.triu(torch.full((4, 4), float("-inf")), 1)  # causal too: no row of it is -inf throughout

    before = None if mask_in_step else mask()
    with record(tmp / "t"):
        p = (lin(x) + (mask() if mask_in_step else before)).softmax(-1).masked_fill(masked[:, None], 0.0)
        loss = p.pow(2).sum()
        if backward:
            loss.backward()
            opt.step()
    assert torch.isnan(lin.weight).any() == (any(rows) and backward)
    return tmp / "t"


@pytest.mark.parametrize("mask_in_step", [True, False], ids=["mask-made-in-step", "mask-made-before-step"])
def test_nan_of_a_softmax_over_a_row_masked_whole_that_reaches_the_parameter_is_the_origin(tmp_path, capsys,
                                                                                            mask_in_step):
    """The forward's masked_fill selects the NaN rows away, but the softmax's backward reads its saved output and
    the NaN reach the weight's gradient and the weight: the softmax made NaN of inputs that hold -inf but no NaN, so
    it is the origin; a mask made before the step is also where its -inf enter (at the add)."""
    path = _masked_attention_step(tmp_path, mask_in_step, [False, True, False, False])
    ops = rh.trace_ops(path)
    softmax = next(op for op in ops if op.name == "aten._softmax.default")
    add = next(op for op in ops if op.name == "aten.add.Tensor" and op.index < softmax.index
               and op.index in open_trace(path).rank(0).producers(softmax.index).values())
    sbd = next(op for op in ops if op.name == "aten._softmax_backward_data.default")
    rt = open_trace(path).rank(0)
    assert sbd.index in rt.consumers(softmax.index)[0]  # the backward reads the saved output
    report = rh.replay(path)
    origin = report.nonfinite_origin
    assert origin is not None and (origin.index, origin.op) == (softmax.index, "aten._softmax.default")
    assert origin.nonfinite_from_inf and origin.nonfinite_discarded_by is None
    assert report.nonfinite_discarded == []
    code, text, doc, md = _replay_cli(path, capsys)
    assert f"NaN/Inf origin: #{softmax.index} aten._softmax.default  no module  (forward)" in text
    assert "(inputs hold Inf but no NaN, NaN in recorded output)" in text and "discarded" not in text
    assert doc["nonfinite_origin"]["index"] == softmax.index and doc["nonfinite_origin"]["nonfinite_from_inf"]
    assert _nonfinite_row(md) == f"| NaN/Inf origin | #{softmax.index} aten._softmax.default | none | FAIL |"
    entry = report.nonfinite_entry
    if mask_in_step:  # the -inf come in as masked_fill's number argument
        fill = next(op for op in ops if op.name == "aten.masked_fill.Scalar")
        assert entry is not None and entry.index == fill.index < softmax.index
        assert (entry.nonfinite_input.argument, entry.nonfinite_input.position) == ("-inf", 2)
        assert (entry.nonfinite_input.nan, entry.nonfinite_input.inf) == (0, 4)
        assert doc["nonfinite_entry"]["nonfinite_input"]["argument"] == "-inf"
        assert f"Inf enter the step as a number passed to an op: argument 2 (-inf) of op #{fill.index} " \
               f"aten.masked_fill.Scalar (no module, forward) puts 4 Inf in its output" in text
    else:
        assert entry is not None and (entry.index, entry.nonfinite_input.position) == (add.index, 1)
        # row 1 whole, and the causal triangle's -inf outside it (3 in row 0, 1 in row 2)
        assert (entry.nonfinite_input.nan, entry.nonfinite_input.inf) == (0, 4 + 3 + 1)
        assert f"Inf enter the step from outside the trace: input 1 of op #{add.index} aten.add.Tensor" in text


def test_nan_of_a_softmax_over_a_row_masked_whole_selected_away_in_a_forward_only_step_is_made_and_discarded(
        tmp_path, capsys):
    """No backward: the masked_fill is the softmax's only reader and ends its NaN, so they are made and discarded
    (said once, as information, never a FAIL)."""
    path = _masked_attention_step(tmp_path, True, [False, True, False, False], backward=False)
    ops = rh.trace_ops(path)
    softmax = next(op for op in ops if op.name == "aten._softmax.default")
    fill = next(op for op in ops if op.name == "aten.masked_fill.Scalar" and op.index > softmax.index)
    report = rh.replay(path)
    assert report.nonfinite_origin is None and report.nonfinite_entry is None
    assert [(r.index, r.nonfinite_discarded_by) for r in report.nonfinite_discarded] == \
           [(softmax.index, [fill.index])]
    code, text, doc, md = _replay_cli(path, capsys)
    assert code == 0 and "NaN/Inf origin" not in text
    assert f"NaN/Inf made and discarded: #{softmax.index} aten._softmax.default  no module  (forward)" in text
    assert _nonfinite_row(md) == f"| NaN/Inf origin | none; made and discarded: #{softmax.index} " \
                                 f"aten._softmax.default | none | pass |"


def test_causal_minus_inf_mask_with_no_row_masked_whole_stays_clean_through_backward_and_step(tmp_path, capsys):
    """Every row keeps a finite score: the softmax makes no NaN, the mask's -inf end there, and a whole training
    step (backward, SGD) names no NaN/Inf origin or entry."""
    path = _masked_attention_step(tmp_path, True, [False, False, False, False])
    report = rh.replay(path)
    assert report.nonfinite_origin is None and report.nonfinite_entry is None
    code, text, doc, md = _replay_cli(path, capsys)
    assert code == 0 and "NaN/Inf origin" not in text and "enter the step" not in text
    assert _nonfinite_row(md).endswith("| none | pass |")


def test_minus_inf_passed_as_a_number_that_reaches_the_loss_is_named_where_it_enters(tmp_path, capsys):
    """masked_fill(-inf) over a whole row, then a max over that row: the loss is -inf. No op made the Inf from
    finite values (the -inf is the argument's), so it is named as where they enter, never left unsaid; the same
    -inf selected away (the causal test above) is said nowhere."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    rows = torch.tensor([False, True, False, False])
    with record(tmp_path / "t"):
        loss = lin(torch.randn(4, 4)).masked_fill(rows[:, None], float("-inf")).amax(-1).sum()
        loss.backward()
        loss.item()
    assert loss.item() == float("-inf")
    fill = next(op for op in rh.trace_ops(tmp_path / "t") if op.name == "aten.masked_fill.Scalar")
    report = rh.replay(tmp_path / "t")
    assert report.nonfinite_origin is None and report.nonfinite_discarded == []
    entry = report.nonfinite_entry
    assert entry is not None and entry.index == fill.index and entry.nonfinite_input.argument == "-inf"
    code, text, doc, md = _replay_cli(tmp_path / "t", capsys)
    assert f"Inf enter the step as a number passed to an op: argument 2 (-inf) of op #{fill.index} " \
           f"aten.masked_fill.Scalar (no module, forward) puts 4 Inf in its output" in text
    assert doc["nonfinite_entry"]["index"] == fill.index
    assert _nonfinite_row(md) == f"| NaN/Inf origin | none made; 4 Inf enter as argument 2 (-inf) of " \
                                 f"#{fill.index} aten.masked_fill.Scalar | none | FAIL |"


def test_nan_inf_origin_line_of_an_op_in_no_module_says_no_module(tmp_path, capsys):
    """As the entry and every other line does, rather than leaving the module's slot empty."""
    x = torch.tensor([-1.0, 4.0])
    with record(tmp_path / "t"):
        torch.sqrt(x)
    sqrt = next(op for op in rh.trace_ops(tmp_path / "t") if op.name == "aten.sqrt.default")
    code, text, doc, md = _replay_cli(tmp_path / "t", capsys)
    assert f"NaN/Inf origin: #{sqrt.index} aten.sqrt.default  no module  (forward)  " in text


# -- T5 from transformers: a tiny config, random weights, no download -------------------------------------------------
def _t5_step(tmp: Path, fault: PlantedFault | None = None) -> Path:
    """One training step of a tiny T5ForConditionalGeneration, recorded (``fault``: planted below the recorder)."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(1, 64, (2, 6)), torch.randint(1, 64, (2, 5))

    def step() -> None:
        model(input_ids=x, labels=y).loss.backward()
        opt.step()

    return rh.record_fn(tmp / ("t5" if fault is None else "t5-planted"), step, fault)


@pytest.fixture(scope="module")
def t5_trace(tmp_path_factory) -> Path:
    return _t5_step(tmp_path_factory.mktemp("t5"))


def test_t5_step_makes_and_discards_log_of_zero_and_replays_clean(t5_trace, capsys):
    ops = rh.trace_ops(t5_trace)
    logs = [op for op in ops if op.name == "aten.log.default"]
    assert logs and all("modeling_t5.py" in (op.source or "") for op in logs)
    report = rh.replay(t5_trace)
    assert report.nonfinite_origin is None and report.nonfinite_entry is None
    assert [r.index for r in report.nonfinite_discarded] == [op.index for op in logs]
    assert all(r.nonfinite_origin for r in report.nonfinite_discarded)
    code, text, doc, md = _replay_cli(t5_trace, capsys)
    assert code == 0
    assert "NaN/Inf origin" not in text
    made = [line for line in text.splitlines() if line.startswith("NaN/Inf made and discarded")]
    assert len(made) == 1 and made[0].startswith(f"NaN/Inf made and discarded: #{logs[0].index} aten.log.default")
    assert doc["nonfinite_origin"] is None and doc["nonfinite_entry"] is None
    row = _nonfinite_row(md)
    assert row.startswith("| NaN/Inf origin | none; made and discarded: ") and row.endswith("| none | pass |")
    assert "| FAIL |" not in md


def test_nan_planted_in_t5_is_still_named_at_the_op_that_made_it(t5_trace, tmp_path, capsys):
    """A NaN planted into the first matmul of the forward (below the recorder) reaches the loss: it is the origin,
    at the planted op, and the health report fails its row; T5's own log(0) is still made and discarded."""
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(t5_trace), rh.MATMULS, "forward")
    path = _t5_step(tmp_path, PlantedFault(name, rel=float("nan"), call=occurrence + 1))
    ops = rh.trace_ops(path)
    index = rh.occurrence_index(ops, name, occurrence)
    report = rh.replay(path)
    assert report.nonfinite_origin is not None and report.nonfinite_origin.index == index
    assert report.nonfinite_origin.op == name
    logs = [op.index for op in ops if op.name == "aten.log.default"]
    assert [r.index for r in report.nonfinite_discarded] == logs
    code, text, doc, md = _replay_cli(path, capsys)
    assert code == 1
    assert f"NaN/Inf origin: #{index} {name}" in text
    assert doc["nonfinite_origin"]["index"] == index
    assert _nonfinite_row(md).startswith(f"| NaN/Inf origin | #{index} {name}; made and discarded: #{logs[0]} ")
    assert _nonfinite_row(md).endswith("| none | FAIL |")


# -- the TUI -----------------------------------------------------------------------------------------------------------
def test_tui_jumps_to_the_kept_nan_and_shows_the_discarded_one_as_information(tmp_path):
    """``e`` goes to the origin of NaN the step keeps, past a log(0) selected away earlier; that op's detail pane
    says made and discarded, with no NaN/Inf origin line."""
    import asyncio

    import replaydiff
    from replaydiff.tui.app import ReplaydiffApp

    w = torch.nn.Parameter(torch.randn(4))
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    with record(tmp_path / "t"):
        feats = torch.where(x > 0, torch.log(x), torch.zeros_like(x))
        (w * feats).sum().add(torch.sqrt(w - 10.0).sum()).backward()
    ops = rh.trace_ops(tmp_path / "t")
    log = next(op for op in ops if op.name == "aten.log.default")
    sqrt = next(op for op in ops if op.name == "aten.sqrt.default")
    report = rh.replay(tmp_path / "t")
    assert report.nonfinite_origin.index == sqrt.index

    async def run() -> None:
        app = ReplaydiffApp(replaydiff.open_trace(tmp_path / "t"), report=report)

        async def settle() -> None:  # the detail pane is filled by a worker
            await pilot.pause()
            await app.workers_done()
            await pilot.pause()

        async with app.run_test(size=(120, 36)) as pilot:
            await settle()
            await pilot.press("e")
            await settle()
            assert app.selected_op == sqrt.index
            assert "NaN/Inf origin" in app.main.detail.text
            app.action_goto(log.index)
            await settle()
            assert app.selected_op == log.index
            text = app.main.detail.text
            assert "NaN/Inf made and discarded" in text and "NaN/Inf origin" not in text

    asyncio.run(run())
