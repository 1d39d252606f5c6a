"""torch.compile under the recorder: what torch does with compiled regions while the recorder's dispatch mode is on,
and the CompiledRegionTracker (replaydiff/record/compiled.py) that reports it.

Backends: "aot_eager" and small custom backends (the behaviour under test is dynamo's, before any backend runs,
and they compile in about a second on two CPU cores). The inductor test that shows a compiled kernel missing
from the trace (its first compile takes ~15 s on two cores) is in tests/e2e/test_compiled_e2e.py.
See docs/design/compile.md for the torch source behind each expectation.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff
from replaydiff.record.compiled import CompiledRegionTracker, summarize
from replaydiff.trace import open_trace

from compiled_helpers import fresh_dynamo, trace_ops  # noqa: F401 (fresh_dynamo: autouse)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.lin(x)).sin()


class Counting:
    """A backend that counts compiles and runs of the compiled code, around aot_eager (or around ``inner``)."""

    def __init__(self, inner=None) -> None:
        self.compiles = 0
        self.runs = 0
        self.inner = inner

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        if self.inner is not None:
            compiled = self.inner(gm, example_inputs)
        else:
            from torch._dynamo.backends.debugging import aot_eager

            compiled = aot_eager(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


def opaque(gm, example_inputs):
    """A backend whose compiled code is invisible to dispatch modes, as an inductor kernel is."""
    from torch.utils._python_dispatch import _disable_current_modes

    def run(*args):
        with _disable_current_modes():
            return gm(*args)

    return run


class BareMode(TorchDispatchMode):
    """A dispatch mode that does nothing: what torch does to compiled code under any mode, tracker or not."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def eager_ops(fn) -> list[str]:
    """The aten ops ``fn`` runs eagerly, as the recorder would see them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log() as log:
        fn()
    return log.names


# -- what torch does ----------------------------------------------------------------------------------------------
def test_compiled_module_runs_eager_under_recorder_and_trace_holds_its_ops(tmp_path):
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 4)
    backend = Counting()
    compiled = torch.compile(model, backend=backend)
    compiled(x)  # compiled and cached before recording starts
    assert (backend.compiles, backend.runs) == (1, 1)

    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        y = compiled(x)
        compiled(x)
        regions = tracker.stop()

    # neither the cached compiled code ran nor a new compile happened: the region ran eagerly...
    assert (backend.compiles, backend.runs) == (1, 1)
    # ...so the trace holds exactly the module's eager aten ops, twice
    expected = eager_ops(lambda: model(x))
    assert "aten.addmm.default" in expected
    assert trace_ops(tmp_path / "t") == expected * 2
    assert torch.equal(y, model(x))

    assert len(regions) == 1
    r = regions[0]
    assert r["region"].startswith("Tiny.forward (") and "test_compiled.py" in r["region"]
    assert (r["kind"], r["calls"], r["how"], r["ops_in_trace"]) == ("forward", 2, "eager", True)
    assert r["calls_by_how"] == {"eager": 2}


def test_without_tracker_torch_leaves_a_region_eager_after_recording(tmp_path):
    """torch marks a frame skipped for the dispatch mode 'skip' for good (types.py ConvertFrameReturn.apply_to_code):
    what a bare dispatch mode does to a job (the recorder runs a tracker that undoes it)."""
    backend = Counting()
    fn = torch.compile(lambda a: (a * 2).cos(), backend=backend)
    x = torch.randn(3)
    fn(x)
    with BareMode():
        fn(x)
    fn(x)
    fn(x)
    assert (backend.compiles, backend.runs) == (1, 1)  # the cached compiled code never runs again


def test_the_recorder_notes_compiled_regions_and_keeps_them_compiled(tmp_path, cli_here):
    backend = Counting()
    fn = torch.compile(lambda a: (a * 2).cos(), backend=backend)
    x = torch.randn(3)
    fn(x)
    with pytest.warns(RuntimeWarning, match="torch.compile region ran while recording"):
        with replaydiff.record(tmp_path / "t", compiled="eager"):
            fn(x)
    fn(x)
    assert (backend.compiles, backend.runs) == (1, 2)  # compiled again once recording ended
    r = open_trace(tmp_path / "t").rank(0)
    (region,) = r.compiled_regions
    assert (region.how, region.calls) == ("eager", 1)
    show = cli_here("show", tmp_path / "t")
    assert "COMPILED:" in show.stdout and "ran eager" in show.stdout
    replay = cli_here("replay", tmp_path / "t")
    assert replay.returncode == 0 and "compiled region" in replay.stderr and "ran eager" in replay.stderr


def test_tracker_keeps_a_region_compiled_after_recording(tmp_path):
    backend = Counting()
    fn = torch.compile(lambda a: (a * 2).cos(), backend=backend)
    x = torch.randn(3)
    fn(x)
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        fn(x)
        fn(x)
        regions = tracker.stop()
    assert backend.runs == 1  # eager while recording, as without the tracker
    fn(x)
    fn(x)
    assert (backend.compiles, backend.runs) == (1, 3)  # and compiled again afterwards, from the same cache entry
    assert regions[0]["calls"] == 2 and regions[0]["how"] == "eager"


def test_tracker_restores_both_graphs_of_a_graph_broken_region(tmp_path):
    """The resume function after a graph break is a code object of its own, marked "skip" too; both come back."""
    backend = Counting()

    def broken(a):
        b = a.sin()
        torch._dynamo.graph_break()
        return b.cos()

    fn = torch.compile(broken, backend=backend)
    x = torch.randn(3)
    fn(x)
    assert (backend.compiles, backend.runs) == (2, 2)
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        fn(x)
        fn(x)
        regions = tracker.stop()
    assert [(r["how"], r["calls"]) for r in regions] == [("eager", 2)]
    assert trace_ops(tmp_path / "t") == ["aten.sin.default", "aten.cos.default"] * 2
    fn(x)
    assert (backend.compiles, backend.runs) == (2, 4)


def test_region_compiled_up_to_a_graph_break_is_mixed(tmp_path):
    backend = Counting(inner=opaque)

    def make():
        b = torch.ones(3).sin()  # no tensor guard: this graph's cache entry hits under the recorder
        torch._dynamo.graph_break()
        return b.cos()  # the resume function takes b: a tensor guard, so it runs eager

    fn = torch.compile(make, backend=backend)
    fn()
    assert (backend.compiles, backend.runs) == (2, 2)
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        fn()
        fn()
        regions = tracker.stop()
    assert [(r["how"], r["calls"], r["calls_by_how"]) for r in regions] == [("mixed", 2, {"mixed": 2})]
    assert backend.runs == 2 + 2  # the first graph ran compiled in both recorded calls...
    assert trace_ops(tmp_path / "t") == ["aten.cos.default"] * 2  # ...and only the eager rest is in the trace


def test_first_call_under_recorder_is_not_compiled_at_all(tmp_path):
    backend = Counting()
    fn = torch.compile(lambda a: a.exp().sum(), backend=backend)
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        fn(torch.randn(3))
        regions = tracker.stop()
    assert backend.compiles == 0
    assert trace_ops(tmp_path / "t")[-2:] == ["aten.exp.default", "aten.sum.default"]
    assert [(r["how"], r["calls"]) for r in regions] == [("eager", 1)]
    fn(torch.randn(3))
    assert backend.compiles == 1  # compiled at its first call after recording (the tracker kept it unmarked)


def test_fullgraph_region_raises_into_the_job_without_tracker_and_not_with_it(tmp_path):
    fn = torch.compile(lambda a: a.tanh() + 1, backend="aot_eager", fullgraph=True)
    x = torch.randn(3)
    with BareMode():  # any dispatch mode without the tracker: torch raises into the job
        with pytest.raises(RuntimeError, match="fullgraph=True found no compiled frames"):
            fn(x)

    torch._dynamo.reset()
    fn = torch.compile(lambda a: a.tanh() + 1, backend="aot_eager", fullgraph=True)
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        y = fn(x)
        y2 = fn(x)
        regions = tracker.stop()
    assert torch.equal(y, x.tanh() + 1) and torch.equal(y2, y)
    (r,) = regions
    assert (r["how"], r["calls"], r["fullgraph"], r["fullgraph_errors_suppressed"]) == ("eager", 2, True, 2)
    assert "fullgraph=True" in summarize(regions)
    assert torch.equal(fn(x), y)  # compiles (and runs) normally afterwards


def test_cached_region_without_tensor_guards_runs_compiled_and_is_missing_from_trace(tmp_path):
    """No tensor argument, so no tensor guard sees the mode's dispatch keys: the cache hits and compiled code runs."""
    backend = Counting(inner=opaque)

    def make():
        return torch.arange(4.0).sin() * 3

    fn = torch.compile(make, backend=backend)
    fn()
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        y = fn()
        regions = tracker.stop()
    assert backend.runs == 2
    assert torch.equal(y, make())
    assert not any(name in trace_ops(tmp_path / "t") for name in ("aten.sin.default", "aten.mul.Tensor"))
    (r,) = regions
    assert (r["how"], r["calls"], r["backend"]) == ("compiled", 1, "Counting")
    assert r["ops_in_trace"] is None  # a backend replaydiff does not know
    assert "ran compiled by Counting" in summarize(regions)


