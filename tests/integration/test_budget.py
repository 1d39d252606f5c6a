"""A trace too big to record whole: ``record --budget``, a full disk, the statistics a zoomed trace keeps
for what its filter leaves out, and ``record --estimate``."""
from __future__ import annotations

import errno
import fnmatch
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
import replaydiff.trace.writer as trace_writer
from replaydiff.cli.estimate import run_estimate
from replaydiff.cli.main import build_parser, main
from replaydiff.cli.record import options_from_args
from replaydiff.models.tiny import TinyCNN, TinyTransformer, make_step
from replaydiff.record.budget import parse_size
from replaydiff.record import Recorder, RecordOptions
from replaydiff.replay import ReplayOptions, Status, replay_trace
from replaydiff.trace import open_trace

from budget_helpers import _bytes_on_disk, _named_ops


BLOCK0 = "TinyTransformer.blocks.0.*"


def _step():
    """A fresh TinyTransformer training step (forward, backward, AdamW), the same each time it is built."""
    torch.manual_seed(0)
    model = TinyTransformer()
    return make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))


def _record(path: Path, **options):
    step = _step()
    with replaydiff.record(path, **options):
        step()
    return open_trace(path).rank(0)


def _tensor_refs(op):
    """The refs of an op that have values to store or measure (not views of nothing, not empty* outputs)."""
    return [x for x in [*op.inputs(), *op.outputs_refs()] if x.version is not None and x.nbytes and not x.zero
            and not x.uninitialised]


def test_sizes_parse_with_their_suffixes_and_bad_sizes_or_a_budget_of_statistics_are_refused(capsys):
    assert [parse_size(s) for s in ("500M", "2G", "1.5GiB", "64k", "1000", 7)] == \
        [500 << 20, 2 << 30, 3 << 29, 64 << 10, 1000, 7]
    for bad in ("lots", "-1M", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert RecordOptions.make(budget="2G").budget == 2 << 30
    with pytest.raises(ValueError, match="tensors='full'"):
        RecordOptions.make(tensors="stats", budget="2G")
    assert main(["record", "--budget", "lots", "--", sys.executable, "-c", "pass"]) == 2
    assert "a size is a number with an optional K, M, G or T" in capsys.readouterr().err


def test_a_budget_keeps_the_trace_under_it_with_statistics_for_the_rest(tmp_path, capsys):
    full = _record(tmp_path / "full", compress=False)
    budget = 4 << 20
    assert _bytes_on_disk(tmp_path / "full") > 3 * budget
    r = _record(tmp_path / "t", budget="4M", compress=False)
    assert _bytes_on_disk(tmp_path / "t") <= budget
    ops = list(r)
    assert [op.name for op in ops] == [op.name for op in full]  # every op recorded
    left = [op for op in ops if op.data_left_out is not None]
    kept = [op for op in ops if op.data_left_out is None and _tensor_refs(op)]
    assert left and kept and {op.data_left_out for op in left} == {"budget"}
    assert kept[0].index < left[0].index  # step order: data first, then statistics
    for op in left:  # statistics for every tensor whose bytes are not there
        refs = _tensor_refs(op)
        assert any(not x.stored for x in refs) and all(x.stored or x.stats is not None for x in refs)
    for op in kept:
        assert all(x.stored for x in _tensor_refs(op))
    (summary,) = r.data_left_out
    assert (summary.reason, summary.ops, summary.first, summary.last) == \
        ("budget", len(left), left[0].index, left[-1].index) and summary.nbytes > 0

    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    assert sorted(x.index for x in report.not_judged) == [op.index for op in left]
    assert all(x.status is Status.SKIPPED and "budget" in x.reason for x in report.not_judged)
    assert report.first_divergent is None and report.counts()["ok"] > 0 and report.found_problem

    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t")]) == 1  # never clean
    out = capsys.readouterr().out
    (told,) = [ln for ln in out.splitlines() if "not judged: tensor data left out, past the record --budget" in ln]
    assert "not clean" in out and "every replayed op matches" not in out
    assert main(["show", str(tmp_path / "t")]) == 0
    (shown,) = [ln for ln in capsys.readouterr().out.splitlines()
                if "LEFT OUT:" in ln and "kept with statistics only: past the record --budget" in ln]
    for line in (told, shown):  # how many, and exactly which (test_budget_with_module_names_exactly_the_ops_...)
        named, n = _named_ops(line)
        assert n == len(left) and named <= {op.index for op in left} and left[-1].index in named, line


def test_a_budget_gives_the_selected_modules_data_first(tmp_path):
    def block0(r):
        return [op for op in r if fnmatch.fnmatchcase(op.module or "", BLOCK0)]

    in_order = _record(tmp_path / "order", budget="8M")
    assert any(op.data_left_out == "budget" for op in block0(in_order))  # step order: the budget ends before it
    r = _record(tmp_path / "first", budget="8M", modules=BLOCK0)
    assert _bytes_on_disk(tmp_path / "first") <= 8 << 20
    inside = block0(r)
    assert inside and all(op.data_left_out is None for op in inside)
    others = [op for op in r if not fnmatch.fnmatchcase(op.module or "", BLOCK0) and _tensor_refs(op)]
    # the rest, in step order, from what the selected ops leave
    assert {op.data_left_out for op in others} == {None, "budget"}


def _disk_fills_after(writes: int, monkeypatch) -> list:
    """The trace writer's files: the first ``writes`` are written, every later one fails with ENOSPC; the paths tried."""
    real, calls = trace_writer.write_atomic_via, []

    def fills_up(path, write):
        calls.append(path)
        if len(calls) > writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, write)

    monkeypatch.setattr(trace_writer, "write_atomic_via", fills_up)
    return calls


