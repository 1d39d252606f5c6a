"""Batch invariance op by op: a recorded step's ops re-run on slices of the batch, the ones whose rows change with
the batch named (``replaydiff invariance``).

On a CPU, torch's matmul computes one row (a matrix-vector product) by another kernel than a block of rows: its
first row differs in the last bits from the first row of the whole product. Each test that expects matmuls named
measures that on this machine first, with the shapes of its own model, so the expectation is the machine's."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaydiff
from replaydiff.invariance import Finding, check_invariance
from replaydiff.models.tiny import TinyTransformer, TransformerConfig, make_step
from replaydiff.trace import open_trace
from steps_helpers import one_thread  # noqa: F401 (autouse: one intra-op thread, restored afterwards)

MATMULS = {"aten.mm.default", "aten.addmm.default"}


def _one_row_differs(m: int, k: int, n: int) -> bool:
    """Whether this machine's matmul gives the first row of an m x k by k x n product other bits alone."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    return not torch.equal(a[:1] @ b, (a @ b)[:1])


def _record(path, step) -> None:
    with replaydiff.record(path):
        step()


def _variant(result) -> list:
    return [(c.index, c.op) for c in result.variant]


# -- an MLP step: its matmuls, and nothing else --------------------------------------------------------------------
def _mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 32), torch.randn(8, 8)

    def step():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def test_a_one_row_check_of_an_mlp_step_names_its_matmuls_and_nothing_else(tmp_path):
    _record(tmp_path / "t", _mlp_step())
    rt = open_trace(tmp_path / "t").rank(0)
    r = check_invariance(rt)
    assert r.batch_size == 8
    named = _variant(r)
    if not _one_row_differs(8, 32, 64):  # this CPU's matmul gives one row the whole product's bits: none to name
        assert named == [] and r.count(Finding.NOT_JUDGED) == 0
        return
    assert named and {op for _, op in named} <= MATMULS
    forward_linears = [op.index for op in rt if op.phase == "forward" and op.name == "aten.addmm.default"]
    assert set(forward_linears) <= {i for i, _ in named}  # both layers' forward matmuls
    for c in r.variant:
        assert all(d.rows.stop - d.rows.start == 1 for d in c.diffs)  # the one-row slice, not the half
        worst = c.worst
        assert worst.mismatches > 0 and worst.max_ulps >= 1 and 0 < worst.rel_l2 < 1e-5
    # every other op that reads the batch was judged and found invariant: ReLU, the loss's gradient, ...
    assert r.count(Finding.NOT_JUDGED) == 0 and r.count(Finding.INVARIANT) > 0
    first = next(c for c in r.variant if c.phase == "forward")
    assert [o.op for o in first.reaches] == ["aten.mse_loss.default"]  # it flows into the loss


# -- a tiny transformer at decode shape: one token per sequence ----------------------------------------------------
def test_a_transformer_decode_step_names_its_matmuls_and_not_layernorm_softmax_or_attention(tmp_path):
    cfg = TransformerConfig(seq=1, batch=8, dropout=0.0)
    matmuls_vary = _one_row_differs(8, cfg.d_model, 3 * cfg.d_model)
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    _record(tmp_path / "t", step)
    r = check_invariance(open_trace(tmp_path / "t").rank(0))
    named = {op for _, op in _variant(r)}
    assert (named or not matmuls_vary) and named <= MATMULS  # none at all where one row gets the same bits
    judged = {c.op for c in r.checks if c.finding is Finding.INVARIANT}
    # LayerNorm (forward and backward), softmax and the attention's batched products were judged: invariant
    assert {"aten.native_layer_norm.default", "aten.native_layer_norm_backward.default", "aten._softmax.default",
            "aten.bmm.default"} <= judged
    kinds = {k.op: k for k in r.kinds}
    assert kinds["aten.addmm.default"].advice.kind == "matmul" and kinds["aten.addmm.default"].first
    assert kinds["aten.native_layer_norm.default"].variant == 0


# -- a custom op whose rows depend on the batch, planted below the recorder ----------------------------------------
@torch.library.custom_op("invtest::batch_scaled", mutates_args=())
def batch_scaled(x: torch.Tensor) -> torch.Tensor:
    """Scales by a factor that follows the number of rows it is given: a row's result depends on the batch."""
    return x * (1 + 1e-6 * x.shape[0])


