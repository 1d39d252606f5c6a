"""Op records leave the cyclic garbage collector's lists as they go to the writer (native/hotpath.c: untrack_tree).

Why it matters: a record lives until the writer has packed its chunk, long enough to be promoted to the collector's
oldest generation, and each time that generation grows by a quarter the collector walks the job's whole heap (~0.2-0.5
s with torch and a model loaded). Recording a step of ~6,700 small ops set one off every few steps. Oracles: the
collector's own answer (``gc.is_tracked``) for every container of every record the writer is handed, and the trace a
recording without the extension writes (the same op records, byte for byte)."""
from __future__ import annotations

import gc
import logging
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff import open_trace
from replaydiff.record import native
from replaydiff.record import stats as rec_stats
from replaydiff.trace.writer import RankWriter


def _untrack_tree():
    fn = native.untrack()
    assert fn is not None, "no native extension here: is there a C compiler and Python.h?"
    return fn


def _tracked(v) -> list:
    """The containers inside ``v`` (itself included) the collector still tracks."""
    out = [v] if gc.is_tracked(v) else []
    if isinstance(v, dict):
        for x in v.values():
            out += _tracked(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            out += _tracked(x)
    return out


class Opaque:
    """An object of a type the walk does not know: it, and every container above it, stays tracked."""


def test_untrack_tree_untracks_plain_data_and_keeps_what_holds_anything_else() -> None:
    untrack_tree = _untrack_tree()
    plain = {"args": [1, {"shape": (4, 16, 4), "stride": (64, 4, 1), "stats": [3, 0.5, None]}], "name": "aten.mul"}
    assert _tracked(plain)
    untrack_tree(plain)
    assert _tracked(plain) == []
    held = Opaque()
    mixed = {"left": [1, [2, (3, held)]], "right": {"inner": [4.0]}, "third": (5,)}
    untrack_tree(mixed)
    # the chain above the object stays tracked; the plain branches beside it do not
    assert [type(x).__name__ for x in _tracked(mixed)] == ["dict", "list", "list", "tuple", "Opaque"]
    assert not gc.is_tracked(mixed["right"]) and not gc.is_tracked(mixed["right"]["inner"])
    if sys.version_info < (3, 14):  # CPython 3.14 no longer tracks a dict again (nor untracks one itself)
        # a dict takes itself back onto the collector's lists when a container is put into it (CPython's own rule)
        plain["later"] = [object()]
        assert gc.is_tracked(plain)
    # a cycle through an untracked container cannot be made by the walk itself: a self-referencing list stays tracked
    loop: list = [1]
    loop.append(loop)
    untrack_tree({"loop": loop})
    assert gc.is_tracked(loop)


def _step():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    x = torch.randn(5, 12)

    def step() -> None:
        h = lin(x)
        loss = h.square().mean() + h.t()[::2].abs().sum() * 1e-3
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


@pytest.mark.parametrize("tensors", ["meta", "stats", "full"])
def test_every_op_record_reaches_the_writer_off_the_collectors_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     tensors: str) -> None:
    _untrack_tree()
    handed: list[list] = []
    add_op = RankWriter.add_op

    def watched(self, record: dict) -> None:
        handed.append(_tracked(record))
        add_op(self, record)

    monkeypatch.setattr(RankWriter, "add_op", watched)
    step = _step()
    with replaydiff.record(tmp_path / "t", tensors=tensors):
        step()
    assert len(handed) > 30
    assert [t for t in handed if t] == []


def _ops(path: Path) -> list[dict]:
    return [op.to_json() for op in open_trace(path).rank(0)]


def _ops_bytes(path: Path) -> dict[str, bytes]:
    """The rank's op record files, as written (the records packed and compressed)."""
    return {f.name: f.read_bytes() for f in sorted((path / "rank0" / "ops").iterdir())}


def _without_extension(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, why: str) -> None:
    """This process as if it had not tried to load the extension yet, on a machine where it cannot be used: Python's
    headers not installed (the build refuses before the compiler runs, whatever the cache holds), or a free-threaded
    Python. The ctypes kernel stays as loaded (a compiler is there)."""
    monkeypatch.setattr(native, "_ext_loaded", [])
    monkeypatch.setattr(rec_stats, "_kernel", None)
    monkeypatch.setattr(rec_stats, "_ext", None)
    if why == "no Python.h":
        paths = sysconfig.get_paths()
        (tmp_path / "include").mkdir()
        monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**paths, "include": str(tmp_path / "include")})
    else:
        get_config_var = sysconfig.get_config_var
        monkeypatch.setattr(sysconfig, "get_config_var",
                            lambda name: 1 if name == "Py_GIL_DISABLED" else get_config_var(name))
        compile_ = native._compile
        monkeypatch.setattr(native, "_compile", lambda cc, flags, target, source: (
            pytest.fail("the extension was built on a free-threaded Python") if source == native.EXT_SOURCE
            else compile_(cc, flags, target, source)))


@pytest.mark.parametrize("why", ["no Python.h", "free-threaded"])
@pytest.mark.parametrize("tensors", ["meta", "stats"])
def test_a_recording_without_the_extension_writes_the_same_records_and_says_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tensors: str,
        why: str) -> None:
    _untrack_tree()
    step = _step()
    with replaydiff.record(tmp_path / "with", tensors=tensors, compress=False) as rec:
        assert rec.builder.untrack is not None
        step()
    _without_extension(monkeypatch, tmp_path, why)
    caplog.set_level(logging.INFO, logger="replaydiff")
    step = _step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "without", tensors=tensors, compress=False) as rec:
            assert rec.builder.untrack is None and rec.builder._measure is None
            step()
    assert native.extension() is None and native.untrack() is None
    assert rec_stats._kernel is not False  # the ctypes kernel measured without it
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records] == []  # not even at INFO: it is said at DEBUG alone
    ops = _ops(tmp_path / "with")
    assert len(ops) > 30 and ops == _ops(tmp_path / "without")
    assert _ops_bytes(tmp_path / "with") == _ops_bytes(tmp_path / "without")


def test_untrack_tree_walks_a_shared_shape_in_bounded_time() -> None:
    """A tree that shares one held branch at every level (2**40 paths) is given up on, not walked path by path."""
    untrack_tree = _untrack_tree()
    x: list = [Opaque()]
    for _ in range(40):
        x = [x, x]
    untrack_tree(x)  # returns (a budget of containers): the test would not end otherwise
    assert gc.is_tracked(x)
