"""`replaydiff report TRACE --replay RESULT.json`: the health report's checks, culprit, worst ops, modules and
environment, and each likely cause shown only with its evidence (and absent without it)."""
from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main
from tests.replay_helpers import mlp_step, transformer_step

from health_report_helpers import _causes, _replay_json, _report


CAUSES = ("TF32 matmul / convolution", "a non-deterministic kernel", "a result that depends on the CPU thread count",
          "an error at the level of the dtype's rounding", "a collective that disagrees across ranks")


def _record(path: Path, step, **options) -> Path:
    with replaydiff.record(path, **options):
        step()
    return path


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    trace = _record(tmp_path_factory.mktemp("health") / "t", mlp_step(), plant="aten.mm.default:2:1e-3")
    return trace, _replay_json(trace)


def test_markdown_report_names_the_planted_culprit_with_checks_top_ops_modules_and_environment(planted, capsys):
    trace, replay = planted
    rt = replaydiff.open_trace(trace).rank(0)
    op = rt[rt.planted.index]
    md = _report(trace, replay, capsys)
    lines = md.splitlines()
    assert lines[0].startswith("**PLANTED FAULT") and f"op #{op.index}" in lines[0]
    assert "| ops divergent from the reference | 1 | 0 | FAIL |" in md
    assert "| ops that could not be replayed | 0 | 0 | pass |" in md
    assert "| ops whose repeated runs disagree | not checked (replay --repeat N) | 0 | n/a |" in md
    culprit = md.split("## Culprit", 1)[1].split("##", 1)[0]
    assert f"**#{op.index} {op.name}**" in culprit
    assert f"- module: {op.module}" in culprit and f"- phase: {op.phase}" in culprit
    # a backward op is at its forward op's line, as every report says it, and what ran it follows
    assert op.phase == "backward"
    assert f"- source line: {rt[op.forward_index].source}" in culprit
    assert f"- ran by: backward of forward op #{op.forward_index}; backward() called at {op.source}" in culprit
    top = md.split("largest error / limit |", 1)[1].split("## Error per module")[0]
    rows = [l for l in top.splitlines() if l.startswith("| #")]
    assert len(rows) == 10 and rows[0].startswith(f"| #{op.index} | {op.name} |")
    modules = md.split("## Error per module", 1)[1].split("## Likely causes")[0]
    assert re.search(rf"^\| {re.escape(op.module)} \| \d+ \| 1 \| ", modules, re.M)
    assert f"- torch: {rt.environment.torch}" in md
    assert f"- num_threads: {rt.environment.num_threads}" in md
    # a 1e-3 fault in a CPU float32 matmul: no cause has evidence here
    assert _causes(md) == []
    assert "None with evidence" in md


def test_html_report_is_one_self_contained_file_with_an_svg_plot_and_is_never_overwritten(planted, tmp_path, capsys):
    trace, replay = planted
    rt = replaydiff.open_trace(trace).rank(0)
    out = tmp_path / "report.html"
    assert main(["report", str(trace), "--replay", str(replay), "-o", str(out)]) == 1  # a divergence was found
    text = out.read_text()
    assert text.splitlines()[0].startswith("<!-- PLANTED FAULT")
    assert "<svg" in text and "<style>" in text
    assert not re.search(r"<script|<link|<img|src=|href=", text)  # nothing fetched from elsewhere
    assert f"rank 0 op #{rt.planted.index} divergent" in text  # the culprit's point in the plot
    points = re.findall(r"<circle ", text)
    judged = [o for o in json.loads(replay.read_text())["ops"]
              if o["metrics"] and ("norm_max" in o["metrics"] or "mismatches" in o["metrics"])]
    assert len(points) == len(judged) > 40  # every op with a measured error is a point
    out.write_text("mine")
    assert main(["report", str(trace), "--replay", str(replay), "-o", str(out)]) == 2
    assert out.read_text() == "mine" and "--force" in capsys.readouterr().err
    assert main(["report", str(trace), "--replay", str(replay), "-o", str(out), "--force"]) == 1
    assert out.read_text().startswith("<!-- PLANTED FAULT")


def test_a_replay_of_another_trace_is_a_usage_error(planted, tmp_path, capsys):
    """A report of one trace's replay results under another trace's name would mislead: exit 2, one line, no file."""
    _, replay = planted
    other = _record(tmp_path / "other", mlp_step())
    out = tmp_path / "r.md"
    capsys.readouterr()
    assert main(["report", str(other), "--replay", str(replay), "-o", str(out)]) == 2
    cap = capsys.readouterr()
    assert not out.exists() and cap.out == ""
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and f"is a replay of {json.loads(replay.read_text())['trace']}, not {other}" in err[0], err


def test_rounding_level_error_is_named_with_its_figures(tmp_path, capsys):
    # 3e-6 relative in float32 is ~25 eps: over the limit of 16, within 4x of it
    trace = _record(tmp_path / "t", mlp_step(), plant="aten.mm.default:2:3e-6")
    md = _report(trace, _replay_json(trace), capsys)
    assert _causes(md) == ["an error at the level of the dtype's rounding"]
    ev = md.split("### an error at the level of the dtype's rounding", 1)[1]
    m = re.search(r"max_abs/\(eps\*absmax\) (\S+) and rel_l2/eps (\S+):", ev)
    assert m and 16 < float(m.group(1)) <= 64


