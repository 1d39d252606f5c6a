"""`replaydiff replay` and `replaydiff demo` run by the CLI's ``main`` in this process (conftest's cli_here): exit
codes, one-line errors, the replaydiff.replay/1 JSON document, tolerances, --resume, and nothing on stderr meant for a
terminal when output is piped. As a subprocess, and with worker processes: tests/e2e/test_cli_replay_e2e.py."""
from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

import replay_helpers as rh
from replaydiff.compare import FloatError, ScalarMismatch, Verdict
from replaydiff.replay import OpResult, ReplayReport, Status
from replaydiff.replay.result import STATUSES
from replaydiff.report import report_to_json

from cli_replay_helpers import assert_one_line_error, journals_in_a_temporary_cache, mlp_fault  # noqa: F401 (fixtures)


OP_KEYS = {"rank", "index", "op", "status", "module", "phase", "source", "forward_index", "metrics", "reason"}


def _no_constants(name: str):
    raise AssertionError(f"JSON report contains the non-standard literal {name}")


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


def test_json_report_on_stdout_is_the_whole_document_with_every_op_and_the_culprit(cli_here):
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


def test_a_mistyped_option_is_one_line_naming_the_help_of_its_verb(capsys):
    """`replay TRACE --bogus`: one line (not argparse's usage block) that points to replay's own --help."""
    with pytest.raises(SystemExit) as exc:
        run_main(capsys, "replay", str(rh.step_trace("mlp")), "--bogus")
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == "replaydiff: error: unrecognized arguments: --bogus (see `replaydiff replay --help`)\n", err


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
    """`--op 'nosuch*'` selects no op: a usage error (exit 2), not a clean replay of nothing; the former spelling
    ``--ops`` selects the same (last lines)."""
    path = str(rh.step_trace("mlp"))
    proc = run_main(capsys, "replay", path, "--op", "nosuch*")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"replaydiff: error: --op nosuch* matches no op of the trace, so nothing would be " \
                          f"replayed (`replaydiff show {path} --list` lists the ops)\n"
    assert proc.stdout == ""
    proc = run_main(capsys, "replay", path, "--ops", "aten.mm*", "--from", "0", "--to", "0")
    assert proc.returncode == 2 and "matches no op of the trace within --from/--to" in proc.stderr, proc.stderr
    proc = run_main(capsys, "replay", path, "--op", "nosuch*", "--ops", "aten.mm*")
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
