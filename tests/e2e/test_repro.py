"""`replaydiff repro`: the generated script runs with only torch and safetensors (`python -I`, no replaydiff on the
path) and prints the same error as replay, for a plain op, an in-place op, a view-producing op and a random op.

Also `record --plant` as the public option: the manifest says a fault was planted and every report says so first.
"""
from __future__ import annotations

import io
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
import torch.nn.functional as F
from torch import nn

import replaydiff
from replaydiff.cli.main import main
from replaydiff.replay import ReplayOptions, replay_op, replay_trace
from replaydiff.report import render_replay, report_to_json

PLANT_MM = "aten.mm.default:2:1e-3"  # the second mm of the step: a backward matmul
PLANT_ADD = "aten.add_.Tensor:1:1e-3"  # the first add_: an in-place update in the optimizer


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(torch.relu(self.a(x)), 0.5, training=True))


def _step() -> None:
    torch.manual_seed(0)
    model = DropoutMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    F.mse_loss(model(x), y).backward()
    opt.step()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    out = {}
    for name, plant in (("mm", PLANT_MM), ("add", PLANT_ADD)):
        with replaydiff.record(root / name, plant=plant):
            _step()
        out[name] = root / name
    return out


def _nth(rt, name: str, n: int = 1):
    return [op for op in rt if op.name == name][n - 1]


def _run_script(d: Path, *args: str) -> subprocess.CompletedProcess:
    # -I: no PYTHONPATH, no user site, no current directory on sys.path: replaydiff cannot be imported
    return subprocess.run([sys.executable, "-I", str(d / "repro.py"), *args], capture_output=True, text=True,
                          cwd=d, timeout=120)


def _recorded_norm_max(stdout: str, label: str) -> tuple[float, str]:
    block = stdout.split(label, 1)[1]
    m = re.search(r"recorded vs reference:\s+max_abs/\(eps\*absmax\) (\S+) .*?  (DIVERGENT|ok)( - .*)?\n", block)
    assert m, stdout
    return float(m.group(1)), m.group(2)


@pytest.mark.slow
def test_plain_op_repro_prints_replays_error_and_needs_no_replaydiff(traces, tmp_path):
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    op = _nth(rt, "aten.mm.default", 2)
    assert rt.planted is not None and rt.planted.index == op.index
    assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(tmp_path / "r")]) == 0
    script = (tmp_path / "r" / "repro.py").read_text()
    assert "replaydiff" not in "".join(l for l in script.splitlines() if l.startswith(("import", "from")))
    p = _run_script(tmp_path / "r")
    assert p.returncode == 1, p.stderr  # the recording is divergent, as replay says
    assert p.stdout.splitlines()[0] == f"PLANTED FAULT (record --plant): {rt.planted.describe()}"
    value, verdict = _recorded_norm_max(p.stdout, "output 0")
    res, _ = replay_op(rt, op)
    assert verdict == "DIVERGENT" and res.verdict.divergent
    assert value == pytest.approx(res.verdict.measure.norm_max, rel=1e-3)
    # the CPU kernel itself is fine: the fault was planted below the recorder
    assert re.search(r"cpu run vs reference:\s+.* ok\n", p.stdout), p.stdout
    numel = math.prod(op.outputs_refs()[0].shape)
    differ = re.search(rf"cpu run vs recorded:.*\((\d+) of {numel} elements differ bit for bit\)", p.stdout)
    assert differ and int(differ.group(1)) > 0, p.stdout  # the kernel does not repeat the fault (zeros stay zeros)


@pytest.mark.slow
def test_in_place_op_repro_compares_the_written_argument(traces, tmp_path):
    rt = replaydiff.open_trace(traces["add"]).rank(0)
    op = _nth(rt, "aten.add_.Tensor", 1)
    assert rt.planted.index == op.index
    assert main(["repro", str(traces["add"]), str(op.index), "-o", str(tmp_path / "r")]) == 0
    p = _run_script(tmp_path / "r")
    assert p.returncode == 1, p.stderr  # the recorded write is divergent, as replay says
    value, verdict = _recorded_norm_max(p.stdout, "arg 0 (written)")
    res, _ = replay_op(rt, op)
    assert verdict == "DIVERGENT"
    assert value == pytest.approx(res.verdict.measure.norm_max, rel=1e-3)
    # the kernel run in the script wrote into its own copy of the argument, within the limit
    assert re.search(r"cpu run vs reference:\s+max_abs/\(eps\*absmax\) \S+ .* ok\n", p.stdout), p.stdout


