"""``replaydiff replay`` as a process (``python -m replaydiff``): its exit codes, one-line errors, ``demo``, and its
worker processes (the quick ones, the CLI's ``main`` in this process, are tests/integration/test_cli_replay.py)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import replay_helpers as rh
from replaydiff.trace.format import DATA_DIR, MANIFEST, OPS_DIR

from cli_replay_helpers import assert_one_line_error, journals_in_a_temporary_cache, mlp_fault  # noqa: F401 (fixtures)


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # stdout and stderr are pipes: the CLI must behave as it does under CI or in `| tee`
    return subprocess.run([sys.executable, "-m", "replaydiff", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


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