def test_a_full_disk_keeps_recording_statistics_with_one_warning(tmp_path, monkeypatch):
    calls = _disk_fills_after(2, monkeypatch)
    plain, step = _step(), _step()
    torch.manual_seed(1)
    expected = plain()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t", chunk_ops=32):
            torch.manual_seed(1)
            loss = step()
    assert torch.equal(loss, expected)  # the job's own results, unchanged
    ours = [str(w.message) for w in caught if "replaydiff" in str(w.message)]
    assert len(ours) == 1 and "disk is full" in ours[0]
    r = open_trace(tmp_path / "t").rank(0)
    ops = list(r)
    assert r.complete and len(ops) == r.manifest["ops_seen"]
    assert r.bytes_missing == 0  # what the full disk refused was never counted as written: not "damaged"
    left = [op for op in ops if op.data_left_out is not None]
    assert left and {op.data_left_out for op in left} == {"disk full"}
    before = [op for op in ops if op.index < left[0].index and _tensor_refs(op)]
    assert before and all(x.stored for op in before for x in _tensor_refs(op))
    for op in ops:  # what a record says is stored reads back: no reference into a data file never written
        for x in _tensor_refs(op):
            if x.stored:
                r.tensor(x)
    # after the recorder heard of it: statistics instead of data
    late = left[len(left) // 2:]
    assert all(x.stats is not None for op in late for x in _tensor_refs(op) if not x.stored)
    assert any("disk is full" in line for line in r.lost)
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    assert report.found_problem and len(report.not_judged) == len(left)


def test_a_zoomed_trace_keeps_statistics_for_what_its_filter_leaves_out(tmp_path):
    r = _record(tmp_path / "t", modules=BLOCK0)
    inside = [op for op in r if fnmatch.fnmatchcase(op.module or "", BLOCK0)]
    assert inside and all(op.data_left_out is None for op in inside)
    # block 0's first op reads what an op outside it made: that op is in the trace, with statistics
    first = inside[0]
    producers = [p for p in r.producers(first.index).values() if p is not None]
    assert producers
    made_by = r[producers[0]]
    assert made_by.data_left_out == "filtered" and not fnmatch.fnmatchcase(made_by.module or "", BLOCK0)
    out = made_by.outputs_refs()[0]
    assert not out.stored and out.stats is not None and out.stats.numel == torch.Size(out.shape).numel()
    # replay judges what is stored and says why the rest was not; a filter is a choice, not a gap: clean
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    skipped = [x for x in report.ops if x.data_left_out == "filtered"]
    assert skipped and all(x.status is Status.SKIPPED and "filter" in x.reason for x in skipped)
    assert not report.found_problem and report.counts()["ok"] >= len(inside) // 2


def _cnn_step():
    torch.manual_seed(0)
    model = TinyCNN()
    return make_step(model, model.example_batch(), torch.optim.SGD(model.parameters(), lr=0.1))


def _two_ranks(monkeypatch, cache: Path):
    """A stand-in for cli/record.py's run_recorded: the "job" runs in this process as two ranks of different sizes
    (rank 0 a small CNN, rank 1 the transformer), each recorded with the options the estimate asks for. The job is
    the same each time: recorded once into ``cache``, copied after."""
    asked = []

    def run_recorded(cmd, out, step, options, stdout=None):
        asked.append(options)
        if not cache.exists():
            for rank, make in ((0, _cnn_step), (1, _step)):
                monkeypatch.setenv("RANK", str(rank))
                monkeypatch.setenv("WORLD_SIZE", "2")
                train = make()
                with Recorder(cache, options):
                    train()
        shutil.copytree(cache, out, dirs_exist_ok=True)
        return 0, 1, [0, 1]

    return run_recorded, asked


def _estimate(argv: list[str], run_recorded) -> int:
    args = build_parser().parse_args(["record", "--estimate", *argv, "--", "python", "train.py"])
    return run_estimate(args, args.command[1:], options_from_args(args), run_recorded)


def test_estimate_json_and_the_ranks_that_fit_a_budget(tmp_path, monkeypatch, capsys):
    run_recorded, asked = _two_ranks(monkeypatch, tmp_path / "job")
    dest = tmp_path / "estimate.json"
    capsys.readouterr()
    assert _estimate(["--budget", "8M", "--json", str(dest), "-o", str(tmp_path / "none")], run_recorded) == 0
    assert [(o.tensors, o.budget) for o in asked] == [("meta", None)] and not (tmp_path / "none").exists()
    doc = json.loads(dest.read_text())
    assert doc["format"] == "replaydiff.estimate/1" and doc["what"] == "step 1"
    assert doc["write_rate"]["bytes_per_s"] > 0 and doc["write_rate"]["measured"] == \
        f"64 MiB written and synced to disk in {tmp_path}"
    r0, r1 = doc["ranks"]
    assert (r0["rank"], r1["rank"]) == (0, 1)
    for r in (r0, r1):  # per module/phase rows add up to the rank's data; the rank's bytes are data and records
        assert sum(p["bytes"] for p in r["places"]) == r["data_bytes"] > 0
        assert sum(p["ops"] for p in r["places"]) == r["ops"]
        assert r["bytes"] == r["data_bytes"] + r["records_bytes"]
        assert r["write_seconds"] == pytest.approx(r["bytes"] / doc["write_rate"]["bytes_per_s"])
    assert {p["module"] for p in r1["places"]} >= {"TinyTransformer.blocks.0.attn", "(outside any module)"}
    assert doc["total"] == {"ranks": 2, "bytes": r0["bytes"] + r1["bytes"],
                            "write_seconds": pytest.approx((r0["bytes"] + r1["bytes"]) /
                                                           doc["write_rate"]["bytes_per_s"])}
    # the budget is per rank: the small rank fits it whole, the transformer's data would stop part way
    assert r0["budget"]["fits"] and r0["budget"]["data_stops_at_op"] is None
    assert not r1["budget"]["fits"] and r1["budget"]["data_stops_at_op"] > 0
    assert r1["budget"]["fitting_modules"] and all(
        m["bytes"] <= (8 << 20) - doc["budget"]["reserve"] and m["flags"] == ["--module", m["module"], "--module",
                                                                             f"{m['module']}.*"]
        for m in r1["budget"]["fitting_modules"])
    assert doc["budget"] == {"bytes": 8 << 20, "per": "rank", "reserve": 838860, "ranks_that_fit": [0],
                             "flags": ["--rank", "0", "--budget", "8M"]}
    out = capsys.readouterr().out  # with --json FILE the text is printed too
    assert "--budget 8M fits rank 0 whole, not rank 1: `record --rank 0 --budget 8M` records it complete" in out

    # what the estimate says fits does: rank 0 recorded for real under the budget leaves nothing out (that the
    # transformer's step does not fit 8M: test_a_budget_gives_the_selected_modules_data_first)
    train = _cnn_step()
    with replaydiff.record(tmp_path / "cnn", budget="8M"):
        train()
    (rt,) = open_trace(tmp_path / "cnn")
    assert all(op.data_left_out is None for op in rt) and any(x.stored for op in rt for x in op.inputs())

    # --json -: stdout is the document alone
    assert _estimate(["--budget", "64M", "--json", "-", "-o", str(tmp_path / "none")], run_recorded) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["budget"]["ranks_that_fit"] == [0, 1] and doc["budget"]["flags"] == ["--budget", "64M"]


def test_record_json_without_estimate_is_a_usage_error(capsys):
    assert main(["record", "--json", "-", "--", sys.executable, "-c", "pass"]) == 2
    assert "--json writes the estimate" in capsys.readouterr().err


def _two_linears(path: Path, **options) -> None:
    """Forward and backward of two 256x256 Linear layers (256 KiB weights): a 1M budget holds only some of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256)
    with replaydiff.record(path, **options):
        model(x).sum().backward()


@pytest.mark.parametrize("case", ["budget", "disk full", "filtered"])
def test_replay_tells_each_fact_of_left_out_data_once(tmp_path, monkeypatch, capsys, case):
    options = {"budget": {"budget": "1M"}, "filtered": {"modules": "Sequential.2"}}.get(case, {"chunk_ops": 4})
    if case == "disk full":
        calls = _disk_fills_after(2, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the full disk's warning: test_a_full_disk_keeps_recording_...
        _two_linears(tmp_path / "t", **options)
    r = open_trace(tmp_path / "t").rank(0)
    left = [op.index for op in r if op.data_left_out is not None]
    assert left and {r[i].data_left_out for i in left} == {case}
    capsys.readouterr()
    code = main(["replay", str(tmp_path / "t")])
    lines = capsys.readouterr().out.splitlines()
    judged = sum(x.status in (Status.OK, Status.DIVERGENT, Status.NONDETERMINISTIC)
                 for x in replay_trace(str(tmp_path / "t"), ReplayOptions()).ops)
    why = {"budget": "past the record --budget", "disk full": "the disk was full while recording",
           "filtered": "outside the record --module/--op filter"}[case]
    told = [line for line in lines if why in line]
    if case == "filtered":  # a choice, not a gap: counted with the skipped ops, and the trace is clean
        assert code == 0 and told == [f"  skipped {len(left):>5}  tensor data left out: {why}"]
        assert lines[-1] == "no divergent op: every replayed op matches its recorded output within tolerance"
        return
    assert code == 1
    # one line for the ops left out (how many, where, why), one for the verdict and what to do
    assert len(told) == 1 and told[0].startswith(f"  {len(left)} op(s) (") and \
        told[0].endswith(f") not judged: tensor data left out, {why}")
    named, _ = _named_ops(told[0])
    assert named <= set(left) and left[-1] in named
    again = "with a larger --budget, or --module for the part to check" if case == "budget" else \
        "on a disk with room, or with a --budget that fits it"
    assert lines[-1] == f"not clean: no divergent op among the {judged} judged; record again {again}"
    assert f"{judged} ok" in lines[0]


