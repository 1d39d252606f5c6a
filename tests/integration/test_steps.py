"""Many steps in one trace: ``record(steps=...)``, module granularity, the flight recorder, and ``replaydiff trend``.

The planted faults are what a user meets: a weight multiplied by 100 between two steps, a NaN written into an
embedding row. Expected steps are the steps the test plants at; expected op numbers and module paths are read back
from the trace or from the model itself, never typed in.
"""
from __future__ import annotations

import json
import math
import os
import signal
import xml.etree.ElementTree as ET

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main as cli_main
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.trace import open_trace, schema
from replaydiff.trend import MIN_HISTORY, compute_trend

from steps_helpers import gpt2, module_path, one_thread, scale_weight_at, train  # noqa: F401 (one_thread: autouse)


class TinyGRU(torch.nn.Module):
    """Token ids in, two classes out: the recurrent layer's gates saturate, so its output barely shows a weight
    spike (measured: robust z 10.6 for weight_ih x100, under the threshold of 12)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.gru = torch.nn.GRU(8, 16, batch_first=True)
        self.fc = torch.nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(ids))
        return self.fc(h[:, -1])


def train_classifier(model: torch.nn.Module, inputs, spiked: torch.nn.Parameter, steps: int = 30,
                     spike_step: int = 20) -> list[int]:
    """SGD steps on random batches with integer labels from ``torch.randint`` (0 or 1, so that some steps' labels
    are all zeros: an l2 of 0 after a run of ~1.4); ``spiked`` is multiplied by 100 before step ``spike_step``.
    ``inputs(generator)`` draws a batch. Returns the steps whose labels were all zeros."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    zero_labels = []
    for step in range(1, steps + 1):
        x = inputs(g)
        y = torch.randint(0, 2, (4,), generator=g)
        if not y.any():
            zero_labels.append(step)
        if step == spike_step:
            with torch.no_grad():
                spiked.mul_(100)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return zero_labels


def test_integer_and_random_statistics_never_count_as_a_change(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="1-30"):
        zero_labels = train_classifier(model, lambda g: torch.randn(4, 8, generator=g), model[2].weight)
    # The trap is set: labels that were all zeros at a scored step before the spike (seed chosen for it).
    assert any(MIN_HISTORY < s < 20 for s in zero_labels), zero_labels
    r = open_trace(tmp_path / "t").rank(0)
    assert any(op.name.startswith("aten.randint.") for op in r)
    change = compute_trend(r).first_change
    assert change is not None
    assert (change.step, change.module) == (20, module_path(model, model[2])), change
    assert r[change.index].name == change.op and not change.op.startswith("aten.randint.")
    assert change.statistic in ("l2", "absmax") and change.score > 12


def test_sampled_module_steps_catch_a_weight_spike_the_outputs_hide(tmp_path):
    torch.manual_seed(0)
    model = TinyGRU()
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="1-30:2", granularity="module"):
        train_classifier(model, lambda g: torch.randint(0, 20, (4, 6), generator=g), model.gru.weight_ih_l0)
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == list(range(1, 30, 2))
    change = compute_trend(r).first_change
    assert change is not None
    # Step 20 is not recorded: the first recorded step after the spike is 21.
    assert (change.step, change.module) == (21, module_path(model, model.gru)), change
    assert change.statistic in ("l2", "absmax") and change.score > 12
    # It names the weight: the module's own parameter series, which its saturated output hides.
    assert (r[change.index].name, change.parameter) == (change.op, "weight_ih_l0")


