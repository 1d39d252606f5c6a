"""`replaydiff replay` and `replaydiff demo` as a user runs them: a subprocess, exit codes, one-line errors, the
replaydiff.replay/1 JSON document, and nothing on stderr meant for a terminal when output is piped. Where the process
is not the subject (the JSON document, tolerances, --resume), the CLI runs in this process (conftest's cli_here)."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import replay_helpers as rh
from replaydiff.compare import FloatError, ScalarMismatch, Verdict
from replaydiff.replay import OpResult, ReplayReport, Status
from replaydiff.replay.result import STATUSES
from replaydiff.report import report_to_json
from replaydiff.trace.format import DATA_DIR, MANIFEST, OPS_DIR

OP_KEYS = {"rank", "index", "op", "status", "module", "phase", "source", "forward_index", "metrics", "reason"}


@pytest.fixture(autouse=True, scope="module")
def journals_in_a_temporary_cache(tmp_path_factory):
    """The CLI keeps a journal of judged ops in the user's cache folder: here in a temporary one."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # stdout and stderr are pipes: the CLI must behave as it does under CI or in `| tee`
    return subprocess.run([sys.executable, "-m", "replaydiff", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *must_contain: str) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("replaydiff: error:")]
    assert len(errors) == 1, proc.stderr
    for text in must_contain:
        assert text in errors[0], proc.stderr


def _no_constants(name: str):
    raise AssertionError(f"JSON report contains the non-standard literal {name}")


@pytest.fixture(scope="module")
def mlp_fault() -> tuple[Path, int]:
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(rh.step_trace("mlp")), rh.MATMULS, "forward")
    path = rh.step_trace("mlp", name, rel=1e-3, occurrence=occurrence)
    return path, rh.occurrence_index(rh.trace_ops(path), name, occurrence)


