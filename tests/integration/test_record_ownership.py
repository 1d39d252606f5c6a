"""A recording owns its directory: a second recording into it is refused before it writes anything (the CLI: one
line, exit 2, before the job starts; the Python API: the recorder's one warning, and nothing recorded), the first
one's trace is left whole, and an output directory that cannot be written is said in one line naming it and why."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main

JOB = "import pathlib; pathlib.Path({marker!r}).write_text('ran')"


def _step() -> torch.Tensor:
    torch.manual_seed(0)
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    return (a @ b).relu().sum()


def _warnings_of(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "replaydiff" in str(w.message)]


def test_a_second_recording_into_a_directory_being_recorded_records_nothing_and_says_so(tmp_path):
    out = tmp_path / "t"
    first = replaydiff.record(out)
    first.start()
    try:
        results = []

        def second() -> None:
            with replaydiff.record(out):
                results.append(_step())

        said = _warnings_of(second)
        expected = _step()  # the job's own result, recorded by the first recording
    finally:
        first.stop()
    assert len(said) == 1 and "recording is off" in said[0] and str(out) in said[0], said
    assert "another recording" in said[0]
    assert torch.equal(results[0], expected)  # the job ran, untouched
    rt = replaydiff.open_trace(out).rank(0)  # the first recording's trace, whole
    assert rt.complete and [op.name for op in rt].count("aten.mm.default") == 2
    assert sorted(p.name for p in out.iterdir()) == ["rank0"]  # the claim is gone with the recording


def test_a_finished_recording_leaves_only_its_trace_and_a_new_one_after_it_is_refused_as_before(tmp_path):
    out = tmp_path / "t"
    with replaydiff.record(out):
        _step()
    assert sorted(p.name for p in out.iterdir()) == ["rank0"]
    said = _warnings_of(lambda: replaydiff.record(out).start().stop())
    assert len(said) == 1 and "already holds a trace" in said[0], said
    assert replaydiff.open_trace(out).rank(0).complete


def test_a_claim_released_between_anothers_create_and_its_read_is_taken_not_refused(tmp_path, monkeypatch):
    """Rank 0 of a 2-rank recording ends its block (and releases its claim) in the instant between rank 1's failed
    create of the marker and rank 1's read of it: rank 1 finds no marker. The directory is free then: rank 1 claims
    it and records (it was refused as held by "a recording whose marker cannot be read", and a crashed 2-rank
    recording held rank 0 alone: seen under load in test_partial_trace's parallel test)."""
    from replaydiff.trace import ownership

    out, job = tmp_path / "t", "job rdzv@127.0.0.1:29500"
    assert ownership.claim(out, job)  # rank 0's claim
    read = ownership._read_settled

    def rank0_ends_first(marker):
        ownership.release(out, job)
        return read(marker)

    monkeypatch.setattr(ownership, "_read_settled", rank0_ends_first)
    assert ownership.claim(out, job) is True  # rank 1 now holds the claim and releases it when it ends
    assert ownership.holder(out).token == job and ownership.holder(out).pid == os.getpid()


def test_a_recording_killed_here_leaves_a_claim_a_later_recording_takes_over(tmp_path):
    """The claim of a process that is gone (same host) is stale: the next recording takes the directory over."""
    out = tmp_path / "t"
    code = f"import os, replaydiff\nr = replaydiff.record({str(out)!r}).start()\nos._exit(0)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "1"})  # killed while recording rank 1 of the directory
    assert done.returncode == 0, done.stderr
    left = sorted(p.name for p in out.iterdir())
    assert len(left) == 2 and "rank1" in left  # its claim, and what it wrote
    said = _warnings_of(lambda: replaydiff.record(out).__enter__().__exit__(None, None, None))
    assert said == []
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]  # recorded, and the claim released


def _unwritable_dir(tmp_path: Path) -> tuple[Path, str]:
    """A directory that cannot be written, and the reason said for it: a read-only tmpfs where this user may mount
    one (root in a container, where chmod stops nothing), else a directory without write permission."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        return ro, "permission denied"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"root here, and no read-only mount allowed ({done.stderr.decode().strip()}): chmod stops "
                    f"nothing for root")
    return ro, "read-only file system"


@pytest.fixture
def unwritable(tmp_path):
    ro, why = _unwritable_dir(tmp_path)
    yield ro, why
    if os.geteuid() == 0:
        subprocess.run(["umount", str(ro)], capture_output=True)
    else:
        ro.chmod(0o755)


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_record_into_an_output_that_cannot_be_written_is_one_line_before_the_job(where, tmp_path, capsys, request):
    if where == "under_a_file":
        (tmp_path / "notes.txt").write_text("a file, not a directory")
        out, why = tmp_path / "notes.txt" / "trace", f"{tmp_path / 'notes.txt'} is a file, not a directory"
    else:
        ro, why = request.getfixturevalue("unwritable")
        out = ro / "trace" if why == "permission denied" else ro
    marker = tmp_path / "job-ran"
    code = main(["record", "-o", str(out), "--", sys.executable, "-c", JOB.format(marker=str(marker))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and str(out) in err[0] and why in err[0], err
    assert "Traceback" not in err[0]
    assert not marker.exists(), "the job started"


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_the_python_api_into_an_output_that_cannot_be_written_warns_once_and_the_job_runs(where, tmp_path, request):
    if where == "under_a_file":
        (tmp_path / "notes.txt").write_text("a file, not a directory")
        out, why = tmp_path / "notes.txt" / "trace", "is a file, not a directory"
    else:
        ro, why = request.getfixturevalue("unwritable")
        out = ro / "trace" if why == "permission denied" else ro
    results = []

    def job() -> None:
        with replaydiff.record(out):
            results.append(_step())

    said = _warnings_of(job)
    assert len(said) == 1 and str(out) in said[0] and why in said[0] and "recording is off" in said[0], said
    assert torch.equal(results[0], _step())
