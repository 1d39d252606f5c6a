"""A small data file is read whole at its first storage (trace/reader.DataFile): every storage comes back as the
storage by storage read gives it, raw and zstd alike, and a raw storage is a tensor of its own (views of it are
rebuilt with offsets counted from its start, so a view into the whole file would show another storage's bytes)."""
from __future__ import annotations

import torch

import replaydiff
from replaydiff.trace import reader as reader_mod
from replaydiff.trace.reader import open_trace
from replaydiff.trace.schema import iter_refs


def _step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g, requires_grad=True)
    x = torch.randn(4, 16, generator=g)
    y = (x @ w).relu()
    (y[:, 2:5].t() * 3).sum().backward()  # views with offsets, transposes


def _stored_tensors(path) -> tuple[list[torch.Tensor], list]:
    rt = open_trace(path).rank(0)
    out = []
    for op in rt:
        for ref in [*iter_refs(op.args), *iter_refs(op.kwargs), *iter_refs(op.outputs)]:
            if ref.stored:
                out.append(rt.tensor(ref).clone())
    return out, list(rt._files.values())


def test_whole_file_reads_give_every_storage_as_storage_by_storage_reads(tmp_path, monkeypatch):
    for compress in (False, 3):
        path = tmp_path / f"c{compress}"
        with replaydiff.record(path, tensors="full", compress=compress):
            _step()
        whole, files = _stored_tensors(path)
        assert files and all(isinstance(f._data, torch.Tensor) for f in files)  # the whole-file path was taken
        monkeypatch.setattr(reader_mod, "_WHOLE_FILE", -1)
        each, files = _stored_tensors(path)
        monkeypatch.undo()
        assert files and all(f._data is False for f in files)
        assert len(whole) == len(each) > 10
        for a, b in zip(whole, each):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(-1).view(torch.uint8) if a.is_contiguous() else a.contiguous().view(torch.uint8),
                               b.view(-1).view(torch.uint8) if b.is_contiguous() else b.contiguous().view(torch.uint8))


def test_a_raw_storage_read_whole_is_its_own_tensor(tmp_path):
    path = tmp_path / "raw"
    with replaydiff.record(path, tensors="full", compress=False):
        _step()
    rt = open_trace(path).rank(0)
    refs = [r for op in rt for r in iter_refs(op.outputs) if r.stored and r.nbytes]
    assert len(refs) > 3
    for ref in refs:
        data = rt.data(ref)
        assert data.storage_offset() == 0 and data.untyped_storage().nbytes() == ref.nbytes