def test_one_figure_for_the_culprit_in_replay_report_html_and_json(tmp_path, capsys):
    """2e-6 relative in float32 is ~16.7 eps: just over the max_abs limit of 16 but twice the rel_l2 limit of 8, so
    the severity (the larger ratio) is ~2.1. The headline and the culprit's line in every report give that one
    number, the verdict's severity (not max_abs/(eps*absmax) 16.4 over its limit 16 in one place)."""
    trace = _record(tmp_path / "t", mlp_step(), plant="aten.mm.default:2:2e-6")
    replay = _replay_json(trace)
    doc = json.loads(replay.read_text())
    (culprit,) = [o for o in doc["ops"] if o["status"] == "divergent"]
    m = culprit["metrics"]
    assert m["norm_rel"] / m["limit_rel"] > m["norm_max"] / m["limit_max"]  # the rel_l2 figure decides
    figure = f"{culprit['severity']:.3g}"
    assert culprit["severity"] == pytest.approx(m["norm_rel"] / m["limit_rel"]) and culprit["severity"] > 1.5

    capsys.readouterr()
    assert main(["replay", str(trace)]) == 1
    out = capsys.readouterr().out.splitlines()
    line = out[out.index(next(ln for ln in out if ln.startswith("first divergent op"))) + 1]
    assert line.startswith(f"  error / limit {figure}  ") and f"rel_l2/eps {m['norm_rel']:.3g} (limit " in line, line

    md = _report(trace, replay, capsys)
    assert f"| largest error / limit | {figure} (#{culprit['index']}) | 1 | FAIL |" in md
    culprit_md = md.split("## Culprit", 1)[1].split("## The", 1)[0]
    assert f"error / limit {figure}  " in culprit_md
    assert re.findall(r"error / limit (\S+)", culprit_md) == [figure]
    html = tmp_path / "r.html"
    assert main(["report", str(trace), "--replay", str(replay), "-o", str(html)]) == 1
    page = html.read_text()
    assert f"{figure} (#{culprit['index']})" in page and f"error / limit {figure}  " in page


def test_thread_count_dependence_is_shown_by_rerunning_the_culprit(tmp_path, capsys):
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trace = _record(tmp_path / "t", transformer_step())
    finally:
        torch.set_num_threads(saved)
    replay = _replay_json(trace, "--precision", "same", "--threads", "1")
    culprit = json.loads(replay.read_text())["first_divergent"]
    assert culprit is not None  # LayerNorm backward reduces in another order with one thread than with two
    md = _report(trace, replay, capsys)
    assert "a result that depends on the CPU thread count" in _causes(md)
    ev = md.split("### a result that depends on the CPU thread count", 1)[1]
    assert f"#{culprit['index']} {culprit['op']}" in ev
    assert "with the recorded 2 thread(s) it is bit for bit the recorded output; with 1 thread(s)" in ev
    assert "TF32 matmul / convolution" not in _causes(md)


# -- a non-deterministic kernel: index_add that sums in a random order -----------------------------------------------
def _random_order_index_add(self, dim, index, source, alpha=1):
    out = self.clone()
    order = list(range(index.numel()))
    random.shuffle(order)  # atomicAdd-like: whichever addition lands first
    for k in order:
        out.select(dim, int(index[k])).add_(source.select(dim, k), alpha=alpha)
    return out


@pytest.fixture
def random_order_index_add():
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overriding the CPU kernel on purpose
        lib.impl("index_add", _random_order_index_add, "CPU")
    yield
    lib._destroy()


def _index_add_step() -> None:
    torch.manual_seed(0)
    src = torch.randn(256, 4)
    idx = torch.arange(256) % 2  # 128 terms per row: the order of the sum shows in the last bits
    torch.index_add(torch.zeros(2, 4), 0, idx, src).sum()


def test_nondeterministic_kernel_cause_needs_repeat_disagreeing(random_order_index_add, tmp_path, capsys):
    trace = _record(tmp_path / "t", _index_add_step)
    once = _report(trace, _replay_json(trace, "--precision", "same"), capsys)
    assert "#" in once.split("## Culprit", 1)[1] and "aten.index_add.default" in once.split("## Culprit", 1)[1]
    assert "a non-deterministic kernel" not in _causes(once)  # documented as such, but no run disagreed
    thrice = _report(trace, _replay_json(trace, "--precision", "same", "--repeat", "3"), capsys)
    assert "a non-deterministic kernel" in _causes(thrice)
    ev = thrice.split("### a non-deterministic kernel", 1)[1]
    assert "aten.index_add.default is among the ops PyTorch documents as non-deterministic on CUDA" in ev
    assert "replay --repeat 3 on cpu at same: 1 call(s) of it gave different results run to run" in ev


def test_tf32_flag_on_a_cpu_matmul_is_not_a_cause(tmp_path, capsys):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # recorded in the environment, but no CUDA kernel ran
    try:
        trace = _record(tmp_path / "t", mlp_step(), plant="aten.mm.default:1:1e-3")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert replaydiff.open_trace(trace).rank(0).environment.flags.matmul_tf32 is True
    md = _report(trace, _replay_json(trace), capsys)
    assert "- cuda.matmul.allow_tf32: True" in md
    assert "TF32 matmul / convolution" not in _causes(md)


@pytest.mark.gpu
def test_tf32_on_a_cuda_matmul_is_named_with_the_flag_as_evidence(tmp_path, capsys):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        torch.manual_seed(0)
        a, b = torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda")
        trace = _record(tmp_path / "t", lambda: (a @ b).sum().item())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    md = _report(trace, _replay_json(trace), capsys)
    assert "TF32 matmul / convolution" in _causes(md)
    ev = md.split("### TF32 matmul / convolution", 1)[1]
    assert "torch.backends.cuda.matmul.allow_tf32 = True" in ev and "aten.mm.default" in ev


