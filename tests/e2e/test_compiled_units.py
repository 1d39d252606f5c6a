"""Compiled units: torch.compile regions run compiled while recording, each call of a compiled graph one
record, replayed by interpreting its graph at float64; bugs planted in the compiler, not the model, are named.

Inductor compiles C++ on the CPU here (seconds per graph on two cores): those tests are marked slow. Inductor's FX
graph cache is off in them, so that a kernel compiled before a lowering was wrapped is never reused."""
from __future__ import annotations

import subprocess

import pytest
import torch

from tests.replay_helpers import faulty_gelu_pass
import replaydiff
from replaydiff.trace.reader import open_trace

IN, HID, OUT = 8, 16, 4


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.GELU(), torch.nn.Linear(HID, OUT))


def _step(compiled, opt, x) -> None:
    compiled(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _run(backend: str, path=None, compiled: str = "capture") -> list[torch.Tensor]:
    """Two steps of a compiled MLP (the first compiles, outside any recording), the second recorded when ``path``;
    then one more step. The parameters after it."""
    model = _mlp()
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cm = torch.compile(model, backend=backend)
    _step(cm, opt, x)
    if path is None:
        _step(cm, opt, x)
    else:
        with replaydiff.record(path, compiled=compiled):
            _step(cm, opt, x)
    _step(cm, opt, x)
    return [p.detach().clone() for p in model.parameters()]


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    from replaydiff.cli.main import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["replaydiff", *args], code, out, err)


def _units(path) -> list:
    rt = open_trace(path).rank(0)
    return [op for op in rt.iter_from(0) if op.name.startswith("compiled.unit.")]


@pytest.fixture
def no_graph_cache():
    from torch._inductor import config

    torch._dynamo.reset()
    with config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


def _check_bitwise_and_units(tmp_path, backend: str) -> None:
    plain = _run(backend)
    torch._dynamo.reset()
    recorded = _run(backend, tmp_path / "t")
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    units = _units(tmp_path / "t")
    assert [u.name for u in units] == ["compiled.unit.forward", "compiled.unit.backward"]
    fw = units[0].unit
    assert fw.backend == backend and fw.region.startswith("Sequential.forward")
    assert "aten.addmm.default" in [n.target for n in fw.calls()]


def test_recorded_aot_eager_step_is_the_compiled_step_and_holds_units(tmp_path):
    _check_bitwise_and_units(tmp_path, "aot_eager")


@pytest.mark.slow
def test_recorded_inductor_step_is_the_compiled_step_and_holds_units(tmp_path, no_graph_cache):
    _check_bitwise_and_units(tmp_path, "inductor")
    units = _units(tmp_path / "t")
    assert any(k.startswith("cpp_fused") for k in units[0].unit.kernels)
    # inductor's allocations and extern kernels are parts of the units, not ops of their own
    names = [op.name for op in open_trace(tmp_path / "t").rank(0).iter_from(0)]
    assert not any(n.endswith(".out") for n in names), names


def test_unit_inputs_share_storage_versions_with_eager_ops(tmp_path):
    """A parameter read by the compiled forward is the same storage version the optimizer's eager update reads."""
    _run("aot_eager", tmp_path / "t")
    rt = open_trace(tmp_path / "t").rank(0)
    fw = next(op for op in rt.iter_from(0) if op.name == "compiled.unit.forward")
    unit_versions = {r.version for r in fw.inputs()}
    update = [op for op in rt.iter_from(0) if op.phase == "optimizer" and op.name == "aten.add_.Tensor"]
    assert update and all(op.args[0].version in unit_versions for op in update)


def test_compiled_eager_option_records_regions_as_eager_ops(tmp_path):
    _run("aot_eager", tmp_path / "t", compiled="eager")
    assert _units(tmp_path / "t") == []
    assert open_trace(tmp_path / "t").rank(0).options.compiled == "eager"


def test_aot_eager_units_replay_clean(tmp_path, capsys):
    _run("aot_eager", tmp_path / "t")
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fault_in_an_aot_eager_graph_is_named(tmp_path, capsys, monkeypatch):
    faulty_gelu_pass(monkeypatch)
    torch._dynamo.reset()
    _run("aot_eager", tmp_path / "t")
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "first divergent op #0 compiled.unit.forward" in proc.stdout, proc.stdout
    assert "Sequential.forward" in proc.stdout
    assert "earliest divergent node given its own inputs: gelu (aten.gelu.default) in Sequential.1 (GELU)" \
        in proc.stdout
    torch._dynamo.reset()


def _wrap_erf_lowering(monkeypatch) -> None:
    """A bug in inductor's code generation: its lowering of aten.erf scales the result by 1 + 1e-3."""
    from torch._inductor import lowering

    aten_erf = torch.ops.aten.erf.default
    orig = lowering.lowerings[aten_erf]
    mul = lowering.lowerings[torch.ops.aten.mul.Tensor]

    def erf(x):
        return mul(orig(x), 1.0 + 1e-3)

    monkeypatch.setitem(lowering.lowerings, aten_erf, erf)


def _gelu_mlp_step(path) -> None:
    model = _mlp()  # GELU(approximate="none"): erf
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    cm = torch.compile(model, backend="inductor")
    with replaydiff.record(path):
        cm(x).square().mean().backward()


@pytest.mark.slow
def test_bug_in_inductors_erf_lowering_is_named(tmp_path, capsys, monkeypatch, no_graph_cache):
    _wrap_erf_lowering(monkeypatch)
    _gelu_mlp_step(tmp_path / "t")
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "first divergent op #0 compiled.unit.forward" in proc.stdout, proc.stdout
    assert "earliest divergent node given its own inputs: erf (aten.erf.default) in Sequential.1 (GELU)" \
        in proc.stdout
    assert "reproduces the recorded outputs bit for bit" in proc.stdout


