"""Replay in a fresh process: custom ops from the module that defines them, torch's frozen backend flags, and the
thread-count check (the rest: tests/integration/test_fidelity.py)."""
from __future__ import annotations

from pathlib import Path

import torch

import replaydiff


_USER_OP = '''
import torch


@torch.library.custom_op("rdtest::scale", mutates_args=())
def scale(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


@scale.register_fake
def _(x, k):
    return torch.empty_like(x)
'''


_RECORD_CUSTOM = '''
import sys, torch, replaydiff
import rdtest_ops
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # registers fsdp:: ops
with replaydiff.record(sys.argv[1]):
    y = torch.ops.rdtest.scale(torch.randn(3), 2.0) + 1
    out = torch.zeros(2, 2, 4)
    torch.ops.fsdp.chunk_cat([torch.randn(2, 3), torch.randn(2, 3)], 1, 2, out=out)
    out.sum()
'''


def test_custom_ops_replay_from_the_module_that_defines_them(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "rdtest_ops.py").write_text(_USER_OP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(tmp_path)]))
    subprocess.run([sys.executable, "-c", _RECORD_CUSTOM, str(tmp_path / "t")], check=True, env=env, cwd=tmp_path)
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    assert r.custom_ops == {"rdtest.scale.default": "rdtest_ops",
                            "fsdp.chunk_cat.default": "torch.distributed.fsdp._fully_shard._fsdp_collectives"}
    cli = [sys.executable, "-m", "replaydiff", "replay", str(tmp_path / "t")]
    env = dict(os.environ, PYTHONPATH=str(root))  # a fresh process: neither module is imported
    plain = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=root)
    # the custom op holds numbers replay could not compute without its module: not judged, never clean
    assert plain.returncode == 1 and "not judged" in plain.stdout, (plain.stdout[-800:], plain.stderr)
    assert "rdtest.scale.default is defined in Python module rdtest_ops: replay with --import rdtest_ops" \
        in plain.stdout
    assert "fsdp" not in plain.stdout  # torch's own module was imported by replay itself: chunk_cat replayed
    full = subprocess.run(cli + ["--import", "rdtest_ops", "--json", "-"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    import json

    report = json.loads(full.stdout)
    assert report["summary"]["skipped"] == 0 and report["summary"]["ok"] == len(report["ops"])
    assert {o["op"] for o in report["ops"]} >= {"rdtest.scale.default", "fsdp.chunk_cat.default"}


def test_replay_works_after_torch_freezes_its_backend_flags(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, torch, replaydiff\n"
            "from replaydiff.replay import replay_trace, ReplayOptions\n"
            "with replaydiff.record(sys.argv[1]):\n    torch.randn(3).exp()\n"
            "torch.backends.disable_global_flags()  # what importing torch's testing utilities does\n"
            "r = replay_trace(sys.argv[1], ReplayOptions())\n"
            "print(r.counts()['ok'], torch.backends.cudnn.benchmark)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t")], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "False"]


def test_threads_tests_whether_an_op_depends_on_the_parallel_split(tmp_path: Path, cli_here) -> None:
    # CPU LayerNorm backward reduces in another order with 1 thread than with 2: bitwise
    # replay holds at the recorded thread count (the default at `same`) and breaks at another (--threads 1).
    from replaydiff.models.tiny import TinyTransformer, make_step

    torch.manual_seed(0)
    model = TinyTransformer()
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with replaydiff.record(tmp_path / "t"):
            step()
    finally:
        torch.set_num_threads(saved)
    cli = ["replay", tmp_path / "t", "--precision", "same", "--json", "-"]
    import json

    recorded = cli_here(*cli)
    one = cli_here(*cli, "--threads", "1")
    assert torch.get_num_threads() == saved  # replay set the thread count back
    assert recorded.returncode == 0, recorded.stderr
    assert one.returncode == 1, one.stderr
    divergent = {o["op"] for o in json.loads(one.stdout)["ops"] if o["status"] == "divergent"}
    assert divergent == {"aten.native_layer_norm_backward.default"}
    assert json.loads(one.stdout)["options"]["threads"] == 1