def test_compiled_backward_of_a_forward_compiled_before_recording(tmp_path):
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(x).sum()  # forward compiled, outside the recording
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        loss.backward()
        regions = tracker.stop()
    (r,) = regions
    assert (r["kind"], r["how"], r["calls"], r["backend"], r["ops_in_trace"]) == (
        "backward", "compiled", 1, "aot_eager", True)
    assert r["region"].startswith("compiled backward of AOT graph")
    assert "aten.mm.default" in trace_ops(tmp_path / "t")  # aot_eager's backward graph ran its aten ops


# -- the tracker itself -------------------------------------------------------------------------------------------
def test_tracker_errors_never_reach_the_job_and_numerics_are_unchanged(tmp_path, monkeypatch):
    from replaydiff.record import compiled as compiled_mod  # (replaydiff.record is shadowed by the function)

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="aot_eager")
    with replaydiff.record(tmp_path / "plain", compiled="eager"):
        ref = compiled(x)

    def boom(*a, **k):
        raise ValueError("tracker bug")

    monkeypatch.setattr(compiled_mod, "_region_name", boom)
    monkeypatch.setattr(compiled_mod, "_mode_blocks_dynamo", boom)
    monkeypatch.setattr(compiled_mod.CompiledRegionTracker, "_current_call", boom)
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        y = compiled(x)
        regions = tracker.stop()
    assert torch.equal(y, ref)
    assert regions == []  # nothing could be told, and nothing was raised
    assert trace_ops(tmp_path / "t") == trace_ops(tmp_path / "plain")