def test_the_repro_script_is_a_module_that_checks_what_replay_compares(traces, tmp_path, capsys):
    """repro.py is replaydiff/rebuild_and_judge.py as it is (no template; the op is described in repro.json), it checks
    exactly the results replay compares, and imported and run in this process on the repro's directory it prints
    what the script prints, leaving this process's settings as they were."""
    from replaydiff import rebuild_and_judge
    from replaydiff.replay.compared import compared_outputs

    rt = replaydiff.open_trace(traces["add"]).rank(0)
    op = _nth(rt, "aten.add_.Tensor", 1)
    d = tmp_path / "r"
    assert main(["repro", str(traces["add"]), str(op.index), "-o", str(d)]) == 0
    assert (d / "repro.py").read_text() == Path(rebuild_and_judge.__file__).read_text()
    data = json.loads((d / "repro.json").read_text())
    # add_ returns its written argument: compared once, as the argument
    assert [c["label"] for c in data["checks"]] == [c.label for c in compared_outputs(op, False)] == \
        ["arg 0 (written)"]
    capsys.readouterr()
    deterministic, precision = torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision()
    assert rebuild_and_judge.main([], directory=str(d)) == 1  # the planted write is divergent
    assert capsys.readouterr().out == _run_script(d).stdout
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision()) == \
        (deterministic, precision)


@pytest.mark.slow
def test_view_op_repro_rebuilds_the_view_geometry(traces, tmp_path):
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    op = _nth(rt, "aten.t.default", 1)
    ref = op.outputs_refs()[0]
    assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(tmp_path / "r")]) == 0
    p = _run_script(tmp_path / "r")
    assert p.returncode == 0, p.stderr
    assert (f"output 0 (a view of an input): shape {list(ref.shape)} stride {list(ref.stride)} offset {ref.offset}"
            f" - as recorded") in p.stdout


@pytest.mark.slow
def test_random_op_repro_redraws_from_the_recorded_generator_state(traces, tmp_path):
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    op = next(o for o in rt if o.rng is not None)
    assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(tmp_path / "r")]) == 0
    p = _run_script(tmp_path / "r")
    assert p.returncode == 0, p.stderr
    assert "recorded dtypes from the recorded generator state" in p.stdout
    assert re.search(r"recorded vs reference:\s+mismatches 0 of \d+ \(compared exactly\)  ok", p.stdout), p.stdout
    assert re.search(r"cpu run vs reference:\s+mismatches 0 of \d+ \(compared exactly\)  ok", p.stdout), p.stdout
    assert re.search(r"cpu run vs recorded:\s+mismatches 0 of \d+ .*\(0 of \d+ elements differ bit for bit\)",
                     p.stdout), p.stdout


def test_repro_never_overwrites_without_force_and_refuses_ops_that_cannot_run_alone(traces, tmp_path, capsys):
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    op = _nth(rt, "aten.mm.default", 1)
    d = tmp_path / "r"
    assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(d)]) == 0
    assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(d)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(d), "--force"]) == 0
    marker = next(o for o in rt if o.name.startswith("profiler."))  # the optimizer's record_function markers
    assert main(["repro", str(traces["mm"]), str(marker.index), "-o", str(tmp_path / "m")]) == 2
    assert "profiler marker" in capsys.readouterr().err
    assert main(["repro", str(traces["mm"]), str(len(rt) + 5), "-o", str(tmp_path / "x")]) == 2