def test_clean_trace_exits_0():
    proc = run_cli("replay", str(rh.step_trace("mlp")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 divergent" in proc.stdout and "no divergent op" in proc.stdout
    assert "replaying" not in proc.stderr  # no progress bar when stderr is not a terminal


def test_planted_fault_exits_1_and_names_the_op(mlp_fault):
    path, index = mlp_fault
    proc = run_cli("replay", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    culprit = [line for line in proc.stdout.splitlines() if line.startswith("first divergent op")]
    assert len(culprit) == 1 and f"#{index} " in culprit[0], proc.stdout
    assert "replaying" not in proc.stderr


def test_wide_tolerance_silences_the_planted_fault(mlp_fault, cli_here):
    path, _ = mlp_fault
    proc = cli_here("replay", str(path), "--tolerance", "float32=1e9,1e9")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 divergent" in proc.stdout



def test_tolerance_takes_the_short_dtype_names_of_precision(mlp_fault, capsys):
    """`--tolerance fp32=...` (the name --precision uses) set a limit nothing read: the fault still diverged."""
    path, _ = mlp_fault
    proc = run_main(capsys, "replay", str(path), "--tolerance", "fp32=1e9,1e9", "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tolerances = json.loads(proc.stdout)["options"]["tolerances"]
    assert tolerances["float32"] == [1e9, 1e9] and "fp32" not in tolerances


@pytest.mark.parametrize("item, names", [("float33=1", ["'float33'", "float32", "fp32", "bf16"]),
                                         ("int32=1", ["'int32'", "float32"]),
                                         ("float32=abc", ["float32=abc", "must be numbers"]),
                                         ("fp32=-1", ["fp32=-1", "must be positive"])],
                         ids=["misspelled", "integer", "not-a-number", "negative"])
def test_a_bad_tolerance_is_a_usage_error_naming_the_flag(capsys, item, names):
    """`--tolerance float33=1` (no such dtype) and `float32=abc` (no number) are usage errors naming the flag, not
    a replay without the tolerance or Python's "could not convert string to float"."""
    proc = run_main(capsys, "replay", str(rh.step_trace("mlp")), "--tolerance", item)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_line_error(proc, "--tolerance", *names)
    assert proc.stdout == ""


def test_the_culprit_of_a_trace_of_one_rank_other_than_0_names_its_rank(tmp_path, monkeypatch, capsys):
    """A trace recorded with --ranks 1 printed "first divergent op #20 ..." without the rank (its JSON said 1)."""
    from replaydiff.faults import PlantedFault

    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(rh.step_trace("mlp")), rh.MATMULS, "forward")
    monkeypatch.setenv("RANK", "1")
    path = rh.record_fn(tmp_path / "t", rh.mlp_step(), PlantedFault(name, rel=1e-3, call=occurrence + 1))
    index = rh.occurrence_index(rh.trace_ops(path, rank=1), name, occurrence)
    proc = run_main(capsys, "replay", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    culprit = [line for line in proc.stdout.splitlines() if line.startswith("first divergent op")]
    assert len(culprit) == 1 and culprit[0].startswith(f"first divergent op rank 1 #{index} {name}"), proc.stdout


def test_json_report_on_stdout(cli_here):
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(rh.step_trace("transformer")), rh.MATMULS, "forward")
    path = rh.step_trace("transformer", name, rel=1e-3, occurrence=occurrence)
    ops = rh.trace_ops(path)
    index = rh.occurrence_index(ops, name, occurrence)

    proc = cli_here("replay", str(path), "--json", "-")
    assert proc.returncode == 1, proc.stderr
    assert "replaying" not in proc.stderr
    doc = json.loads(proc.stdout, parse_constant=_no_constants)  # the whole of stdout is the document

    assert doc["format"] == "replaydiff.replay/1"
    assert doc["trace"] == str(path)
    assert doc["options"]["device"] == "cpu" and doc["options"]["precision"] == "fp64"
    assert doc["warnings"] == []
    summary = doc["summary"]
    assert set(summary) == set(STATUSES) and all(isinstance(v, int) for v in summary.values())
    assert sum(summary.values()) == len(doc["ops"]) == len(ops)
    assert summary["divergent"] == 1 and summary["error"] == 0

    first = doc["first_divergent"]
    assert OP_KEYS <= set(first)
    assert (first["rank"], first["index"], first["op"], first["phase"]) == (0, index, name, "forward")
    assert first["module"].startswith("TinyTransformer.")
    assert "tiny.py:" in first["source"]
    for key in ("rel_l2", "max_abs", "norm_max", "norm_rel", "limit_max"):
        assert isinstance(first["metrics"][key], float) and math.isfinite(first["metrics"][key])
    assert first["metrics"]["norm_max"] > first["metrics"]["limit_max"]
    assert isinstance(first["reason"], str) and first["reason"]
    assert doc["first_nondeterministic"] is None and doc["nonfinite_origin"] is None

    assert [o["index"] for o in doc["ops"]] == [op.index for op in ops]
    for entry, op in zip(doc["ops"], ops):
        assert OP_KEYS <= set(entry)
        assert entry["rank"] == 0 and entry["op"] == op.name and entry["phase"] == op.phase
        assert entry["module"] == op.module
        assert entry["status"] in STATUSES
        assert entry["metrics"] is None or isinstance(entry["metrics"], dict)
        assert entry["reason"] is None or isinstance(entry["reason"], str)
    assert doc["ops"][[o["index"] for o in doc["ops"]].index(index)] == first


def test_json_report_to_a_file_with_a_nan_origin(tmp_path, cli_here):
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(rh.step_trace("mlp")), rh.MATMULS, "forward")
    path = rh.step_trace("mlp", name, rel=float("nan"), occurrence=occurrence)
    index = rh.occurrence_index(rh.trace_ops(path), name, occurrence)
    out = tmp_path / "report.json"
    proc = cli_here("replay", str(path), "--json", str(out))
    assert proc.returncode == 1, proc.stderr
    assert "first divergent op" in proc.stdout and "NaN/Inf origin" in proc.stdout  # text still on stdout
    text = out.read_text()
    doc = json.loads(text, parse_constant=_no_constants)
    assert doc["nonfinite_origin"]["index"] == index == doc["first_divergent"]["index"]
    assert doc["first_divergent"]["metrics"]["nonfinite_mismatch"] > 0


def test_non_finite_metrics_are_written_as_strings():
    inf, nan = float("inf"), float("nan")
    report = ReplayReport(trace="t", options={"device": "cpu", "precision": "fp64", "floor": float("-inf")})
    error = FloatError(max_abs=1.0, rel_l2=nan, norm_max=inf, norm_rel=nan, cosine=-inf)
    report.ops.append(OpResult(rank=0, index=3, op="aten.mm.default", status=Status.DIVERGENT, phase="forward",
                               verdict=Verdict(True, error, "r", limit_max=16.0, limit_rel=8.0), reason="r"))
    text = json.dumps(report_to_json(report))
    doc = json.loads(text, parse_constant=_no_constants)
    assert doc["first_divergent"]["metrics"] == {"norm_max": "inf", "rel_l2": "nan", "max_abs": 1.0,
                                                 "norm_rel": "nan", "cosine": "-inf", "nonfinite_mismatch": 0,
                                                 "nonfinite_recorded": 0, "nonfinite_reference": 0,
                                                 "limit_max": 16.0, "limit_rel": 8.0}
    assert doc["options"]["floor"] == "-inf"
    assert doc["ops"] == [doc["first_divergent"]]
    # Non-finite values nested inside the metrics too.
    report.ops[0].verdict = Verdict(True, ScalarMismatch(recorded=[-inf, 2.0], reference=nan), "r")
    doc = json.loads(json.dumps(report_to_json(report)), parse_constant=_no_constants)
    assert doc["first_divergent"]["metrics"] == {"recorded": ["-inf", 2.0], "reference": "nan"}


def _flip_bytes(path: Path, start: int, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    start = max(0, min(start, len(data) - n))
    for k in range(start, start + n):
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def copied_trace(tmp_path) -> Path:
    dst = tmp_path / "trace"
    shutil.copytree(rh.step_trace("mlp"), dst)
    return dst


def test_damaged_ops_chunk_exits_3_with_one_line_naming_the_file(copied_trace):
    chunk = sorted((copied_trace / "rank0" / OPS_DIR).iterdir())[0]
    _flip_bytes(chunk, chunk.stat().st_size // 2)
    proc = run_cli("replay", str(copied_trace))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert_one_line_error(proc, str(chunk))


def test_damaged_manifest_exits_3(copied_trace):
    manifest = copied_trace / "rank0" / MANIFEST
    _flip_bytes(manifest, 20)
    proc = run_cli("replay", str(copied_trace))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert_one_line_error(proc, str(manifest))


def test_damaged_tensor_data_exits_3_not_clean(copied_trace):
    """A data file whose bytes fail their checksum is a damaged trace, not a healthy op: exit 3, naming the file."""
    data = sorted((copied_trace / "rank0" / DATA_DIR).iterdir())[0]
    _flip_bytes(data, data.stat().st_size - 200, 100)  # inside the stored tensors, past the safetensors header
    proc = run_cli("replay", str(copied_trace))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert_one_line_error(proc, str(data))


def test_missing_cuda_device_exits_4(tmp_path):
    # "cuda" on a machine without CUDA; on one with CUDA, an index past the last device: both are missing devices
    device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    proc = run_cli("replay", str(rh.step_trace("mlp")), "--device", device)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert_one_line_error(proc, "cuda")
    assert proc.stdout == ""


@pytest.mark.parametrize("bad", [["--precision", "fp16"], ["--tolerance", "float32"], ["--repeat", "0"]],
                         ids=["precision", "tolerance", "repeat"])
def test_bad_option_exits_2(bad):
    proc = run_cli("replay", str(rh.step_trace("mlp")), *bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_line_error(proc)
    assert proc.stdout == ""


def test_a_mistyped_option_prints_the_usage_of_its_verb(capsys):
    """`replay TRACE --bogus` printed `usage: replaydiff [-h] [--version] [-v] COMMAND ...`, not replay's usage."""
    with pytest.raises(SystemExit) as exc:
        run_main(capsys, "replay", str(rh.step_trace("mlp")), "--bogus")
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("usage: replaydiff replay ") and "--precision" in err, err
    assert err.splitlines()[-1] == "replaydiff: error: unrecognized arguments: --bogus"


def test_demo_names_the_planted_op():
    proc = run_cli("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    culprit = [line for line in proc.stdout.splitlines() if line.startswith("culprit found:")]
    assert len(culprit) == 1 and "native_layer_norm_backward" in culprit[0], proc.stdout
    assert "named the planted op" in proc.stdout
    assert "did NOT" not in proc.stdout
    assert "replaying" not in proc.stderr
    # the report names the trace's temporary directory: the last line says it is gone and how to keep one
    tmp = re.search(r"^replayed \d+ ops of (\S+) ", proc.stdout, re.M).group(1)
    assert proc.stdout.splitlines()[-1] == f"(the trace {tmp} was temporary and is deleted now: `replaydiff demo -o " \
                                           f"DIR` keeps it for show, replay, repro and tui)"
    assert not Path(tmp).exists()


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (no torch import to wait for), its outcome in run_cli's form."""
    from replaydiff.cli.main import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["replaydiff", *args], code, out, err)


@pytest.mark.parametrize("tensors", ["stats", "meta"])
def test_a_trace_without_tensor_data_cannot_be_replayed(tmp_path, capsys, tensors):
    """Replaying statistics or shapes would skip nearly every op and then say "no divergent op", exit 0: a trace that
    cannot be replayed says so, and what it is for, with the usage exit code."""
    import replaydiff
    from replaydiff.errors import UsageError
    from replaydiff.replay import ReplayOptions, replay_trace

    with replaydiff.record(tmp_path / "t", tensors=tensors):
        x = torch.randn(4, 4)
        (x @ x.T).relu()
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_line_error(proc, "cannot be replayed", f"--tensors {tensors}", "--tensors full", "diff", "show")
    assert "trend" not in proc.stderr  # one step: trend has no series to draw
    assert proc.stdout == ""
    with pytest.raises(UsageError, match="cannot be replayed"):  # the library says the same
        replay_trace(str(tmp_path / "t"), ReplayOptions())


def test_an_op_range_that_selects_nothing_is_a_usage_error(capsys):
    """`--from` past the last op, or after `--to`, replayed 0 ops and exited 0 ("no divergent op")."""
    from replaydiff import open_trace

    path = str(rh.step_trace("mlp"))
    last = open_trace(path).rank(0).last_index
    for args, said in ((["--from", str(last + 100)], f"past the last op (#{last})"),
                       (["--from", "10", "--to", "5"], "--from 10 is after --to 5"),
                       (["--to", "-1"], "count from 0")):
        proc = run_main(capsys, "replay", path, *args)
        assert proc.returncode == 2, (args, proc.stdout + proc.stderr)
        assert_one_line_error(proc, said)
        assert proc.stdout == ""
    # the last op alone is a range, and so is a --to past the end
    proc = run_main(capsys, "replay", path, "--from", str(last), "--to", str(last + 50))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"replayed 1 ops of {path}"), proc.stdout


def test_an_ops_glob_that_selects_nothing_is_a_usage_error(capsys):
    """`--ops 'nosuch*'` selects no op: a usage error (exit 2), not a clean replay of nothing."""
    path = str(rh.step_trace("mlp"))
    proc = run_main(capsys, "replay", path, "--ops", "nosuch*")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"replaydiff: error: --ops nosuch* matches no op of the trace, so nothing would be " \
                          f"replayed (`replaydiff show {path} --list` lists the ops)\n"
    assert proc.stdout == ""
    proc = run_main(capsys, "replay", path, "--ops", "aten.mm*", "--from", "0", "--to", "0")
    assert proc.returncode == 2 and "matches no op of the trace within --from/--to" in proc.stderr, proc.stderr
    proc = run_main(capsys, "replay", path, "--ops", "nosuch*", "--ops", "aten.mm*")
    assert proc.returncode == 0 and "skipped" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("verb", ["replay", "diff", "trend"])
def test_a_json_file_in_a_missing_directory_is_refused_before_the_work(capsys, tmp_path, verb):
    """`replay --json /nonexistent/dir/x.json` replayed everything, then died in a FileNotFoundError traceback."""
    path = str(rh.step_trace("mlp"))
    dest = str(tmp_path / "nosuch" / "x.json")
    traces = [path, path] if verb == "diff" else [path]
    proc = run_main(capsys, verb, *traces, "--json", dest)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"replaydiff: error: --json {dest}: the directory {tmp_path / 'nosuch'} does not exist\n"
    assert proc.stdout == ""  # refused before a single op was replayed or compared
    proc = run_main(capsys, verb, *traces, "--json", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.endswith("is a directory: give a file name\n"), proc.stderr


@pytest.mark.slow
def test_demo_counts_occurrences_from_1_like_plant(tmp_path, cli_here):
    """`--plant OP:N` counts calls from 1; `demo --occurrence N` counts the same way."""
    from replaydiff import open_trace

    proc = cli_here("demo", "--occurrence", "2", "-o", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = open_trace(tmp_path / "t").rank(0)
    calls = [i for i in range(len(r)) if r.index.name[i] == "aten.native_layer_norm_backward.default"]
    planted = [line for line in proc.stdout.splitlines() if line.startswith("planted fault:")]
    culprit = [line for line in proc.stdout.splitlines() if line.startswith("culprit found:")]
    assert len(planted) == 1 and f"#{calls[1]} " in planted[0], proc.stdout  # the second call
    assert len(culprit) == 1 and f"#{calls[1]} " in culprit[0], proc.stdout
    proc = run_cli("demo", "--occurrence", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_line_error(proc, "--occurrence counts from 1")


def _run_cli_from(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI as its console script runs it (``from replaydiff.cli.main import main``, from a script outside
    ``cwd``), with ``cwd`` as the current directory."""
    launcher = cwd.parent / "launch_replaydiff.py"
    launcher.write_text("import sys\nfrom replaydiff.cli.main import main\nif __name__ == '__main__':\n"
                        "    sys.exit(main())\n")
    return subprocess.run([sys.executable, str(launcher), *args], capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL, cwd=cwd)


def test_workers_import_the_parents_replaydiff_whatever_the_current_directory(mlp_fault, tmp_path):
    """Run from a directory holding a ``replaydiff/`` folder (a checkout's parent), the workers imported that folder
    as an empty namespace package: ImportError in every worker, then a BrokenProcessPool traceback."""
    path, index = mlp_fault
    cwd = tmp_path / "work"
    (cwd / "replaydiff").mkdir(parents=True)
    proc = _run_cli_from(cwd, "replay", str(path), "--workers", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "ImportError" not in proc.stderr, proc.stderr
    culprit = [line for line in proc.stdout.splitlines() if line.startswith("first divergent op")]
    assert len(culprit) == 1 and f"#{index} " in culprit[0], proc.stdout


def test_a_worker_that_dies_is_one_line_and_exit_4(mlp_fault, tmp_path):
    """A worker process that stops (here: an --import module that leaves in worker processes only) is an
    environment problem told in one line, not a BrokenProcessPool traceback."""
    path, _ = mlp_fault
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "leave_in_workers.py").write_text(
        "import multiprocessing, os\nif multiprocessing.parent_process() is not None:\n    os._exit(3)\n")
    proc = _run_cli_from(cwd, "replay", str(path), "--workers", "2", "--import", "leave_in_workers")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert_one_line_error(proc, "a replay worker process stopped", "--workers 1")
    assert "BrokenProcessPool" not in proc.stderr


def test_ops_that_could_not_be_replayed_are_not_clean(tmp_path):
    """An op whose replay raised (here: a registered reference that fails, as --reference decomp's NotImplemented
    does) was never judged: replay exits 1 and says how many, as the health report fails its check and exits 1."""
    path = rh.step_trace("mlp")
    addmm = [op.index for op in rh.trace_ops(path) if op.name == "aten.addmm.default"]
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "failing_ref.py").write_text(
        "import replaydiff\n\ndef fail(*args, **kwargs):\n    raise RuntimeError('no reference here')\n\n"
        "replaydiff.register_reference('aten.addmm.default', fail)\n")
    proc = _run_cli_from(cwd, "replay", str(path), "--reference-module", "failing_ref",
                         "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].endswith(f" 0 divergent, 0 nondeterministic, 4 skipped, {len(addmm)} error"), \
        proc.stdout
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("  error ")] == \
        [f"#{i}" for i in addmm], proc.stdout
    assert f"not clean: {len(addmm)} op(s) could not be replayed" in proc.stdout
    assert "every replayed op matches" not in proc.stdout
    report = _run_cli_from(cwd, "report", str(path), "--replay", str(tmp_path / "r.json"), "--no-probe")
    assert report.returncode == 1, report.stdout + report.stderr
    assert f"| ops that could not be replayed | {len(addmm)} | 0 | FAIL |" in report.stdout, report.stdout


class _Interrupt(KeyboardInterrupt):
    pass


def test_the_journal_gives_back_a_verdicts_precision_as_a_precision():
    """A verdict judged at another precision than asked carries a Precision: journaled and read back for --resume it
    is that Precision again (not a string, nor a record the journal refuses)."""
    import msgpack

    from replaydiff.compare.metrics import FloatError
    from replaydiff.compare.verdict import Verdict
    from replaydiff.replay import journal
    from replaydiff.replay.policy import Precision

    v = Verdict(False, FloatError(1e-7, 1e-7, 0.5, 0.5, 1.0), limit_max=16.0, limit_rel=8.0, precision=Precision.FP32)
    back = journal._decode(msgpack.unpackb(msgpack.packb(journal._encode(v))))
    assert back == v and back.precision is Precision.FP32


def test_an_interrupted_replay_resumes_from_what_it_had_judged(mlp_fault, tmp_path, cli_here):
    """Ctrl-C after 20 ops, then `replay --resume`: only the other ops are replayed, and the report is the one an
    uninterrupted run gives (the planted op named, every status and figure the same)."""
    from replaydiff.replay import replay_trace
    from replaydiff.replay.policy import ReplayOptions

    path, index = mlp_fault
    journal = tmp_path / "journal"
    seen: list[int] = []

    def stop_after_20(r: OpResult) -> None:
        seen.append(r.index)
        if len(seen) == 20:
            raise _Interrupt()

    with pytest.raises(_Interrupt):
        replay_trace(str(path), ReplayOptions(), journal=journal, on_result=stop_after_20)
    assert len(list(journal.iterdir())) == 1  # the journal is kept for --resume

    whole = cli_here("replay", str(path), "--json", "-", "--journal", str(tmp_path / "other"))
    resumed = cli_here("replay", str(path), "--json", "-", "--resume", "--journal", str(journal))
    assert resumed.returncode == whole.returncode == 1, resumed.stderr
    assert "resuming: 20 op(s) judged by an earlier run kept" in resumed.stderr, resumed.stderr
    assert json.loads(resumed.stdout) == json.loads(whole.stdout)
    assert json.loads(resumed.stdout)["first_divergent"]["index"] == index
    assert list(journal.iterdir()) == []  # a finished replay removes its journal

    # Resumed in this process: the 20 judged ops are not replayed again.
    again: list[int] = []
    first_20 = list(seen[:20])
    seen.clear()
    with pytest.raises(_Interrupt):
        replay_trace(str(path), ReplayOptions(), journal=journal, on_result=stop_after_20)
    report = replay_trace(str(path), ReplayOptions(), journal=journal, resume=True,
                          on_result=lambda r: again.append(r.index))
    assert seen == first_20 and not set(again) & set(seen) and len(again) == len(report.ops) - 20
    cli_doc = json.loads(whole.stdout)
    assert cli_doc.pop("enters") is None  # the CLI's own field: where a difference enters a clean trace
    assert report_to_json(report) == cli_doc


def test_resume_ignores_a_journal_of_other_options(mlp_fault, tmp_path, cli_here):
    """A journal belongs to one trace and one set of options: --resume with other options replays every op."""
    path, _ = mlp_fault
    journal = tmp_path / "journal"
    first = cli_here("replay", str(path), "--to", "5", "--journal", str(journal))
    assert first.returncode in (0, 1)
    proc = cli_here("replay", str(path), "--precision", "fp32", "--resume", "--journal", str(journal))
    assert "nothing to resume" in proc.stderr, proc.stderr


def test_an_interrupted_replay_says_where_its_journal_is_and_resume_reads_it_there(mlp_fault, tmp_path, cli_here,
                                                                                    monkeypatch):
    """Ctrl-C names the journal's file holding the ops judged so far (in the user's cache folder by default), which
    is where --resume then finds them."""
    import replaydiff.cli.replay as verb

    path, _ = mlp_fault
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = verb.replay_trace

    def interrupted_after_20(*args, **kwargs):
        seen: list[OpResult] = []

        def stop(r: OpResult) -> None:
            seen.append(r)
            if len(seen) == 20:
                raise _Interrupt()

        return real(*args, on_result=stop, **kwargs)

    monkeypatch.setattr(verb, "replay_trace", interrupted_after_20)
    proc = cli_here("replay", str(path))
    assert proc.returncode == 130, proc.stderr
    (journal,) = (tmp_path / "cache" / "replaydiff" / "journals").iterdir()
    assert f"replaydiff: the ops judged so far are kept in {journal}: the same command with --resume replays only " \
           f"the rest (a finished replay removes that file)\n" in proc.stderr, proc.stderr
    monkeypatch.setattr(verb, "replay_trace", real)
    resumed = cli_here("replay", str(path), "--resume")
    assert f"resuming: 20 op(s) judged by an earlier run kept ({journal})" in resumed.stderr, resumed.stderr
    assert not journal.exists()


def test_replay_help_says_where_resume_finds_the_judged_ops(capsys):
    from replaydiff.cli.main import main

    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    resume = text[text.index("--resume "):text.index("--journal DIR folder")]
    assert "~/.cache/replaydiff/journals" in resume and "--journal DIR" in resume, resume


def test_progress_without_a_terminal_is_a_line_with_the_time_left(capsys):
    from replaydiff.cli.progress import PlainProgress

    now = [0.0]
    line = PlainProgress("replaying", 30.0, clock=lambda: now[0])
    line.set_total(1000)
    now[0] = 10.0
    line.advance(100)  # within the first 30 s: nothing
    now[0] = 40.0
    line.advance(100)  # 200 in 40 s: 5/s, 800 left: 160 s
    assert capsys.readouterr().err == "replaydiff: replaying: 200/1000 (5/s, about 2m40s left)\n"


TINY_TRAIN = (
    "import torch\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "x = torch.randn(8, 4)\n"
    "for _ in range(2):\n"
    "    opt.zero_grad()\n"
    "    model(x).sum().backward()\n"
    "    opt.step()\n")


def test_a_module_filter_that_matches_nothing_warns_and_judges_nothing(tmp_path, cli_here):
    """`record --module` with a typo stores no tensor data: record names the nearest module paths, replay says
    nothing was judged and exits 1 (never "every replayed op matches"), and the report fails its "ops judged"
    check."""
    (tmp_path / "train.py").write_text(TINY_TRAIN)
    rec = cli_here("record", "--step", "2", "--module", "Sequentail.0", "-o", "t", "--", sys.executable, "train.py",
                   cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    assert rec.stderr.splitlines()[-1] == (
        "replaydiff: warning: --module 'Sequentail.0' matched no op (the trace holds no tensor data to replay); "
        "modules seen: Sequential.0, Sequential.2, Sequential.1"), rec.stderr
    from replaydiff import open_trace

    (left,) = open_trace(tmp_path / "t").rank(0).data_left_out  # the manifest notes it; show prints it
    assert (left.reason, left.every_op) == ("filtered", True)
    assert "outside the record --module/--op filter (the filter matched no op)," in left.describe()
    proc = cli_here("replay", "t", "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    n = int(proc.stdout.split()[1])
    assert proc.stdout.splitlines()[-1] == f"nothing was judged: all {n} ops were skipped (reasons above)"
    assert "every replayed op matches" not in proc.stdout
    report = cli_here("report", "t", "--replay", str(tmp_path / "r.json"), "--no-probe", cwd=tmp_path)
    assert report.returncode == 1, report.stdout + report.stderr
    assert f"| ops judged | 0 of {n} | at least 1 | FAIL |" in report.stdout, report.stdout
    ok = cli_here("record", "--step", "2", "--module", "Sequential.0", "-o", "t2", "--", sys.executable, "train.py",
                  cwd=tmp_path)
    assert ok.returncode == 0 and "matched no op" not in ok.stderr, ok.stderr
    assert [x.every_op for x in open_trace(tmp_path / "t2").rank(0).data_left_out] == [False]


def test_a_clean_replay_of_one_whole_step_ends_with_the_verdict(tmp_path, capsys):
    """A healthy step 2 recorded whole replays clean: the summary ends there. It ended with a paragraph on recording
    steps 1-2 to see where a difference enters, which is for a zoom-in (a --module/--op filter) on a step trend named,
    not for every clean one-step trace."""
    import replaydiff

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with replaydiff.record(tmp_path / "t", steps="2"):
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == \
        "no divergent op: every replayed op matches its recorded output within tolerance", proc.stdout