@pytest.mark.slow
def test_inductor_gelu_without_the_bug_replays_clean(tmp_path, capsys, no_graph_cache):
    _gelu_mlp_step(tmp_path / "t")
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_units(tmp_path / "t")) == 2


@pytest.mark.slow
def test_gpt2_compiled_with_inductor_replays_clean(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                                  attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    cm = torch.compile(model, backend="inductor")
    with replaydiff.record(tmp_path / "t"):
        cm(input_ids=ids, labels=ids).loss.backward()
    units = _units(tmp_path / "t")
    assert {u.name for u in units} == {"compiled.unit.forward", "compiled.unit.backward"}
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


_SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
cm = torch.compile(model, backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 8)
for _ in range(2):
    cm(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["capture", "eager"])
def test_record_cli_compiled_capture_records_units_and_eager_records_none(tmp_path, how, cli_here):
    import sys

    (tmp_path / "train.py").write_text(_SCRIPT)
    extra = [] if how == "capture" else ["--compiled", "eager"]
    proc = cli_here("record", "-o", tmp_path / "t", "--step", "2", *extra, "--", sys.executable, "train.py",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert open_trace(tmp_path / "t").rank(0).options.compiled == how
    units = _units(tmp_path / "t")
    assert len(units) == (2 if how == "capture" else 0)


def test_record_cli_refuses_an_unknown_compiled_mode(tmp_path, capsys):
    from replaydiff.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["record", "-o", str(tmp_path / "t"), "--compiled", "fast", "--", "python", "x.py"])
    assert exc.value.code == 2
    assert "argument --compiled: invalid choice: 'fast'" in capsys.readouterr().err


# -- random draws inside a unit: recovered from the recorded outputs and checked by statistics -----------------------
def _dropout_step(path, backend: str, rows: int = 5, grad: bool = True) -> None:
    """A recorded step of Linear -> Dropout(0.5) -> GELU -> Linear, compiled (the first call compiles, outside the
    recording); ``grad`` False: a forward under no_grad in training mode (no mask is saved for a backward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                torch.nn.Linear(HID, OUT))
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(1))
    cm = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(grad):
        cm(x).square().mean().backward() if grad else cm(x)
        with replaydiff.record(path):
            cm(x).square().mean().backward() if grad else cm(x)


def _replayed_units(capsys, path) -> tuple[int, dict]:
    import json

    proc = run_main(capsys, "replay", str(path), "--json", "-")
    return proc.returncode, {o["op"]: o for o in json.loads(proc.stdout)["ops"] if o["op"].startswith("compiled")}


def _kept(path) -> int:
    """How many positions the recorded dropout mask kept: the forward's boolean output (saved for the backward)."""
    rt = open_trace(path).rank(0)
    fw = _units(path)[0]
    (mask,) = [rt.tensor(r) for r in fw.outputs if getattr(r, "dtype", None) == "bool"]
    return int(mask.sum())


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_dropout_inside_a_unit_is_compared_by_statistics_and_replays_clean(tmp_path, capsys, backend,
                                                                           no_graph_cache):
    """The compiled dropout drew with the backend's generator (inductor's seeds). Its mask is a recorded output
    (saved for the backward): replay takes the draw from there, checks its kept count against p, and judges every
    value after it with that mask, so no output is left out."""
    _dropout_step(tmp_path / "t", backend)
    code, units = _replayed_units(capsys, tmp_path / "t")
    assert code == 0, units
    fw = units["compiled.unit.forward"]
    n_out = len(_units(tmp_path / "t")[0].outputs)
    # every output but the mask itself (the draw is its own reference) is judged by value
    assert fw["status"] == "ok" and f"{n_out - 1} output(s) within limits" in fw["reason"], fw
    kept = _kept(tmp_path / "t")
    assert f"kept {kept} of {5 * HID}, 40 ± 27 expected at keep probability 0.5" in fw["reason"], fw["reason"]
    assert "compared by statistics" in fw["reason"] and "not compared" not in fw["reason"]


def test_a_draw_no_recorded_output_holds_is_not_compared_and_says_so(tmp_path, capsys):
    """Under no_grad no mask is saved: the output after the dropout depends on a draw replay cannot recover."""
    _dropout_step(tmp_path / "t", "aot_eager", grad=False)
    code, units = _replayed_units(capsys, tmp_path / "t")
    assert code == 0, units
    (unit,) = units.values()
    assert unit["status"] == "ok" and unit["reason"].endswith(
        ": nothing to compare; 1 output(s) not compared: they depend on random node(s) native_dropout, drawn by the "
        "backend's own generator, which replay cannot draw again, and no recorded output holds the draw"), unit


def test_fault_after_a_dropout_in_an_aot_eager_graph_is_named(tmp_path, capsys, monkeypatch):
    faulty_gelu_pass(monkeypatch)
    torch._dynamo.reset()
    _dropout_step(tmp_path / "t", "aot_eager")
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "first divergent op #0 compiled.unit.forward" in proc.stdout, proc.stdout
    assert "earliest divergent node given its own inputs: gelu (aten.gelu.default) in Sequential.2 (GELU)" \
        in proc.stdout
    torch._dynamo.reset()


def test_a_dropout_that_keeps_the_wrong_fraction_is_divergent(tmp_path, capsys, monkeypatch):
    """A compiler bug that drops with 1 - p instead of p: the mask's kept count is outside the binomial bound."""
    import torch._dynamo.backends.debugging as dbg

    nop = dbg.boxed_nop

    def faulty(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.native_dropout.default:
                node.args = (node.args[0], 1.0 - 0.9, *node.args[2:])  # keeps 90% where 50% was asked
        gm.recompile()
        return nop(gm, example_inputs)

    monkeypatch.setattr(dbg, "boxed_nop", faulty)
    torch._dynamo.reset()
    _dropout_step(tmp_path / "t", "aot_eager", rows=64)
    code, units = _replayed_units(capsys, tmp_path / "t")
    assert code == 1, units
    fw = units["compiled.unit.forward"]
    kept = _kept(tmp_path / "t")
    assert fw["status"] == "divergent" and (
        f"random draw native_dropout kept {kept} of {64 * HID}, 512 ± 96 expected at keep probability 0.5 "
        f"(binomial bound)") in fw["reason"], fw
    torch._dynamo.reset()


def _dropout_of_a_product(path, backend: str = "aot_eager") -> None:
    """A compiled function that ends in a dropout, called under no_grad: its value is the only output (no mask)."""
    def f(x, w):
        return torch.nn.functional.dropout(x @ w, 0.5, training=True)

    cf = torch.compile(f, backend=backend)
    x = torch.randn(16, IN, generator=torch.Generator().manual_seed(1))
    w = torch.randn(IN, HID, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cf(x, w)
        with replaydiff.record(path):
            cf(x, w)


@pytest.mark.parametrize("fault", [False, True])
def test_a_dropout_mask_is_recovered_from_its_value_output(tmp_path, capsys, monkeypatch, fault):
    """Only the dropout's value is recorded: the mask is where it is non-zero, and the kept values are judged
    against input * 2 (a compiled value off by 1e-3 at the kept positions is divergent)."""
    if fault:
        import torch._dynamo.backends.debugging as dbg

        nop = dbg.boxed_nop

        def faulty(gm, example_inputs):
            (out,) = [n for n in gm.graph.nodes if n.op == "output"]
            value = out.args[0][0]
            with gm.graph.inserting_before(out):
                bad = gm.graph.call_function(torch.ops.aten.mul.Tensor, (value, 1.0 + 1e-3))
            out.args = ((bad,),)
            gm.recompile()
            return nop(gm, example_inputs)

        monkeypatch.setattr(dbg, "boxed_nop", faulty)
    torch._dynamo.reset()
    _dropout_of_a_product(tmp_path / "t")
    code, units = _replayed_units(capsys, tmp_path / "t")
    (unit,) = units.values()
    rt = open_trace(tmp_path / "t").rank(0)
    value = rt.tensor(_units(tmp_path / "t")[0].outputs[0])
    kept = int((value != 0).sum())
    assert f"native_dropout from output 0 (its mask: where the value is non-zero): kept {kept} of {16 * HID}, " \
           f"128 ± 48 expected at keep probability 0.5" in unit["reason"], unit
    if fault:
        assert code == 1 and unit["status"] == "divergent" and "output 0 max_abs/(eps*absmax)" in unit["reason"]
    else:
        assert code == 0 and unit["status"] == "ok" and "1 output(s) within limits" in unit["reason"], unit
    torch._dynamo.reset()


@pytest.mark.slow
def test_an_inductor_dropout_mask_is_recovered_from_the_value_it_was_applied_to(tmp_path, capsys, no_graph_cache):
    """Inductor decomposes dropout (gt(inductor_random, p) * x * 2): under no_grad only the value is an output,
    so the mask is where it is non-zero, and the value is judged with it."""
    _dropout_of_a_product(tmp_path / "t", "inductor")
    code, units = _replayed_units(capsys, tmp_path / "t")
    (unit,) = units.values()
    value = open_trace(tmp_path / "t").rank(0).tensor(_units(tmp_path / "t")[0].outputs[0])
    kept = int((value != 0).sum())
    assert code == 0 and unit["status"] == "ok" and "1 output(s) within limits" in unit["reason"], unit
    assert f"gt from output 0 (its mask: where the value is non-zero): kept {kept} of {16 * HID}, 128 ± 48 " \
           f"expected at keep probability 0.5" in unit["reason"], unit


@pytest.mark.slow
def test_bug_in_inductors_erf_lowering_after_a_dropout_is_named(tmp_path, capsys, monkeypatch, no_graph_cache):
    _wrap_erf_lowering(monkeypatch)
    _dropout_step(tmp_path / "t", "inductor")
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "first divergent op #0 compiled.unit.forward" in proc.stdout, proc.stdout
    assert "earliest divergent node given its own inputs: erf (aten.erf.default) in Sequential.2 (GELU)" \
        in proc.stdout
    # the recorded mask is an input of the recompiled graph: every output is reproduced, the dropped ones too
    assert "reproduces the recorded outputs bit for bit" in proc.stdout


def test_show_lists_units_with_their_nodes(tmp_path, capsys):
    _run("aot_eager", tmp_path / "t")
    rt = open_trace(tmp_path / "t").rank(0)
    fw = next(op for op in rt.iter_from(0) if op.name == "compiled.unit.forward")
    proc = run_main(capsys, "show", str(tmp_path / "t"), "--op", str(fw.index))
    assert proc.returncode == 0, proc.stderr
    n_calls = len(fw.unit.calls())
    assert f"unit    forward graph {fw.unit.graph_id} of Sequential.forward" in proc.stdout
    assert f"compiled by aot_eager: {n_calls} nodes, 0 kernels" in proc.stdout
    assert "    gelu = aten.gelu.default" in proc.stdout
    summary = run_main(capsys, "show", str(tmp_path / "t")).stdout
    assert "ran compiled as compiled units (1 call(s))" in summary
    js = run_main(capsys, "show", str(tmp_path / "t"), "--op", str(fw.index), "--json").stdout
    import json

    unit = json.loads(js)["unit"]
    assert unit["backend"] == "aot_eager" and "aten.gelu.default" in [n["target"] for n in unit["nodes"]]


@pytest.mark.slow
def test_inductor_backward_of_a_forward_compiled_before_recording_is_a_boundary_unit(tmp_path, capsys,
                                                                                    no_graph_cache):
    """The forward ran (compiled) before recording: its backward's graph was never seen by the capture backend.
    It is recorded as a unit of its boundaries (no loose extern kernels), and replay says why it is not run."""
    model = _mlp()
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    loss = torch.compile(model, backend="inductor")(x).square().mean()
    with replaydiff.record(tmp_path / "t"):
        loss.backward()
    names = [op.name for op in open_trace(tmp_path / "t").rank(0).iter_from(0)]
    assert not any(n.endswith(".out") for n in names), names
    (bw,) = _units(tmp_path / "t")
    assert bw.name == "compiled.unit.backward" and "forward was compiled before recording" in bw.unit.note
    # what the backward computed is unchecked: never "every replayed op matches", never exit 0
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"  not judged   1  #{bw.index} (compiled.unit.backward): compiled unit without a replayable graph (graph " \
           f"not captured: its forward was compiled before recording started (call replaydiff.watch_compiles()" \
           in proc.stdout, proc.stdout
    assert "not clean: no divergent op among the" in proc.stdout and "every replayed op matches" not in proc.stdout


# A step compiled before the recorded one (every compiled job compiles at step 1): its units must be replayable.
_LN_DROPOUT = """
import os, sys, torch
import replaydiff
if os.environ.get("WATCH"):
    replaydiff.watch_compiles()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Dropout(0.2), torch.nn.GELU(),
                            torch.nn.Linear(16, 4))
cm = torch.compile(model, backend="inductor")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
for step in (1, 2, 3):
    if step == 2 and len(sys.argv) > 2 and sys.argv[2] == "step":  # the Python API: step 2 recorded whole
        with replaydiff.record(sys.argv[1]):
            cm(input=x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        continue
    # called by keyword, as transformers models are: the graph recompiled while recording is then the one compiled
    # at step 1 (the recorder's module hooks see no positional input), which AOTAutograd's cache holds
    loss = cm(input=x).square().mean()
    if step == 2 and len(sys.argv) > 1:  # the Python API: the backward of step 2 alone is recorded
        with replaydiff.record(sys.argv[1]):
            loss.backward()
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()
    print("loss", step, loss.item().hex())
"""


def _judged_units(run, path) -> tuple[int, str, list[dict]]:
    """Replay's exit code, JSON text and its unit results; ``run``: replaydiff's main, as run_main or cli_here."""
    import json

    proc = run("replay", str(path), "--json", "-")
    units = [o for o in json.loads(proc.stdout)["ops"] if o["op"].startswith("compiled.unit")]
    return proc.returncode, proc.stdout, units


@pytest.mark.slow
def test_units_of_a_step_after_the_compile_are_replayed_under_record_cli(tmp_path, cli_here, monkeypatch):
    """`replaydiff record --step 2 -- CMD` of a job that compiles at step 1: every graph of step 2 (forward and
    backward, LayerNorm and dropout inside) is a unit with its graph, judged by replay (none skipped)."""
    import sys

    import os

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))  # no kernel from another run
    (tmp_path / "train.py").write_text(_LN_DROPOUT)
    proc = cli_here("record", "-o", tmp_path / "t", "--step", "2", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # every region compiled through the capture backend from the start: the job's numerics are its own, bit for bit
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "plain-cache")}
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    losses = [line for line in proc.stdout.splitlines() if line.startswith("loss ")]
    assert len(losses) == 3 and losses == [x for x in plain.stdout.splitlines() if x.startswith("loss ")], \
        (losses, plain.stdout, plain.stderr)
    units = _units(tmp_path / "t")
    assert [u.name for u in units] == ["compiled.unit.forward", "compiled.unit.backward"]
    assert all(u.unit.note is None and u.unit.calls() for u in units), [u.unit.note for u in units]
    names = [op.name for op in open_trace(tmp_path / "t").rank(0).iter_from(0)]
    assert not any(n.endswith(".out") for n in names), names  # no loose extern kernel of an unwrapped graph
    code, out, judged = _judged_units(cli_here, tmp_path / "t")
    assert code == 0 and [u["status"] for u in judged] == ["ok", "ok"], judged
    assert all("within limits" in u["reason"] for u in judged), judged