def test_planted_fault_is_in_the_manifest_and_first_in_every_report(traces, tmp_path, capsys):
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    assert rt.options.plant == PLANT_MM
    planted = rt.planted
    assert (planted.op, planted.call, planted.rel, planted.landed) == ("aten.mm.default", 2, 1e-3, True)
    # a plant that changed its result is named as it always was; the manifest also counts what it changed
    assert planted.describe() == f"aten.mm.default call 2 x(1+0.001), op #{planted.index} on rank 0"
    e = planted.effect
    assert (e.dtype, e.changed, e.nonfinite) == ("float32", e.nonzero, 0) and e.changed > 0
    assert 2 ** 23 * 1e-3 - 1 <= e.max_ulps <= 2 ** 24 * 1e-3 + 1  # 1e-3 relative is 8389 to 16777 float32 ulps
    report = replay_trace(str(traces["mm"]), ReplayOptions())
    assert report.first_divergent.index == planted.index
    text = io.StringIO()
    render_replay(report, text)
    first = text.getvalue().splitlines()[0]
    assert first.startswith("PLANTED FAULT") and f"op #{planted.index}" in first
    assert report_to_json(report)["planted"] == [planted.describe()]


def test_a_trace_written_before_plants_were_counted_still_reads_and_replays(traces, tmp_path):
    """The manifest's plant entry as older versions wrote it (no calls_seen, no effect): named as it always was."""
    from replaydiff.trace.format import MANIFEST, pack_frame, read_frame, write_atomic

    old = tmp_path / "old"
    shutil.copytree(traces["mm"], old)
    manifest = old / "rank0" / MANIFEST
    m = read_frame(manifest)
    m["planted"] = {k: m["planted"][k] for k in ("op", "call", "rel", "landed")}
    write_atomic(manifest, pack_frame(m, None))
    planted = replaydiff.open_trace(old).rank(0).planted
    assert (planted.calls_seen, planted.effect) == (None, None)
    assert planted.describe() == f"aten.mm.default call 2 x(1+0.001), op #{planted.index} on rank 0"
    report = replay_trace(str(old), ReplayOptions())
    assert report.first_divergent.index == planted.index
    assert [(p["outcome"], p["note"]) for p in report_to_json(report)["plants"]] == [("found", None)]


STEP_SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_record_command_plants_through_the_step_hook_and_replay_names_the_op(tmp_path, capsys):
    (tmp_path / "train.py").write_text(STEP_SCRIPT)
    trace = tmp_path / "trace"
    code = main(["record", "--step", "2", "--plant", "addmm:2:1e-3", "-o", str(trace), "--",
                 sys.executable, str(tmp_path / "train.py")])
    assert code == 0
    assert "a fault was planted (addmm:2:1e-3)" in capsys.readouterr().err
    rt = replaydiff.open_trace(trace).rank(0)
    planted = rt.planted
    assert planted.op == "aten.addmm.default" and planted.landed
    assert planted.index == _nth(rt, "aten.addmm.default", 2).index
    assert main(["replay", str(trace)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PLANTED FAULT") and f"op #{planted.index}" in out[0]
    assert any(l.startswith(f"first divergent op #{planted.index} aten.addmm.default") for l in out)
    assert main(["show", str(trace)]) == 0
    assert capsys.readouterr().out.startswith("PLANTED FAULT")


def test_plant_spec_is_checked_where_options_are_made():
    from replaydiff.record import RecordOptions

    with pytest.raises(ValueError, match="OP\\[:N\\[:REL\\]\\]"):
        RecordOptions.make(plant="aten.mm.default:x:y:z")
    with pytest.raises(ValueError, match="from 1"):
        RecordOptions.make(plant="mm:0")
    assert main(["record", "--plant", "mm:0", "-o", "unused", "--", "true"]) == 2


@pytest.mark.gpu
def test_repro_of_a_cuda_op_runs_on_cuda_and_on_the_cpu_reference(tmp_path):
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(64, 64, device="cuda")
    with replaydiff.record(tmp_path / "t", plant="aten.mm.default:1:1e-3"):
        (a @ b).sum().item()
    rt = replaydiff.open_trace(tmp_path / "t").rank(0)
    op = _nth(rt, "aten.mm.default", 1)
    assert main(["repro", str(tmp_path / "t"), str(op.index), "-o", str(tmp_path / "r")]) == 0
    p = _run_script(tmp_path / "r", "--device", "cuda")
    assert p.returncode == 1, p.stderr + p.stdout  # the recording is divergent; the CUDA kernel is not
    assert _recorded_norm_max(p.stdout, "output 0")[1] == "DIVERGENT"
    assert re.search(r"cuda run vs reference:\s+max_abs/\(eps\*absmax\) \S+ .* ok\n", p.stdout), p.stdout


def test_repro_on_a_device_this_torch_lacks_is_one_line_and_exit_4(traces, tmp_path):
    """`python repro.py --device cuda` on a CPU-only torch raised an AssertionError from torch.cuda."""
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    op = _nth(rt, "aten.mm.default", 1)
    assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(tmp_path / "r")]) == 0
    absent = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    p = _run_script(tmp_path / "r", "--device", absent)
    assert p.returncode == 4, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"device {absent!r}" in lines[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_repro_files_follow_the_umask(traces, tmp_path, umask, mode):
    """Every file of a repro, inputs.safetensors too (safetensors writes it mode 600), follows the umask: the repro
    is handed to others."""
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    op = _nth(rt, "aten.mm.default", 1)
    old = os.umask(umask)
    try:
        assert main(["repro", str(traces["mm"]), str(op.index), "-o", str(tmp_path / "r")]) == 0
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "r").iterdir()} == \
        {"repro.py": mode, "repro.json": mode, "inputs.safetensors": mode}


