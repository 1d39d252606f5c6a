"""The data samplers a recorded process built: each ``DistributedSampler`` (and subclass) noted with the line that
built it and the rank and replica count it was given, read back from the trace. Watching them changes nothing of
the sampler (its order, its errors), leaves ``DistributedSampler.__init__`` as it was found, and the note is part of
the trace (removed whole). A note that is not sound reads as unknown."""
from __future__ import annotations

import warnings

import torch
from torch.utils.data import DistributedSampler, TensorDataset

import replaydiff
from replaydiff.trace.removal import remove_trace
from replaydiff.trace.samplers import SAMPLERS, read_samplers, write_samplers
from replaydiff.trace.schema.samplers import SamplerBuilt, SamplersNote

DATA = TensorDataset(torch.arange(10))


class EveryOther(DistributedSampler):
    """A subclass with its own ``__init__``: where the job builds it is its caller, not this ``super()`` call."""

    def __init__(self, data, rank):
        super().__init__(data, num_replicas=2, rank=rank, shuffle=True, seed=7)


def _line(text: str) -> int:
    return next(n for n, line in enumerate(open(__file__).read().splitlines(), 1) if text in line)


def _step(trace) -> tuple[list[int], list[int]]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with replaydiff.record(trace):
        plain = DistributedSampler(DATA, 2, rank=0, shuffle=False)  # the plain sampler's line
        mine = EveryOther(DATA, 1)  # the subclass's line
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    return list(plain), list(mine)


def test_each_sampler_built_while_recording_is_noted_with_its_line_and_what_it_was_given(tmp_path):
    _step(tmp_path / "t")
    note = read_samplers(tmp_path / "t" / "rank0")
    assert note is not None and not note.whole_process  # the Python API watches from its `with` only
    plain, mine = note.samplers
    assert (plain.kind, plain.rank_given, plain.replicas_given, plain.rank, plain.replicas, plain.shuffle) == \
        ("DistributedSampler", 0, 2, 0, 2, False)
    assert plain.at.endswith(f"test_sampler_notes.py:{_line('# the plain sampler')}")
    assert (mine.kind, mine.rank_given, mine.replicas_given, mine.seed) == ("EveryOther", 1, 2, 7)
    assert mine.at.endswith(f"test_sampler_notes.py:{_line('# the subclass')}")


def test_watching_changes_no_sampler_and_leaves_its_init_as_found(tmp_path):
    before = DistributedSampler.__dict__["__init__"]
    assert _step(tmp_path / "t") == (list(DistributedSampler(DATA, 2, rank=0, shuffle=False)),
                                     list(EveryOther(DATA, 1)))
    assert DistributedSampler.__dict__["__init__"] is before
    with replaydiff.record(tmp_path / "u"):
        try:
            DistributedSampler(DATA, num_replicas=2, rank=5)
        except ValueError as e:  # the job's own error, as torch raises it
            assert "rank" in str(e).lower() and "replaydiff" not in str(e)
        else:
            raise AssertionError("an invalid rank was accepted")
    assert DistributedSampler.__dict__["__init__"] is before
    remove_trace(tmp_path / "t")  # it refuses a directory holding a file that is not the trace's
    assert list((tmp_path / "t").iterdir()) == []


class Unreadable(DistributedSampler):
    """A sampler whose seed cannot be read back (a property that raises): noting it fails inside the recorder."""

    @property
    def seed(self):
        raise RuntimeError("this seed cannot be read")

    @seed.setter
    def seed(self, value):
        self._seed = value


def test_a_sampler_the_recorder_cannot_note_is_built_as_asked_with_one_warning(tmp_path):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t"):
            first, second = Unreadable(DATA, 2, rank=1, shuffle=False), Unreadable(DATA, 2, rank=0, shuffle=False)
            plain = DistributedSampler(DATA, 2, rank=0, shuffle=False)
            model = torch.nn.Linear(3, 2)
            model(torch.ones(4, 3)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert (list(first), list(second)) == ([1, 3, 5, 7, 9], [0, 2, 4, 6, 8])
    mine = [str(w.message) for w in said if "sampler" in str(w.message).lower()]
    assert len(mine) == 1 and "this seed cannot be read" in mine[0], mine
    note = read_samplers(tmp_path / "t" / "rank0")
    assert note is not None and [s.rank for s in note.samplers] == [plain.rank]


def test_a_note_that_is_not_sound_reads_as_unknown(tmp_path):
    good = SamplersNote(True, (SamplerBuilt("DistributedSampler", "train.py:16", 0, 2, 0, 2, True, 0),))
    write_samplers(tmp_path, good)
    assert read_samplers(tmp_path) == good
    text = (tmp_path / SAMPLERS).read_text()
    for damaged in (text[: len(text) // 2], "[]", "\xff\xfe", text.replace("16\"", "16\"" + "x" * 400),
                    text.replace(":0,", ":\"0\",", 1), text.replace("true", "1", 1), "{" * 100_000):
        (tmp_path / SAMPLERS).write_text(damaged, errors="surrogateescape")
        assert read_samplers(tmp_path) is None, damaged[:80]
    (tmp_path / SAMPLERS).unlink()
    assert read_samplers(tmp_path) is None