def test_a_tracker_that_cannot_attach_says_so_and_the_job_runs_on(tmp_path, monkeypatch):
    from replaydiff.record import compiled as compiled_mod

    def broken():
        raise AttributeError("torch moved _callback_from_stance")

    monkeypatch.setattr(compiled_mod, "_patch", broken)
    fn = torch.compile(lambda a: a * 5, backend="aot_eager")
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        y = fn(torch.ones(2))
        regions = tracker.stop()
    assert torch.equal(y, torch.full((2,), 5.0))
    assert regions == [{"region": None, "kind": None, "calls": None, "how": "unknown",
                        "note": "compiled regions were not tracked (AttributeError: torch moved _callback_from_stance)"}]
    assert tracker.first_warning() == regions[0]["note"] + "."
    assert not compiled_mod._patches


def test_quiet_fullgraph_off_leaves_torchs_error_alone(tmp_path):
    fn = torch.compile(lambda a: a.tanh(), backend="aot_eager", fullgraph=True)
    tracker = CompiledRegionTracker(quiet_fullgraph=False)
    with BareMode():  # (the recorder runs its own tracker, which keeps quiet_fullgraph on)
        tracker.start()
        with pytest.raises(RuntimeError, match="fullgraph=True found no compiled frames"):
            fn(torch.ones(2))
        regions = tracker.stop()
    assert [(r["how"], r["calls"], r.get("fullgraph_errors_suppressed")) for r in regions] == [("eager", 1, None)]