@batch_scaled.register_fake
def _(x):
    return torch.empty_like(x)


batch_scaled.register_autograd(lambda ctx, grad: grad)


def test_a_custom_op_that_depends_on_the_batch_is_named_exactly(tmp_path):
    torch.manual_seed(0)
    a, b = nn.Linear(16, 16), nn.Linear(16, 4)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    x = torch.randn(4, 8, 16)  # 8 tokens per sequence: each slice gives the matmuls 8 rows or more

    def step():
        loss = b(torch.ops.invtest.batch_scaled(a(x))).square().mean()
        loss.backward()
        opt.step()

    _record(tmp_path / "t", step)
    rt = open_trace(tmp_path / "t").rank(0)
    planted = [op.index for op in rt if op.name == "invtest.batch_scaled.default"]
    assert len(planted) == 1
    r = check_invariance(rt)
    assert _variant(r) == [(planted[0], "invtest.batch_scaled.default")]
    (kind,) = [k for k in r.kinds if k.variant]
    assert kind.advice.kind == "custom kernel" and [c.index for c in kind.first] == planted


# -- ops without the batch: parameters only ------------------------------------------------------------------------
class _NormedLinear(nn.Module):
    """A linear layer whose weight is normalised each step from its parameter alone (no batch in those ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(16, 16))
        self.g = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.g[:, None] * self.v / self.v.norm(dim=1, keepdim=True)
        return x @ w.t()


def test_ops_that_read_only_parameters_are_said_without_the_batch_and_give_no_false_finding(tmp_path):
    torch.manual_seed(0)
    model = _NormedLinear()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, 16)

    def step():
        model(x).square().mean().backward()
        opt.step()

    _record(tmp_path / "t", step)
    rt = open_trace(tmp_path / "t").rank(0)
    r = check_invariance(rt)
    assert r.variant == () and r.count(Finding.NOT_JUDGED) == 0
    by_index = {c.index: c for c in r.checks}
    norm = next(op.index for op in rt if op.phase == "forward" and "norm" in op.name)
    assert by_index[norm].finding is Finding.NO_BATCH
    assert all(c.finding is Finding.NO_BATCH for c in r.checks if c.phase == "optimizer")
    assert r.count(Finding.INVARIANT) > 0  # the product with the batch was judged


# -- the CLI: text, JSON, exit codes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def custom_trace(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        a = nn.Linear(16, 16)
        x = torch.randn(4, 8, 16)
        path = tmp_path_factory.mktemp("inv") / "trace"
        with replaydiff.record(path):
            torch.ops.invtest.batch_scaled(a(x)).sum().backward()
        return path
    finally:
        torch.set_num_threads(before)


def test_the_cli_names_the_variant_op_exits_1_and_writes_json(custom_trace, cli_here, tmp_path):
    index = next(op.index for op in open_trace(custom_trace).rank(0) if op.name == "invtest.batch_scaled.default")
    res = cli_here("invariance", custom_trace, "--json", tmp_path / "inv.json")
    assert res.returncode == 1, res.stderr
    assert f"#{index} invtest.batch_scaled.default" in res.stdout
    assert "custom kernel:" in res.stdout and "flows into the loss: #" in res.stdout
    doc = json.loads((tmp_path / "inv.json").read_text())
    assert doc["format"] == "replaydiff.invariance/1" and doc["batch_size"] == 4
    variant = [o for o in doc["ops"] if o["finding"] == "variant"]
    assert [o["index"] for o in variant] == [index]
    assert variant[0]["diffs"][0]["max_ulps"] >= 1


def test_the_cli_refuses_a_batch_size_no_input_has_and_a_stats_trace(custom_trace, cli_here, tmp_path):
    res = cli_here("invariance", custom_trace, "--batch-size", "5")
    assert res.returncode == 2 and "no step input" in res.stderr
    with replaydiff.record(tmp_path / "stats", tensors="stats"):
        torch.ones(4, 3).sum()
    res = cli_here("invariance", tmp_path / "stats")
    assert res.returncode == 2 and "--tensors full" in res.stderr


def test_an_invariant_step_exits_0(tmp_path, cli_here):
    x = torch.randn(4, 8, 16)
    with replaydiff.record(tmp_path / "t"):
        torch.nn.functional.layer_norm(x, (16,)).softmax(-1).sum()
    res = cli_here("invariance", tmp_path / "t")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "every op that reads the batch is batch-invariant" in res.stdout


def test_a_step_where_no_op_computes_on_the_batch_is_not_called_clean(tmp_path, cli_here):
    x = torch.randn(4, 8, 16)
    with replaydiff.record(tmp_path / "t"):
        x.sum()  # reads the batch only to reduce it away: nothing was judged
    res = cli_here("invariance", tmp_path / "t")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "judged: 0 invariant, 0 batch-variant" in res.stdout
    assert "=> no op reading the batch was judged" in res.stdout
    assert "batch-invariant on these slices" not in res.stdout


# -- a batch the step makes itself: a DataLoader's collation, a randn ------------------------------------------------
def test_a_batch_collated_by_a_dataloader_inside_the_step_is_found_and_its_matmuls_named(tmp_path, cli_here):
    from torch.utils.data import DataLoader, TensorDataset

    matmuls_vary = _one_row_differs(8, 24, 48)  # else this CPU gives one row the whole product's bits: none named

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = iter(DataLoader(TensorDataset(torch.randn(64, 24), torch.randint(0, 4, (64,))), batch_size=8))
    with replaydiff.record(tmp_path / "t"):
        x, y = next(loader)  # the collation (a select per row of the dataset, then a stack) is recorded
        F.cross_entropy(model(x), y).backward()
        opt.step()
    rt = open_trace(tmp_path / "t").rank(0)
    forward_linears = {op.index for op in rt if op.phase == "forward" and op.name == "aten.addmm.default"}
    for extra in ((), ("--batch-size", "8")):
        res = cli_here("invariance", tmp_path / "t", *extra)
        assert res.returncode == (1 if matmuls_vary else 0), res.stdout + res.stderr
        assert "batch of 8 read from" in res.stdout and "(made in the step)" in res.stdout
        named = {int(line.split()[0][1:]) for line in res.stdout.splitlines() if line.startswith("  #")}
        assert forward_linears and (forward_linears <= named if matmuls_vary else not named)
    r = check_invariance(rt)
    assert r.batch_size == 8 and {c.op for c in r.variant} <= MATMULS
    assert r.count(Finding.NOT_JUDGED) == 0


def test_a_batch_drawn_by_randn_inside_the_step_is_found_and_its_matmuls_named(tmp_path):
    matmuls_vary = _one_row_differs(8, 24, 48)  # else this CPU gives one row the whole product's bits: none named
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 4))
    with replaydiff.record(tmp_path / "t"):
        model(torch.randn(8, 24)).square().mean().backward()
    rt = open_trace(tmp_path / "t").rank(0)
    for size in (None, 8):
        r = check_invariance(rt, batch_size=size)
        assert r.batch_size == 8 and "aten.addmm.default input 1 float32[8, 24]" in r.batch_input
        forward_linears = {op.index for op in rt if op.phase == "forward" and op.name == "aten.addmm.default"}
        named = {c.index for c in r.variant}
        assert (forward_linears <= named if matmuls_vary else not named) and {c.op for c in r.variant} <= MATMULS


class _Scaled(nn.Module):
    """A linear layer, then a buffer of 3 rows (a step input that needs no gradient) read by a module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bias = _Table()

    def forward(self, h):
        return self.bias(self.lin(h))


