"""Many recorded steps: 40 steps of a tiny GPT-2, ``record --steps`` and the flight recorder run as processes, and a
compiled model at module granularity (the rest: tests/integration/test_steps.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import replaydiff
from replaydiff.trend import compute_trend
from replaydiff.trace import open_trace

from steps_helpers import gpt2, module_path, one_thread, scale_weight_at, train  # noqa: F401 (one_thread: autouse)


# -- a sudden change: flagged at its step, in its module ------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["op", "module"])
def test_weight_times_100_at_step_30_is_the_first_change(tmp_path, granularity):
    model = gpt2()
    # Op by op, steps 20-40 of the 60 (the whole run takes 4x longer and tells nothing more); by module, all 60.
    steps = range(20, 41) if granularity == "op" else range(1, 61)
    with replaydiff.record(tmp_path / "t", tensors="stats", steps=f"{steps[0]}-{steps[-1]}", granularity=granularity):
        train(model, 60, scale_weight_at(30, 100.0))
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == list(steps)
    change = compute_trend(r).first_change
    assert change is not None
    expected = module_path(model, model.transformer.h[1].mlp.c_fc)
    assert (change.step, change.module) == (30, expected)
    op = r[change.index]  # the op it names is in the trace, in that step and module
    assert (op.step, op.module, op.name) == (30, expected, change.op)
    assert change.statistic in ("l2", "absmax") and change.score > 12
    # Same run without the planted change: nothing to flag.
    if granularity == "module":
        with replaydiff.record(tmp_path / "clean", tensors="stats", steps="1-60", granularity="module"):
            train(gpt2(), 60)
        assert compute_trend(open_trace(tmp_path / "clean").rank(0)).first_change is None


# -- the CLI -------------------------------------------------------------------------------------------------------------
def test_record_cli_of_every_other_step_per_module_holds_those_steps_and_modules(tmp_path, cli_here, monkeypatch):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(7):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    """))
    monkeypatch.delenv("REPLAYDIFF_RECORD", raising=False)
    proc = cli_here("record", "--tensors", "stats", "--steps", "2-6:2", "--granularity", "module", "-o", "trace", "--",
                    sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "replaydiff trend trace" in proc.stderr
    r = open_trace(tmp_path / "trace").rank(0)
    assert sorted({op.step for op in r}) == [2, 4, 6]
    assert {op.module for op in r} == {"Sequential", "Sequential.0", "Sequential.1", "Sequential.2"}
    assert {op.phase for op in r} == {"forward", "backward"}
    assert r.options.granularity == "module" and r.options.steps == "2-6:2"


def test_record_cli_flight_dumps_on_sigterm_and_the_process_still_dies_of_it(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import os, signal, torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(1, 10):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            if step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # as torchrun does when another rank fails
            loss.backward()
            opt.step()
            opt.zero_grad()
    """))
    env = {k: v for k, v in os.environ.items() if k != "REPLAYDIFF_RECORD"}
    proc = subprocess.run([sys.executable, "-m", "replaydiff", "record", "--tensors", "stats", "--flight", "3",
                           "-o", "trace", "--", sys.executable, "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr  # the job's fate is unchanged
    r = open_trace(tmp_path / "trace").rank(0)
    assert sorted({op.step for op in r}) == [3, 4, 5]  # step 5 up to the signal, in its forward
    assert {op.phase for op in r if op.step == 5} == {"forward"}
    assert "SIGTERM" in r.manifest["flight"]["reason"]


def test_record_cli_flight_dumps_when_the_model_output_goes_nan_and_trend_names_the_planted_op(tmp_path):
    """The job never makes a loss of the model's output (its loss is a weight penalty; the output is only logged):
    the output turning NaN at step 12, by a custom op planted below the recorder, is what triggers the dump."""
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import torch

        @torch.library.custom_op("job::spike", mutates_args=())
        def spike(x: torch.Tensor, bad: bool) -> torch.Tensor:
            return x * float("nan") if bad else x.clone()  # the planted fault

        @spike.register_fake
        def _(x, bad):
            return torch.empty_like(x)

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
                self.step = 0

            def forward(self, x):
                return {"logits": self.b(spike(torch.tanh(self.a(x)), self.step == 12))}

        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        for step in range(1, 21):
            net.step = step
            out = net(torch.randn(5, 4))
            print(step, out["logits"].mean().item())
            sum(p.pow(2).sum() for p in net.parameters()).backward()
            opt.step()
            opt.zero_grad()
    """))
    env = {k: v for k, v in os.environ.items() if k != "REPLAYDIFF_RECORD"}
    proc = subprocess.run([sys.executable, "-m", "replaydiff", "record", "--tensors", "stats", "--flight", "8",
                           "--steps", "1-20", "-o", "trace", "--", sys.executable, "job.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[11] == "12 nan" and proc.stdout.splitlines()[-1].startswith("20 ")
    r = open_trace(tmp_path / "trace").rank(0)
    assert sorted({op.step for op in r}) == list(range(5, 13))
    call = next(i for i, line in enumerate((tmp_path / "job.py").read_text().splitlines(), 1) if "out = net(" in line)
    assert r.flight.reason == f"logits of Net.forward at job.py:{call} holds NaN at step 12"
    assert f"recorded the flight recorder's steps 5-12 (written because {r.flight.reason}) into trace" in proc.stderr
    trend = subprocess.run([sys.executable, "-m", "replaydiff", "trend", "trace"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env=env)
    assert trend.returncode == 1, trend.stderr
    spike = next(op for op in r if op.step == 12 and op.name == "job.spike.default")
    assert f"cause: op #{spike.index} job.spike.default (Net, forward) at job.py:" in trend.stdout
    assert "step 12: made 40 NAN value(s) from inputs that had none" in trend.stdout  # 5 x 8 values of its output


def test_module_granularity_leaves_a_compiled_model_compiled_and_bitwise_unchanged(tmp_path, recwarn):
    """The module-statistics hooks are global: without a guard they run while dynamo traces the compiled region,
    dynamo traces the recorder's own numpy code, fails, the recording stops and the region falls back to eager."""
    def run(record_to=None) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                                    torch.nn.Linear(8, 1))
        compiled = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        def steps() -> None:
            for _ in range(4):
                compiled(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        if record_to is None:
            steps()
        else:
            with replaydiff.record(record_to, tensors="stats", steps="1-3", granularity="module"):
                steps()
        return model

    torch._dynamo.reset()
    plain = run()
    torch._dynamo.reset()
    watched = run(tmp_path / "t")
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters()):
        assert torch.equal(a, b), name
    assert not [w for w in recwarn if "recording stopped" in str(w.message)]
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == [1, 2, 3]
    modules = {op.module for op in r}
    assert "OptimizedModule" in modules  # the call that enters the region; the modules inside it are in its graph
    assert not [m for m in modules if m.startswith("OptimizedModule._orig_mod")]