def test_first_warning_once_and_nothing_when_nothing_compiled(tmp_path):
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "a", compiled="eager"):
        tracker.start()
        torch.randn(2).sum()
        assert tracker.stop() == []
    assert tracker.first_warning() is None

    fn = torch.compile(lambda a: a + 1, backend="aot_eager")
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "b", compiled="eager"):
        tracker.start()
        fn(torch.ones(2))
        regions = tracker.stop()
    msg = tracker.first_warning()
    assert msg is not None and msg.startswith("1 torch.compile region ran while recording: test_first_warning")
    assert "<lambda>" in msg and "eager aten ops" in msg
    assert tracker.first_warning() is None
    assert summarize(regions) == msg  # show/replay can print the same sentence from the manifest's list
    assert summarize([]) is None


def test_tracker_ignores_regions_run_by_other_threads(tmp_path):
    import threading

    fn = torch.compile(lambda a: a - 1, backend="aot_eager")
    fn(torch.ones(2))
    tracker = CompiledRegionTracker().start()
    th = threading.Thread(target=lambda: fn(torch.ones(2)))
    th.start()
    th.join()
    assert tracker.stop() == []


def test_stopped_tracker_restores_dynamo():
    import torch._dynamo.convert_frame as cf
    import torch._dynamo.eval_frame as ef

    before = (ef._callback_from_stance, cf.CatchErrorsWrapper._handle_skip)
    a, b = CompiledRegionTracker().start(), CompiledRegionTracker().start()
    assert ef._callback_from_stance is not before[0]
    a.stop()
    assert ef._callback_from_stance is not before[0]  # b still needs it
    b.stop()
    assert (ef._callback_from_stance, cf.CatchErrorsWrapper._handle_skip) == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert a.stop() == [] and a.first_warning() is None


_HOOK_WARNING = "when there are global hooks on modules"


def _hook_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if _HOOK_WARNING in str(w.message)]


@pytest.mark.parametrize("granularity", ["op", "module"])
def test_recording_a_compiled_module_adds_no_torch_warning_about_its_own_hooks(tmp_path, granularity):
    """torch warns when a compiled module is called while global module hooks exist: while recording those are the
    recorder's own, so the job sees no such warning, and its warning filters are as they were afterwards."""
    torch.manual_seed(0)
    compiled = torch.compile(Tiny(), backend="eager")
    x = torch.randn(2, 4)
    compiled(x)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t", tensors="stats", granularity=granularity):
            compiled(x).sum().backward()
    assert _hook_warnings(caught) == []
    assert warnings.filters == before


def test_the_jobs_own_global_hook_still_gets_torchs_warning(tmp_path):
    torch.manual_seed(0)
    compiled = torch.compile(Tiny(), backend="eager")
    x = torch.randn(2, 4)
    compiled(x)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with replaydiff.record(tmp_path / "t", tensors="stats"):
                compiled(x)
    finally:
        handle.remove()
    assert len(_hook_warnings(caught)) >= 1


@pytest.mark.parametrize("granularity", ["op", "module"])
def test_recording_many_steps_of_a_compiled_module_compiles_it_once_more_not_once_per_step(tmp_path, granularity):
    """dynamo guards torch's global module-hook dicts: module statistics put new hook objects under new keys at each
    recorded step, so the model recompiled every step until torch's recompile limit (8), then ran eager and its
    numbers changed (a new user's trend recording of a compiled CNN). The recorder's hooks are the same functions under
    the same keys at every step: one compile without them, one with, whatever the number of steps. The step-1 hook
    that starts a multi-step recording brings no warning about global hooks either."""
    torch.manual_seed(0)
    model = Tiny()
    counting = Counting()
    compiled = torch.compile(model, backend=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t", tensors="stats", granularity=granularity, steps="1-12"):
            for _ in range(12):
                compiled(torch.randn(2, 4, generator=g)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert counting.compiles <= 2, counting.compiles
    assert _hook_warnings(caught) == []