def test_repro_force_overwrites_only_a_repro(traces, tmp_path, capsys):
    """--force replaces repro.py and inputs.safetensors that `replaydiff repro` wrote, never a user's file of
    that name, and a file given as -o is one line, not a traceback."""
    rt = replaydiff.open_trace(traces["mm"]).rank(0)
    op = _nth(rt, "aten.mm.default", 1)
    argv = ["repro", str(traces["mm"]), str(op.index), "--force", "-o"]
    d = tmp_path / "mine"
    d.mkdir()
    (d / "repro.py").write_text("print('my own repro')\n")
    assert main(argv + [str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "repro.py" in err[0] and "not" in err[0], err
    assert (d / "repro.py").read_text() == "print('my own repro')\n" and not (d / "inputs.safetensors").exists()
    (d / "repro.py").unlink()
    (d / "inputs.safetensors").write_bytes(b"mine")
    assert main(argv + [str(d)]) == 2
    assert "inputs.safetensors" in capsys.readouterr().err
    assert (d / "inputs.safetensors").read_bytes() == b"mine"
    assert main(argv + [str(tmp_path / "r")]) == 0
    assert main(argv + [str(tmp_path / "r")]) == 0  # a repro it wrote: replaced
    capsys.readouterr()
    (tmp_path / "f").write_text("a file")
    assert main(argv + [str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a directory" in err[0], err


def test_repro_imports_no_module_the_trace_names_unless_asked(tmp_path, capsys):
    """A received trace names the module of its custom op; a file of that name sits where the user runs repro.py."""
    from replay_helpers import SHIPPED_MODULE, record_shipped_custom_op

    (tmp_path / "home").mkdir()
    custom_trace = record_shipped_custom_op(tmp_path / "home", tmp_path / "t")
    index = _nth(replaydiff.open_trace(custom_trace).rank(0), "rdtrust.twice.default", 1).index
    assert main(["repro", str(custom_trace), str(index), "-o", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "custom op" in line]
    assert len(said) == 1 and "rdtrust_shipped" in said[0] and "--import" in said[0], out
    # the module the trace names, beside where the user runs the script
    work = tmp_path / "work"
    work.mkdir()
    (work / "rdtrust_shipped.py").write_text(SHIPPED_MODULE)
    p = subprocess.run([sys.executable, str(tmp_path / "r" / "repro.py")], cwd=work, capture_output=True, text=True,
                       timeout=120)
    assert not (work / "imported.txt").exists(), "the script imported a module named by the trace"
    assert p.returncode == 4 and p.stdout == "", p.stderr + p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--import rdtrust_shipped" in lines[0], p.stderr
    # with the user's word, the module runs (from the working directory) and the op is judged
    p = subprocess.run([sys.executable, str(tmp_path / "r" / "repro.py"), "--import", "rdtrust_shipped"], cwd=work,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    assert (work / "imported.txt").exists() and "rdtrust.twice.default" in p.stdout