class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(3, 16))

    def forward(self, h):
        return h + self.table.sum(0)


def test_a_buffer_a_later_module_reads_is_not_taken_for_a_batch_read_before_the_model(tmp_path):
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(4, 16)
    with replaydiff.record(tmp_path / "t"):
        model(x * 2).sum().backward()  # the model's first op reads x * 2, made by no collation: x is the batch
    r = check_invariance(open_trace(tmp_path / "t").rank(0))
    assert r.batch_size == 4 and "aten.mul.Tensor input 0 float32[4, 16]" in r.batch_input


# -- what is not a finding: a mean's divisor, a random draw -----------------------------------------------------------
def test_a_loss_gradient_that_divides_by_the_batch_is_said_so_and_not_named(tmp_path):
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    w = torch.randn(16, 16, requires_grad=True)
    with replaydiff.record(tmp_path / "t"):
        F.mse_loss(x @ w, y).backward()  # 8 rows of a sequence per slice: the matmuls agree on this CPU
    rt = open_trace(tmp_path / "t").rank(0)
    r = check_invariance(rt)
    (mean,) = [c for c in r.checks if c.finding is Finding.MEAN]
    assert mean.op == "aten.mse_loss_backward.default" and "divides by the batch size" in mean.reason
    assert r.variant == ()