@pytest.mark.slow
def test_a_whole_step_recorded_after_the_compile_holds_units_with_graphs(tmp_path, capsys):
    """The Python API around a whole step after the compile, no watch_compiles(): the regions are compiled again
    for the recording (AOTAutograd's cache would hand back the step-1 code without a graph), so both units replay."""
    import os
    import sys

    (tmp_path / "train.py").write_text(_LN_DROPOUT)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"), "WATCH": ""}
    job = subprocess.run([sys.executable, "train.py", str(tmp_path / "t"), "step"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr
    units = _units(tmp_path / "t")
    assert [u.name for u in units] == ["compiled.unit.forward", "compiled.unit.backward"]
    assert all(u.unit.note is None and u.unit.calls() for u in units), [u.unit.note for u in units]
    code, out, judged = _judged_units(lambda *a: run_main(capsys, *a), tmp_path / "t")
    assert code == 0 and [u["status"] for u in judged] == ["ok", "ok"], judged


@pytest.mark.slow
@pytest.mark.parametrize("watch", [True, False])
def test_backward_of_a_forward_compiled_before_recording_with_watch_compiles(tmp_path, capsys, watch):
    """The Python API: a script records only the backward of step 2, whose forward ran (compiled at step 1) before
    recording. With replaydiff.watch_compiles() early in the script the backward unit has its graph and is judged;
    without it, replay says which unit was not judged and is not clean."""
    import os
    import sys

    (tmp_path / "train.py").write_text(_LN_DROPOUT)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"), "WATCH": "1" if watch else ""}
    job = subprocess.run([sys.executable, "train.py", str(tmp_path / "t")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr
    (bw,) = _units(tmp_path / "t")
    code, out, judged = _judged_units(lambda *a: run_main(capsys, *a), tmp_path / "t")
    if watch:
        assert bw.unit.note is None and bw.unit.calls()
        assert code == 0 and judged[0]["status"] == "ok" and "within limits" in judged[0]["reason"], judged
        return
    assert bw.unit.note is not None
    assert code == 1 and judged[0]["status"] == "skipped" and judged[0].get("unjudged") is True, judged
    text = run_main(capsys, "replay", str(tmp_path / "t")).stdout
    assert f"  not judged   1  #{bw.index} (compiled.unit.backward): compiled unit without a replayable graph" \
        in text, text
    assert "replaydiff.watch_compiles()" in text and "every replayed op matches" not in text


def _wrap_rsqrt_lowering(monkeypatch) -> None:
    """A bug in inductor's code generation: its lowering of aten.rsqrt scales the result by 1 + 1e-3 (LayerNorm)."""
    from torch._inductor import lowering

    rsqrt = torch.ops.aten.rsqrt.default
    orig = lowering.lowerings[rsqrt]
    mul = lowering.lowerings[torch.ops.aten.mul.Tensor]
    monkeypatch.setitem(lowering.lowerings, rsqrt, lambda x: mul(orig(x), 1.0 + 1e-3))


@pytest.mark.slow
def test_compiler_bug_of_the_recording_machine_is_localised_from_the_recorded_outputs(tmp_path, capsys, monkeypatch,
                                                                                    no_graph_cache):
    """The recording process had a faulty rsqrt lowering; replay's process does not. Recompiled here, the unit is
    right, so no node diverges here: the fault is in the recorded compiled code, and the recorded outputs that
    diverge (rsqrt's, saved for the backward, first) name the node."""
    from replaydiff.replay.unit_replay import Graph

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    with monkeypatch.context() as planted:
        _wrap_rsqrt_lowering(planted)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.LayerNorm(HID), torch.nn.GELU(),
                                    torch.nn.Linear(HID, OUT))
        x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
        cm = torch.compile(model, backend="inductor")
        with replaydiff.record(tmp_path / "t"):
            cm(x).square().mean().backward()
    torch._dynamo.reset()  # the lowering is inductor's own again: replay's recompile is right
    fw = _units(tmp_path / "t")[0]
    nodes = fw.unit.nodes
    behind = Graph(fw.unit).output_nodes()
    rsqrt_outputs = [n for n, i in enumerate(behind) if i is not None and nodes[i].target == "aten.rsqrt.default"]
    assert rsqrt_outputs, [nodes[i].target for i in behind if i is not None]  # saved for the backward
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"first divergent op #{fw.index} compiled.unit.forward" in proc.stdout, proc.stdout
    assert "no single node diverges" not in proc.stdout, proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "the fault is in the recorded compiled code" in x)
    assert f", earliest output {rsqrt_outputs[0]}: rsqrt (aten.rsqrt.default) in Sequential.1 (LayerNorm) " \
           f"(max_abs/(eps*absmax)" in line, line
    made = line.split("computed inside the unit by ", 1)[1].split(" from the unit's inputs", 1)[0]
    assert made.split(", ")[-1] == "rsqrt" and "var_mean" in made, line  # the LayerNorm's statistics, no more


def _graph_break(model):
    def f(x):
        y = model(x).relu()
        torch._dynamo.graph_break()
        return (y * 2).square().mean()
    return torch.compile(f, backend="aot_eager")


def _whole_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    @torch.compile(backend="aot_eager")
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


@pytest.mark.slow
@pytest.mark.parametrize("case, units", [
    ("graph_break", ["forward", "forward", "backward", "backward"]),
    ("fullgraph", ["forward", "backward"]),
    ("dynamic", ["forward", "backward"]),
    ("whole_step", ["forward", "backward", "forward"]),  # the optimizer's update is one more graph
])
def test_compiled_shapes_of_jobs_are_recorded_as_units_and_replay_clean(tmp_path, capsys, case, units):
    model = _mlp()
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    if case == "graph_break":
        fn = _graph_break(model)
    elif case == "whole_step":
        fn = _whole_step(model)
    else:
        cm = torch.compile(model, backend="aot_eager", fullgraph=case == "fullgraph", dynamic=case == "dynamic")
        fn = lambda x: cm(x).square().mean()  # noqa: E731
    out = fn(x)
    if case != "whole_step":
        out.backward()
    x2 = torch.randn(7 if case == "dynamic" else 5, IN, generator=torch.Generator().manual_seed(2))
    with replaydiff.record(tmp_path / "t"):
        out = fn(x2)
        if case != "whole_step":
            out.backward()
    assert [u.name.rsplit(".", 1)[1] for u in _units(tmp_path / "t")] == units
    proc = run_main(capsys, "replay", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _unit_repros(tmp_path, capsys) -> tuple:
    """`repro` of the recorded forward and backward units into tmp_path/fw and tmp_path/bw; the two units."""
    import json

    fw, bw = _units(tmp_path / "t")
    for unit, d in ((fw, tmp_path / "fw"), (bw, tmp_path / "bw")):
        proc = run_main(capsys, "repro", str(tmp_path / "t"), str(unit.index), "-o", str(d))
        assert proc.returncode == 0, proc.stderr
        data = json.loads((d / "repro.json").read_text())
        assert [n["target"] for n in data["unit"]["nodes"] if n["kind"] == "call"] == \
            [n.target for n in unit.unit.calls()]
    return fw, bw


def _script_here(capsys, d) -> tuple[int, list[str]]:
    """The repro script imported and run in this process on directory ``d``: (exit code, lines printed)."""
    from replaydiff import rebuild_and_judge

    capsys.readouterr()
    code = rebuild_and_judge.main([], directory=str(d))
    return code, capsys.readouterr().out.splitlines()


def _output0(lines: list[str]) -> tuple[str, str]:
    """The first output's lines: recorded against the reference, and the device run against the reference."""
    at = lines.index("output 0 torch.float32[5, 4]:")
    return lines[at + 1], lines[at + 2]


def _faulty_unit_repros(tmp_path, capsys, monkeypatch) -> tuple:
    faulty_gelu_pass(monkeypatch)
    torch._dynamo.reset()
    _run("aot_eager", tmp_path / "t")
    torch._dynamo.reset()
    return _unit_repros(tmp_path, capsys)


def test_repro_of_a_unit_rebuilds_its_graph_from_data_and_recompiles_it(tmp_path, capsys, monkeypatch):
    """`repro` of a unit writes the graph as a node list; the script builds it, runs it at float64 and recompiled
    with the recorded backend, and judges as replay does. With the compiler's fault still in this process, both the
    recorded outputs and the script's compile are divergent; the backward, given its own inputs, is not."""
    fw, _ = _faulty_unit_repros(tmp_path, capsys, monkeypatch)
    code, here = _script_here(capsys, tmp_path / "fw")
    assert code == 1, here
    assert here[0] == (f"unit #{fw.index} compiled.unit.forward (rank 0) of {fw.unit.region}: reference = its graph "
                       f"run eagerly on the CPU at float64; device run = the graph compiled with aot_eager on cpu at "
                       f"the recorded dtypes")
    recorded, device = _output0(here)
    assert recorded.startswith("  recorded vs reference:") and "DIVERGENT" in recorded, here
    assert device.startswith("  cpu run vs reference:") and "DIVERGENT" in device, here
    code, here = _script_here(capsys, tmp_path / "bw")
    assert code == 0 and "output 1 torch.float32[16, 8]:" in here, here
    torch._dynamo.reset()


@pytest.mark.slow
def test_repro_script_of_a_unit_runs_alone_and_its_own_compile_is_clean(tmp_path, capsys, monkeypatch):
    """`python -I repro.py` (no replaydiff): the recorded outputs of the faulty compile are divergent, the script's
    compile in a fresh process (where the compiler has no fault) is not."""
    import sys

    _faulty_unit_repros(tmp_path, capsys, monkeypatch)
    torch._dynamo.reset()
    script = subprocess.run([sys.executable, "-I", "repro.py"], cwd=tmp_path / "fw", capture_output=True, text=True,
                            timeout=300)
    assert script.returncode == 1, script.stdout + script.stderr
    recorded, device = _output0(script.stdout.splitlines())
    assert "DIVERGENT" in recorded and device.startswith("  cpu run vs reference:") and device.endswith("ok")


def test_repro_of_a_clean_unit_is_ok(tmp_path, capsys):
    torch._dynamo.reset()
    _run("aot_eager", tmp_path / "t")
    _unit_repros(tmp_path, capsys)
    for d in ("fw", "bw"):
        code, here = _script_here(capsys, tmp_path / d)
        assert code == 0 and not any("DIVERGENT" in line for line in here), here


def test_a_region_is_compiled_once_for_all_recordings_and_the_jobs_code_runs_after(tmp_path):
    """The capture backend's entry is reused by every later recording (the recorder's module hooks keep their keys,
    and dynamo's guards are told that the recording mode ignores compile internals), and between recordings the
    job's own compiled code runs without a recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _mlp()
    x = torch.randn(5, IN)
    cm = torch.compile(model, backend="aot_eager")
    cm(x).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    for i in range(3):
        with replaydiff.record(tmp_path / f"t{i}"):
            cm(x).sum().backward()
            cm(x).sum().backward()
        cm(x).sum().backward()
        assert len(_units(tmp_path / f"t{i}")) == 4
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_capture_that_cannot_engage_records_eager_with_one_warning(tmp_path, monkeypatch):
    """The recorder is a guest: if dynamo's stance cannot be set, regions run eager (each op recorded), as with
    compiled="eager", with one warning; nothing reaches the job."""
    import torch._dynamo.eval_frame as ef

    def refuse(stance):
        raise RuntimeError("no stance today")

    model = _mlp()
    x = torch.randn(5, IN)
    cm = torch.compile(model, backend="aot_eager")
    cm(x).sum().backward()
    monkeypatch.setattr(ef, "_set_stance", refuse)
    with pytest.warns(RuntimeWarning) as caught:
        with replaydiff.record(tmp_path / "t"):
            cm(x).sum().backward()
    mine = [str(w.message) for w in caught if "units could not be captured" in str(w.message)]
    assert mine == ["replaydiff: compiled regions run eager while recording (units could not be captured: "
                    "RuntimeError: no stance today)"]
    names = [op.name for op in open_trace(tmp_path / "t").rank(0).iter_from(0)]
    assert not any(n.startswith("compiled.") for n in names) and "aten.gelu.default" in names


def test_a_unit_that_cannot_be_described_is_a_stub_and_the_job_runs_on(tmp_path, monkeypatch):
    from replaydiff.record import unit_capture as units

    plain = _run("aot_eager")
    torch._dynamo.reset()

    def broken(*a, **k):
        raise ValueError("cannot describe")

    monkeypatch.setattr(units, "_unit_before", broken)
    with pytest.warns(RuntimeWarning):
        recorded = _run("aot_eager", tmp_path / "t")
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    rt = open_trace(tmp_path / "t").rank(0)
    stubs = [rt[i] for i in range(len(rt.index)) if rt.index.name[i].startswith("compiled.unit")]
    assert [op.name for op in stubs] == ["compiled.unit.forward", "compiled.unit.backward"]
    assert all(not op.recorded and "cannot describe" in op.not_recorded_reason for op in stubs)


# -- CUDA (not run where there is no CUDA device; written without one to check it: see docs/design/compile.md) ----
def _cuda_gelu_step(path) -> list[torch.Tensor]:
    model = _mlp().cuda()
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1)).cuda()
    cm = torch.compile(model, backend="inductor")
    cm(x).square().mean().backward()
    model.zero_grad()
    if path is None:
        cm(x).square().mean().backward()
    else:
        with replaydiff.record(path):
            cm(x).square().mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_inductor_units_are_the_compiled_step_and_replay_clean(tmp_path, capsys, no_graph_cache):
    plain = _cuda_gelu_step(None)
    torch._dynamo.reset()
    recorded = _cuda_gelu_step(tmp_path / "t")
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    units = _units(tmp_path / "t")
    assert [u.name for u in units] == ["compiled.unit.forward", "compiled.unit.backward"]
    assert any(k.startswith("triton_") for k in units[0].unit.kernels)
    proc = run_main(capsys, "replay", str(tmp_path / "t"), "--device", "cuda")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_bug_in_inductors_erf_lowering_is_named(tmp_path, capsys, monkeypatch, no_graph_cache):
    _wrap_erf_lowering(monkeypatch)
    _cuda_gelu_step(tmp_path / "t")
    proc = run_main(capsys, "replay", str(tmp_path / "t"), "--device", "cuda")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "earliest divergent node given its own inputs: erf (aten.erf.default)" in proc.stdout
    assert "reproduces the recorded outputs bit for bit" in proc.stdout


def test_tui_detail_pane_expands_a_unit_to_its_nodes(tmp_path):
    from replaydiff.tui.details import op_markup

    _run("aot_eager", tmp_path / "t")
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    fw = _units(tmp_path / "t")[0]
    text = op_markup(r, fw.index, None, [None] * len(r))
    assert f"[b]compiled unit[/]  forward graph {fw.unit.graph_id} of Sequential.forward" in text
    assert f"aot_eager: {len(fw.unit.calls())} nodes, 0 kernels" in text
    assert "  gelu = aten.gelu.default  [dim]Sequential.1 (GELU)[/]" in text


def test_recording_regions_as_units_gives_no_warning(tmp_path):
    import warnings

    model = _mlp()
    cm = torch.compile(model, backend="aot_eager")
    x = torch.randn(5, IN)
    cm(x).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t"):
            cm(x).sum().backward()
    assert [str(w.message) for w in caught if "replaydiff" in str(w.message)] == []
    regions = open_trace(tmp_path / "t").rank(0).compiled_regions
    assert regions and all(r.units and r.how == "compiled" for r in regions)


def test_a_unit_as_wrong_as_eager_at_its_dtype_is_not_a_fault(tmp_path, capsys):
    """The dtype's own error is the graph run eagerly at the recorded dtype: a cancellation that float32 cannot
    hold (far over the fixed limits against float64) is what eager makes too, so the unit is ok, with the reason."""
    def f(x):
        return (x + 1e3) - 1e3  # float32 keeps ~4 digits of x here

    cf = torch.compile(f, backend="aot_eager")
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    cf(x)
    with replaydiff.record(tmp_path / "t"):
        cf(x)
    proc = run_main(capsys, "replay", str(tmp_path / "t"), "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    (unit,) = [o for o in json.loads(proc.stdout)["ops"] if o["op"].startswith("compiled.unit")]
    assert unit["status"] == "ok" and unit["metrics"]["norm_max"] > 16, unit
    assert "own error at" in unit["reason"] or "ill-conditioned" in unit["reason"], unit["reason"]


# -- diff: a compiled unit against the eager ops of its region --------------------------------------------------
def _one_step(path, backend: str | None) -> None:
    """One recorded forward and backward of the MLP, eager (``backend`` None) or compiled inside the recording."""
    model = _mlp()
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    f = model if backend is None else torch.compile(model, backend=backend)
    with replaydiff.record(path):
        f(x).square().mean().backward()


def _diff_both_ways(tmp_path, capsys) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    return run_main(capsys, "diff", eager, compiled), run_main(capsys, "diff", compiled, eager)


def test_diff_pairs_an_aot_eager_unit_with_the_eager_ops_of_its_region(tmp_path, capsys):
    _one_step(tmp_path / "eager", None)
    torch._dynamo.reset()
    _one_step(tmp_path / "compiled", "aot_eager")
    torch._dynamo.reset()
    forward, backward = _diff_both_ways(tmp_path, capsys)
    for proc, unit_side, eager_side in ((forward, "target", "ref"), (backward, "ref", "target")):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (f"compiled unit {unit_side} #0 compiled.unit.forward  Sequential.forward (") in proc.stdout
        assert "torch/nn/modules/container.py:" in proc.stdout  # where torch is installed: site-packages, proc.stdout
        assert f"aot_eager  (forward), against {eager_side} ops #0-#4 (5 of 5 nodes mapped): same" in proc.stdout
        assert "compiled.unit.backward" in proc.stdout and "gelu_backward" not in proc.stdout
        assert "no difference" in proc.stdout


def test_diff_names_the_node_where_a_faulty_aot_eager_unit_parts_from_eager(tmp_path, capsys, monkeypatch):
    _one_step(tmp_path / "eager", None)
    faulty_gelu_pass(monkeypatch)
    torch._dynamo.reset()
    _one_step(tmp_path / "compiled", "aot_eager")
    forward, backward = _diff_both_ways(tmp_path, capsys)
    torch._dynamo.reset()
    for proc, unit_side, eager_side in ((forward, "target", "ref"), (backward, "ref", "target")):
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert (f"compiled unit {unit_side} #0 compiled.unit.forward  Sequential.forward (") in proc.stdout
        assert "torch/nn/modules/container.py:" in proc.stdout  # where torch is installed: site-packages, proc.stdout
        assert "(5 of 5 nodes mapped): divergent" in proc.stdout
        assert (f"they part at node gelu (aten.gelu.default) in Sequential.1 (GELU) = {eager_side} #2 "
                f"aten.gelu.default") in proc.stdout, proc.stdout
        assert "recompiled here with aot_eager, every node kept, gives the recorded outputs bit for bit" \
            in proc.stdout
        assert "differences enter from compiled unit compiled.unit.forward" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("bug", [True, False])
def test_diff_of_eager_against_inductor_names_the_erf_node_of_a_faulty_lowering(tmp_path, capsys, monkeypatch,
                                                                                no_graph_cache, bug):
    _one_step(tmp_path / "eager", None)
    if bug:
        _wrap_erf_lowering(monkeypatch)
    _one_step(tmp_path / "compiled", "inductor")
    proc = run_main(capsys, "diff", str(tmp_path / "eager"), str(tmp_path / "compiled"))
    if not bug:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "compiled unit target #0 compiled.unit.forward" in proc.stdout and ": same" in proc.stdout
        assert "no difference" in proc.stdout
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "compiled unit target #0 compiled.unit.forward  Sequential.forward (" \
        in proc.stdout, proc.stdout
    assert "inductor  (forward), against ref ops #0-#4" in proc.stdout and "): divergent" in proc.stdout
    part = next(line for line in proc.stdout.splitlines() if "they part at" in line)
    assert part.startswith("    they part at nodes mul (aten.mul.Tensor), mul_1 (aten.mul.Tensor), erf (aten.erf.default), "
                           "add (aten.add.Tensor), mul_2 (aten.mul.Tensor) in Sequential.1 (GELU) = ref #2 "
                           "aten.gelu.default; of these, erf (aten.erf.default) diverges given its own inputs"), part
    assert "recompiled here with inductor, every node kept" in proc.stdout


# -- trend: units' outputs have statistics like ops ---------------------------------------------------------------
def _train_compiled(steps: int, spike: int) -> None:
    """SGD on a compiled MLP (aot_eager); its last layer's weight times 100 before step ``spike``, in the loop."""
    model = _mlp()
    cm = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    for step in range(1, steps + 1):
        x = torch.randn(4, IN, generator=g)
        if step == spike:
            with torch.no_grad():
                model[2].weight.mul_(100)
        cm(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_trend_of_a_stats_trace_scores_units_and_its_zoom_in_records_them_in_full(tmp_path):
    """A unit's outputs have statistics like an op's: trend's first change is the forward unit at the spike step,
    under its module; recording the zoom-in trend prints (full tensors, the cause and the unit by name) stores the
    forward units' tensors."""
    from replaydiff.trend import compute_trend

    torch._dynamo.reset()
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="1-16"):
        _train_compiled(16, spike=12)
    t = compute_trend(open_trace(tmp_path / "t").rank(0))
    first = t.first_change
    assert first is not None and (first.step, first.op, first.module) == (12, "compiled.unit.forward",
                                                                          "OptimizedModule")
    assert t.cause is not None and t.cause.op == "aten.mul_.Tensor" and t.cause.step == 12
    zoom = t.zoom
    # the cause (the spike's mul_ in the loop) is outside any module: the zoom selects both by op name
    assert zoom is not None and zoom.modules is None and zoom.ops == ["aten.mul_.Tensor", "compiled.unit.forward"]
    torch._dynamo.reset()
    with replaydiff.record(tmp_path / "z", tensors="full", steps=zoom.steps, ops=zoom.ops):
        _train_compiled(12, spike=12)
    units = [u for u in _units(tmp_path / "z") if u.name == "compiled.unit.forward"]
    assert len(units) == 2 and all(r.stored for u in units for r in u.inputs() + u.outputs_refs()), \
        [(u.name, [r.stored for r in u.inputs()]) for u in units]
    torch._dynamo.reset()
