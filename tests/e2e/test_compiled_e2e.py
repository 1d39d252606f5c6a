"""The compile tracker where it takes a compile or a fresh process: inductor's backward kernels, and a tracker that
attaches when torch.compile is first called inside the block (the rest: tests/integration/test_compiled.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import replaydiff
from replaydiff.record.compiled import CompiledRegionTracker, summarize

from compiled_helpers import fresh_dynamo, trace_ops  # noqa: F401 (fresh_dynamo: autouse)


# inductor's first compile takes ~30 s on two cores (3 s with a warm inductor cache)
def test_inductor_backward_kernels_are_missing_from_trace(tmp_path):
    """The one inductor test: a compiled backward run under the recorder; only extern kernels reach the trace."""
    w = torch.randn(4, 2, requires_grad=True)
    fn = torch.compile(lambda a, b: torch.relu(a @ b).sin().sum(), backend="inductor")
    loss = fn(torch.randn(3, 4), w)
    tracker = CompiledRegionTracker()
    with replaydiff.record(tmp_path / "t", compiled="eager"):
        tracker.start()
        loss.backward()
        regions = tracker.stop()
    ops = trace_ops(tmp_path / "t")
    assert "aten.cos.default" not in ops and "aten.threshold_backward.default" not in ops  # fused into a kernel
    (r,) = regions
    assert (r["kind"], r["how"], r["backend"], r["ops_in_trace"]) == ("backward", "compiled", "inductor", False)
    assert "NOT in the trace" in summarize(regions)


def test_tracker_attaches_when_torch_compile_is_first_called_inside_the_block(tmp_path):
    code = textwrap.dedent(f"""
        import sys, torch, replaydiff
        from replaydiff.record.compiled import CompiledRegionTracker
        assert "torch._dynamo.eval_frame" not in sys.modules
        t = CompiledRegionTracker()
        with replaydiff.record({str(tmp_path / 't')!r}, compiled="eager"):
            t.start()
            fn = torch.compile(lambda a: a * 3, backend="aot_eager")
            fn(torch.ones(2)); fn(torch.ones(2))
            regions = t.stop()
        assert torch.compile.__module__ == "torch", torch.compile  # the stand-in is gone
        print([(r["how"], r["calls"]) for r in regions])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('eager', 2)]"