def test_a_dropout_that_draws_is_not_judged_and_the_cli_exits_1_saying_why(tmp_path, cli_here):
    x = torch.randn(4, 8, 16)
    with replaydiff.record(tmp_path / "t"):
        F.dropout(x.softmax(-1), p=0.5, training=True).sum()
    res = cli_here("invariance", tmp_path / "t")
    assert res.returncode == 1
    assert "a random op: a slice would draw other numbers" in res.stdout
    assert "no batch-variant op among those judged" in res.stdout


def test_batch_size_picks_the_step_input_with_that_many_rows(tmp_path):
    table = torch.randn(3, 16)  # a tensor of the forward that needs no gradient, read first, with 3 rows
    x = torch.randn(4, 8, 16)
    with replaydiff.record(tmp_path / "t"):
        (table.sum(0) + x).softmax(-1).sum()
    rt = open_trace(tmp_path / "t").rank(0)
    assert check_invariance(rt).batch_size == 3
    r = check_invariance(rt, batch_size=4)
    assert r.batch_size == 4 and "float32[4, 8, 16]" in r.batch_input
    assert {c.op for c in r.checks if c.finding is Finding.INVARIANT} >= {"aten.add.Tensor", "aten._softmax.default"}


# -- a run on some rows of another run's batch (invariance SMALL --rows-of BIG) ----------------------------------------
def _sequence_step(path, rows: slice) -> None:
    """The custom op's model on a slice of one fixed batch of 8 sequences of 8 tokens (its rows cut before
    recording, so the recorded step input is the slice)."""
    torch.manual_seed(0)
    a, b = nn.Linear(16, 16), nn.Linear(16, 4)
    x = torch.randn(8, 8, 16)[rows].clone()
    with replaydiff.record(path):
        b(torch.ops.invtest.batch_scaled(a(x))).square().mean().backward()


def test_a_one_row_run_mapped_onto_its_row_of_the_batch_parts_at_the_batch_variant_op(tmp_path, cli_here):
    _sequence_step(tmp_path / "big", slice(0, 8))
    _sequence_step(tmp_path / "small", slice(2, 3))
    planted = next(op.index for op in open_trace(tmp_path / "big").rank(0)
                   if op.name == "invtest.batch_scaled.default")
    res = cli_here("invariance", tmp_path / "small", "--rows-of", tmp_path / "big", "--json", tmp_path / "rows.json")
    assert res.returncode == 1, res.stderr
    assert "is row 2 of" in res.stdout
    assert f"the rows part at BIG #{planted} / SMALL #{planted} invtest.batch_scaled.default" in res.stdout
    assert "this op's kernel depends on the batch" in res.stdout
    doc = json.loads((tmp_path / "rows.json").read_text())
    assert doc["rows"] == [2, 3] and doc["parted"]["big"] == planted and doc["parted"]["inputs_agree"]
    assert doc["parted"]["cause"]["finding"] == "variant"


def test_rows_that_no_op_treats_differently_agree_and_exit_0(tmp_path, cli_here):
    def step(path, rows):
        x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))[rows].clone()
        with replaydiff.record(path):
            F.layer_norm(x, (16,)).softmax(-1).sum()
    step(tmp_path / "big", slice(0, 4))
    step(tmp_path / "small", slice(1, 3))
    res = cli_here("invariance", tmp_path / "small", "--rows-of", tmp_path / "big")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "is rows 1-2 of" in res.stdout and "the rows agree bit for bit" in res.stdout
    res = cli_here("invariance", tmp_path / "big", "--rows-of", tmp_path / "small")
    assert res.returncode == 2 and "not smaller" in res.stderr


def test_a_damaged_trace_is_exit_3_naming_the_file(custom_trace, cli_here, tmp_path):
    import shutil

    trace = tmp_path / "cut"
    shutil.copytree(custom_trace, trace)
    ops_file = sorted((trace / "rank0" / "ops").iterdir())[-1]
    data = ops_file.read_bytes()
    ops_file.write_bytes(data[: len(data) // 2])
    res = cli_here("invariance", trace)
    assert res.returncode == 3 and str(ops_file) in res.stderr and res.stdout == ""