def test_trend_cli_names_the_spiked_module_in_json_text_and_svg(tmp_path, capsys):
    model = gpt2(layers=2)
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="2-40:2", granularity="module"):
        train(model, 40, scale_weight_at(20, 100.0))
    expected = module_path(model, model.transformer.h[1].mlp.c_fc)

    assert cli_main(["trend", str(tmp_path / "t"), "--json", "-"]) == 1  # a change was found
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "replaydiff.trend/1"
    assert doc["steps"] == list(range(2, 41, 2))
    fc = doc["first_change"]
    assert (fc["step"], fc["module"]) == (20, expected)
    assert set(fc) >= {"step", "module", "op", "statistic", "score"}
    out = next(s for s in doc["series"] if s["module"] == expected and s["kind"] == "output")
    assert out["steps"] == doc["steps"] and len(out["l2"]) == len(doc["steps"])
    k = doc["steps"].index(20)
    assert out["l2"][k] > 30 * out["l2"][k - 1]  # the series shows the jump it flags

    svg = tmp_path / "trend.svg"
    assert cli_main(["trend", str(tmp_path / "t"), "--plot", str(svg)]) == 1
    text = capsys.readouterr().out
    assert "first change: step 20" in text and expected in text
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert len([e for e in root.iter() if e.tag.endswith("polyline")]) == \
        len([s for s in doc["series"] if s["kind"] == "output"])

    # A module filter that excludes the changed module finds nothing.
    assert cli_main(["trend", str(tmp_path / "t"), "--module", "*.h.0.*", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["first_change"] is None


def test_trend_of_a_one_step_trace_is_a_usage_error(tmp_path, capsys):
    model = gpt2(layers=1)
    with replaydiff.record(tmp_path / "t", tensors="stats"):
        train(model, 1)
    assert cli_main(["trend", str(tmp_path / "t")]) == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.parametrize("tensors", ["stats", "full", "meta"])
def test_trend_says_the_true_reason_it_has_nothing_to_draw(tmp_path, capsys, tensors):
    """`trend --module nosuch` of a --steps 1-5 trace, and trend of a full or meta multi-step trace, each say their
    own reason (no such module; no statistics), never `the trace has no step numbers`: each has steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with replaydiff.record(tmp_path / "t", tensors=tensors, steps="1-3"):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    t = str(tmp_path / "t")
    assert cli_main(["trend", t, "--module", "nosuch"]) == 2
    assert capsys.readouterr().err == f"replaydiff: error: {t}: --module nosuch matches no module of the trace " \
                                      f"(its modules: Sequential.0, Sequential.1, Sequential.2)\n"
    if tensors == "stats":
        assert cli_main(["trend", t, "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)["steps"] == [1, 2, 3]
        return
    what = {"full": "tensor data (--tensors full)", "meta": "shapes and dtypes only (--tensors meta)"}[tensors]
    assert cli_main(["trend", t]) == 2
    assert capsys.readouterr().err == f"replaydiff: error: {t}: the trace holds {what}, not the per-tensor " \
                                      f"statistics trend draws: record it with --tensors stats --steps A-B\n"


# -- statistics: equal to those computed from the stored bytes ------------------------------------------------------
def _stats_of(x: torch.Tensor) -> list[float]:
    x = x.detach().reshape(-1).to(torch.float64)
    f = x[torch.isfinite(x)]
    n = f.numel()
    if n == 0:
        return [x.numel(), 0.0, 0.0, 0.0, 0.0, int(torch.isnan(x).sum()), int(torch.isinf(x).sum())]
    mean = float(f.sum()) / n
    return [x.numel(), mean, float(f.abs().max()), float(f.norm()), float((f * f).sum()) / n - mean * mean,
            int(torch.isnan(x).sum()), int(torch.isinf(x).sum())]


def test_stats_of_a_recorded_step_equal_those_of_a_full_trace_of_it(tmp_path):
    for mode in ("full", "stats"):
        with replaydiff.record(tmp_path / mode, tensors=mode, steps="3"):
            train(gpt2(layers=1), 4)
    full, stats = open_trace(tmp_path / "full").rank(0), open_trace(tmp_path / "stats").rank(0)
    assert len(full) == len(stats) and {op.step for op in stats} == {3}
    compared = 0
    for a, b in zip(full, stats):
        assert (a.index, a.name, a.step) == (b.index, b.name, b.step)
        for ra, rb in zip(a.outputs_refs(), b.outputs_refs()):
            if not ra.stored or ra.zero or ra.meta or rb.stats is None or ra.torch_dtype.is_complex:
                continue
            want = _stats_of(full.tensor(ra))
            got = [getattr(rb.stats, f) for f in ("numel", "mean", "absmax", "l2", "var", "nan", "inf")]
            assert got[0] == want[0] and got[5:] == want[5:], (a, got, want)
            assert got[1:5] == pytest.approx(want[1:5], rel=1e-9, abs=1e-12), (a, got, want)
            compared += 1
    assert compared > 100


@pytest.mark.filterwarnings("error::RuntimeWarning")  # inf - inf inside the statistics must not warn into the job
def test_stats_of_bf16_views_and_nonfinite_values(tmp_path):
    x = torch.linspace(-3, 5, 24).reshape(4, 6)
    x[1, 2] = float("nan")
    x[2, 3] = float("inf")
    with replaydiff.record(tmp_path / "t", tensors="stats"):
        y = x.t().to(torch.bfloat16) * 2  # a transposed view in, a bf16 tensor out
        z = y[:, 1:3].to(torch.int32)
    r = open_trace(tmp_path / "t").rank(0)
    by_output = {}  # dtype and shape -> statistics of the last op output that has them
    for op in r:
        for ref in op.outputs_refs():
            by_output[ref.describe()] = ref.stats
    for t in (y, z):
        s = next(v for k, v in by_output.items() if k == f"{str(t.dtype)[6:]}{list(t.shape)}")
        want = _stats_of(t)
        assert [s.numel, s.nan, s.inf] == [want[0], want[5], want[6]]
        assert [s.mean, s.absmax, s.l2, s.var] == pytest.approx(want[1:5], rel=1e-12)


# -- the recorder stays a guest ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["op", "module"])
def test_training_under_multi_step_recording_is_bitwise_unchanged(tmp_path, granularity):
    plain = gpt2(layers=1)
    train(plain, 5)
    watched = gpt2(layers=1)
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="2-5:2", granularity=granularity):
        train(watched, 5)
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters()):
        assert torch.equal(a, b), name
    assert sorted({op.step for op in open_trace(tmp_path / "t").rank(0)}) == [2, 4]


def test_module_granularity_sees_an_output_written_in_place_by_its_parent(tmp_path):
    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.child(x)
            y.mul_(3)  # the very tensor the child returned, written after the child's hook measured it
            return y

    torch.manual_seed(0)
    model = Parent()
    with replaydiff.record(tmp_path / "t", tensors="stats", granularity="module"):
        model(torch.randn(2, 4)).sum().backward()
    r = open_trace(tmp_path / "t").rank(0)
    out = {op.module: op.outputs_refs()[0].stats for op in r if op.phase == "forward"}
    assert out["Parent"].l2 == pytest.approx(3 * out["Parent.child"].l2, rel=1e-6)
    assert {op.module for op in r if op.phase == "backward"} == {"Parent", "Parent.child"}



def test_module_granularity_records_each_parameter_named_parameters_lists_once(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = torch.nn.Parameter(torch.randn(4, 4))
            self.alias = self.shared  # the same parameter under a second name
            self.register_parameter("bias", None)  # a name without a parameter

        def forward(self, x):
            return x @ self.alias

    class Renamed(torch.nn.Linear):  # a class that lists its parameters its own way
        def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
            for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
                yield "renamed_" + name, p

    torch.manual_seed(0)
    model = torch.nn.Sequential(Tied(), Renamed(4, 2))
    with replaydiff.record(tmp_path / "t", tensors="stats", granularity="module"):
        model(torch.randn(3, 4)).sum().backward()
    r = open_trace(tmp_path / "t").rank(0)
    got = [(op.module, op.args, op.outputs_refs()[0].stats.l2) for op in r if op.name == schema.MODULE_PARAM]
    want = [(module_path(model, m), [name], p.detach().double().norm().item())
            for m in (model[0], model[1]) for name, p in m.named_parameters(recurse=False)]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], rel=1e-12)
    assert [w[1] for w in want] == [["shared"], ["renamed_weight"], ["renamed_bias"]]  # what the cases above are about

# -- the flight recorder --------------------------------------------------------------------------------------------
def nan_row_at(step_no: int):
    def plant(step: int, model, ids) -> None:
        if step == step_no:
            with torch.no_grad():
                model.transformer.wte.weight[ids[0, 0]] = float("nan")
    return plant


@pytest.mark.parametrize("granularity", ["op", "module"])
def test_nan_at_step_12_dumps_the_last_k_steps(tmp_path, granularity):
    k = 4
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=k, granularity=granularity):
        loss = train(gpt2(layers=1), 16, nan_row_at(12))
    assert math.isnan(loss.item())  # training went on, unchanged, after the dump
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete and r.bytes_missing == 0
    assert sorted({op.step for op in r}) == list(range(12 - k + 1, 13))
    assert "NaN" in r.manifest["flight"]["reason"]
    change = compute_trend(r).first_change
    assert change is not None and change.step == 12 and change.statistic == "nan"
    assert r[change.index].step == 12


def test_flight_writes_nothing_at_a_clean_exit_unless_asked(tmp_path):
    with replaydiff.record(tmp_path / "quiet", tensors="stats", flight=3, granularity="module"):
        train(gpt2(layers=1), 6)
    assert not (tmp_path / "quiet").exists() or not any((tmp_path / "quiet").iterdir())
    with replaydiff.record(tmp_path / "asked", tensors="stats", flight=3, granularity="module", flight_at_exit=True):
        train(gpt2(layers=1), 6)
    assert sorted({op.step for op in open_trace(tmp_path / "asked").rank(0)}) == [4, 5, 6]


def test_flight_memory_budget_drops_the_oldest_steps_and_says_so(tmp_path):
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=5, granularity="module", flight_at_exit=True,
                           flight_mib=0.001):  # ~1 KiB: less than one step's records
        train(gpt2(layers=1), 6)
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == [6]  # the step in progress is always kept
    assert any("MiB" in line for line in r.lost)


def test_flight_dumps_on_sigusr1_and_on_an_exception(tmp_path):
    def usr1_at_5(step: int, model, ids) -> None:
        if step == 5:
            model(input_ids=ids)  # step 5 has begun
            os.kill(os.getpid(), signal.SIGUSR1)

    with replaydiff.record(tmp_path / "usr1", tensors="stats", flight=3, granularity="module"):
        train(gpt2(layers=1), 7, usr1_at_5)
    r = open_trace(tmp_path / "usr1").rank(0)
    assert sorted({op.step for op in r}) == [3, 4, 5]  # step 5 up to the signal
    assert "SIGUSR1" in r.manifest["flight"]["reason"]

    def boom_at_4(step: int, model, ids) -> None:
        if step == 4:
            model(input_ids=ids)  # step 4's forward runs, then the script fails
            raise RuntimeError("data loader died")

    with pytest.raises(RuntimeError):
        with replaydiff.record(tmp_path / "exc", tensors="stats", flight=2, granularity="module"):
            train(gpt2(layers=1), 6, boom_at_4)
    r = open_trace(tmp_path / "exc").rank(0)
    assert sorted({op.step for op in r}) == [3, 4]
    assert "data loader died" in r.manifest["flight"]["reason"]


class _BadKernelAt(torch.utils._python_dispatch.TorchDispatchMode):
    """A kernel bug below the recorder (entered before it): in step ``step`` the ``call``-th ``addmm`` puts an Inf
    into its output. ``self.step`` is set by the training loop."""

    def __init__(self, step: int, call: int) -> None:
        super().__init__()
        self.bad_step, self.call, self.step, self.seen = step, call, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.addmm.default and self.step == self.bad_step:
            self.seen += 1
            if self.seen == self.call:
                out.view(-1)[0] = float("inf")
        return out


def test_flight_keeps_full_tensors_of_the_suspect_module_and_replay_names_the_bad_op(tmp_path):
    """--flight 3 with full tensors for one module: a kernel that goes wrong in step 7 of 10 (its Inf makes the loss
    NaN) leaves a trace of steps 5-7 with the module's tensors (statistics for the rest), and replay names the op."""
    model = gpt2(layers=1)
    mlp = module_path(model, model.transformer.h[0].mlp)
    bad = _BadKernelAt(step=7, call=3)  # addmm 1 and 2 are the attention's, 3 the MLP's c_fc

    def mark(step: int, model, ids) -> None:
        bad.step = step

    with bad:
        with replaydiff.record(tmp_path / "t", tensors="full", flight=3, modules=[mlp + "*"]):
            train(model, 10, mark)
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == [5, 6, 7] and "NaN" in r.manifest["flight"]["reason"]
    inside = [op for op in r if op.module and op.module.startswith(mlp)]
    outside = [op for op in r if not (op.module and op.module.startswith(mlp))]
    assert {op.step for op in inside} == {5, 6, 7}
    assert all(ref.stored for op in inside for ref in op.outputs_refs() if not ref.uninitialised)
    assert not any(ref.stored for op in outside for ref in op.outputs_refs() if ref.nbytes)
    assert all(ref.stats is not None for op in outside for ref in op.outputs_refs() if ref.version is not None)

    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    culprit = report.first_divergent
    c_fc = [op for op in inside if op.step == 7 and op.name == "aten.addmm.default" and op.phase == "forward"]
    assert culprit is not None and (culprit.index, culprit.op) == (c_fc[0].index, "aten.addmm.default")
    assert culprit.module == mlp + ".c_fc"


def test_flight_with_full_tensors_stays_within_its_memory(tmp_path):
    """The copies count against flight_mib with the records: older steps go first, and copies that do not fit
    beside what is held are left out (the lost list says so; their ops read as not stored, replayed as skipped)."""
    model = gpt2(layers=1)
    mlp = module_path(model, model.transformer.h[0].mlp)
    budget = 0.02  # MiB: less than one step's copies of the MLP
    with replaydiff.record(tmp_path / "t", tensors="full", flight=4, modules=[mlp + "*"], flight_at_exit=True,
                           flight_mib=budget):
        train(model, 5)
    r = open_trace(tmp_path / "t").rank(0)
    stored = {ref.version: ref.nbytes for op in r for ref in [*op.inputs(), *op.outputs_refs()]
              if ref.chunk is not None}
    assert 0 < sum(stored.values()) <= budget * (1 << 20)
    assert any("left out to stay within 0.02 MiB" in line for line in r.lost), r.lost
    assert any("older step(s) were dropped" in line for line in r.lost), r.lost
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    counts = report.counts()
    assert counts["error"] == 0 and counts["ok"] > 0
    assert "inputs not stored in the trace (recorded with tensors=meta/stats or a filter)" in {
        o.reason for o in report.ops if o.status.value == "skipped"}


@pytest.mark.parametrize("bad", [["--steps", "5-2"], ["--steps", "x"], ["--flight", "0"],
                                 ["--flight", "3", "--tensors", "full"],  # full needs a filter
                                 ["--step", "3", "--steps", "1-2"], ["--step", "3", "--flight", "2"]])
def test_record_cli_rejects_bad_step_options(tmp_path, capsys, bad):
    assert cli_main(["record", *bad, "-o", str(tmp_path / "t"), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replaydiff: ") and err.count("\n") == 1 and "nothing was recorded" not in err, err


def test_op_granularity_gradient_series_is_the_modules_backward_not_a_parameters_detach(tmp_path):
    """A module's gradient series comes from its last backward op that computes (convolution_backward), not from
    the detach AccumulateGrad makes of its bias gradient after it (which a batch norm makes zero)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                                torch.nn.Linear(2 * 4 * 4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 1, 6, 6), torch.tensor([0, 2, 1, 0])
    weight_grads = []
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="1-3"):
        for _ in range(3):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            weight_grads.append(model[0].weight.grad.norm().item())  # the conv's backward output 1 (0: x's, None)
            opt.step()
            opt.zero_grad()
    (grad,) = [s for s in compute_trend(open_trace(tmp_path / "t").rank(0)).series
               if (s.module, s.kind) == ("Sequential.0", "grad")]
    assert grad.values["l2"] == pytest.approx(weight_grads, rel=1e-5)


