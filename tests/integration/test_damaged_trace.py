"""A trace damaged after it was written (an ops file deleted, never copied or cut short) is never called clean or
complete: every verb names the missing ops and their file. The index removed is no damage: it is rebuilt.

One planted-fault trace of a small step is recorded in several ops chunks; each test damages a copy of it. Op
numbers and chunk boundaries are read back from the trace and its directory, never written down.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

import replaydiff
from replaydiff.errors import EXIT_DIVERGENT, EXIT_TRACE, TraceError
from tests.replay_helpers import mlp_step


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    trace = tmp_path_factory.mktemp("damaged") / "whole"
    with replaydiff.record(trace, plant="aten.mm.default:2:1e-3", chunk_ops=12):
        mlp_step()()
    return trace


def _chunks(trace: Path) -> list[tuple[Path, int, int]]:
    """Each ops file of rank 0 with the first and last op number it holds (from the file names and the op count)."""
    files = sorted((trace / "rank0" / "ops").glob("*.rdt"))
    n = len(replaydiff.open_trace(trace).rank(0))
    firsts = [int(p.stem) for p in files]
    return [(p, first, (firsts[k + 1] if k + 1 < len(firsts) else n) - 1) for k, (p, first) in
            enumerate(zip(files, firsts))]


def _span(first: int, last: int) -> str:
    return f"#{first}" if first == last else f"#{first}-#{last}"


def _planted(trace: Path) -> int:
    return replaydiff.open_trace(trace).rank(0).planted.index


def _damage(whole: Path, tmp_path: Path, which: str) -> tuple[Path, tuple[Path, int, int] | None]:
    """A copy of the trace with one ops file removed ('first', 'middle', 'last', 'planted': the one holding the
    planted op) or cut short ('cut'), or its index removed ('index'); and the chunk damaged."""
    trace = tmp_path / which
    shutil.copytree(whole, trace)
    chunks = _chunks(trace)
    if which == "index":
        (trace / "rank0" / "index.rdt").unlink()
        return trace, None
    planted = _planted(trace)
    holding = next(c for c in chunks if c[1] <= planted <= c[2])
    chunk = {"first": chunks[0], "middle": chunks[len(chunks) // 2], "last": chunks[-1], "planted": holding,
             "cut": holding}[which]
    if which == "cut":
        data = chunk[0].read_bytes()
        chunk[0].write_bytes(data[: len(data) // 2])
    else:
        chunk[0].unlink()
    return trace, chunk


def test_the_trace_has_several_ops_files_and_the_plant_is_inside_one(whole):
    chunks = _chunks(whole)
    assert len(chunks) >= 4
    assert chunks[0][1] < _planted(whole) <= chunks[-1][2]


@pytest.mark.parametrize("which", ["first", "middle", "last", "cut"])
def test_the_read_api_names_the_missing_ops_and_their_file(whole, tmp_path, which):
    trace, (path, first, last) = _damage(whole, tmp_path, which)
    rt = replaydiff.open_trace(trace).rank(0)
    assert [(m.first, m.last, m.path) for m in rt.missing_ops] == [(first, last, path)]
    assert len(rt) == len(replaydiff.open_trace(whole).rank(0))  # a lost last file does not shorten the trace
    with pytest.raises(TraceError) as err:
        rt[first]
    assert err.value.path == str(path) and f"#{first}" in err.value.problem
    with pytest.raises(TraceError):
        list(rt)  # iterating never passes over the gap in silence
    with pytest.raises(TraceError):
        replaydiff.open_trace(trace).check_whole()
    # the ops that are there still read
    other = next(i for i in range(len(rt)) if not first <= i <= last)
    assert rt[other].index == other


def test_a_removed_index_is_rebuilt_and_is_no_damage(whole, tmp_path, cli_here):
    trace, _ = _damage(whole, tmp_path, "index")
    rt = replaydiff.open_trace(trace).rank(0)
    assert rt.missing_ops == () and rt.planted.index == _planted(whole)
    res = cli_here("replay", trace)
    assert res.returncode == EXIT_DIVERGENT
    assert f"first divergent op #{_planted(whole)} " in res.stdout and "missing" not in res.stdout


@pytest.mark.parametrize("which", ["planted", "cut"])
def test_replay_without_the_culprit_s_file_is_not_clean_and_exits_3(whole, tmp_path, cli_here, which):
    trace, (path, first, last) = _damage(whole, tmp_path, which)
    res = cli_here("replay", trace, "--json", tmp_path / "r.json")
    assert res.returncode == EXIT_TRACE
    line = f"{last - first + 1} op(s) ({_span(first, last)}) missing: ops file {path}"
    assert line in res.stdout
    assert "no divergent op: every replayed op matches" not in res.stdout
    assert "not clean:" in res.stdout
    # the plant is said to be among the missing ops, not "outside the ops this replay was asked for"
    assert f"planted fault: op #{_planted(whole)}" in res.stdout and "among the ops missing" in res.stdout
    assert "outside the ops" not in res.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [(m["first"], m["last"], m["file"]) for m in doc["missing_ops"]] == [(first, last, str(path))]
    assert not any(first <= o["index"] <= last for o in doc["ops"])


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_replay_judges_the_rest_and_names_the_missing_ops(whole, tmp_path, cli_here, which):
    trace, (path, first, last) = _damage(whole, tmp_path, which)
    planted = _planted(whole)
    res = cli_here("replay", trace)
    assert f"{last - first + 1} op(s) ({_span(first, last)}) missing: ops file {path}" in res.stdout
    if first <= planted <= last:  # the culprit's own file is gone
        assert res.returncode == EXIT_TRACE and "first divergent op" not in res.stdout
        return
    assert res.returncode == EXIT_DIVERGENT
    assert f"first divergent op #{planted} " in res.stdout
    earlier = "an earlier divergent op may be among them" in res.stdout
    assert earlier == (first < planted)


@pytest.mark.parametrize("which", ["first", "last", "cut"])
def test_diff_and_trend_refuse_a_damaged_trace_naming_the_file(whole, tmp_path, cli_here, which):
    trace, (path, first, last) = _damage(whole, tmp_path, which)
    for args in (("diff", whole, trace), ("diff", trace, whole), ("trend", trace)):
        res = cli_here(*args)
        assert res.returncode == EXIT_TRACE, args
        assert str(path) in res.stderr and _span(first, last) in res.stderr


@pytest.mark.parametrize("which", ["planted", "last"])
def test_report_fails_the_recording_check_of_a_damaged_trace(whole, tmp_path, cli_here, which):
    trace, (path, first, last) = _damage(whole, tmp_path, which)
    cli_here("replay", trace, "--json", tmp_path / "r.json")
    res = cli_here("report", trace, "--replay", tmp_path / "r.json", "--no-probe")
    row = next(line for line in res.stdout.splitlines() if line.startswith("| recording complete"))
    assert f"DAMAGED: {last - first + 1} op(s) ({_span(first, last)}) missing: ops file {path}" in row
    assert row.endswith("| FAIL |")
    assert res.returncode == (EXIT_TRACE if which == "planted" else EXIT_DIVERGENT)


def test_report_of_a_replay_made_before_the_damage_still_fails(whole, tmp_path, cli_here):
    trace = tmp_path / "t"
    shutil.copytree(whole, trace)
    cli_here("replay", trace, "--json", tmp_path / "r.json")  # replayed whole...
    path, first, last = _chunks(trace)[-1]
    path.unlink()  # ...then damaged
    res = cli_here("report", trace, "--replay", tmp_path / "r.json", "--no-probe")
    assert f"DAMAGED: {last - first + 1} op(s) ({_span(first, last)}) missing" in res.stdout
    assert res.returncode == EXIT_DIVERGENT  # the plant was found before the damage


def test_show_and_repro_say_the_trace_is_damaged(whole, tmp_path, cli_here):
    trace, (path, first, last) = _damage(whole, tmp_path, "middle")
    res = cli_here("show", trace)
    assert res.returncode == EXIT_TRACE
    assert f"DAMAGED: {last - first + 1} op(s) ({_span(first, last)}) missing: ops file {path}" in res.stdout
    inside = cli_here("repro", trace, str(first), "-o", tmp_path / "r1")
    assert inside.returncode == EXIT_TRACE and str(path) in inside.stderr
    outside = cli_here("repro", trace, str(last + 1), "-o", tmp_path / "r2")
    assert outside.returncode == 0 and "the trace is damaged" in outside.stderr and str(path) in outside.stderr


def test_the_tui_says_damaged_and_shows_the_missing_op_s_file(whole, tmp_path):
    from replaydiff.replay import ReplayOptions, replay_trace
    from replaydiff.tui.app import ReplaydiffApp

    trace, (path, first, last) = _damage(whole, tmp_path, "first")
    report = replay_trace(trace, ReplayOptions())
    assert [(m.first, m.last) for m in report.missing] == [(first, last)]

    async def run() -> tuple[str, str]:
        app = ReplaydiffApp(replaydiff.open_trace(trace), report=report)
        async with app.run_test(size=(140, 30)) as pilot:
            await pilot.pause()
            await app.workers_done()
            await pilot.pause()
            return str(app.main.query_one("#status").visual), app.main.detail.text

    status, detail = asyncio.run(run())
    assert f"DAMAGED: {last - first + 1} ops missing ({_span(first, last)})" in status
    assert str(path) in detail  # op #0, selected first, is among the missing: its file is named
