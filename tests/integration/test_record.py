"""The recorder: each recorded item checked against an independent oracle (what torch itself did)."""
from __future__ import annotations

import fnmatch
import math
import os
import socket
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff
import replaydiff.trace.writer as trace_writer
from replaydiff.models.tiny import TinyTransformer, make_step
from replaydiff.replay import ReplayOptions, Status, replay_trace
from replaydiff.trace import ArgPath, OpRecord, TensorRef, TensorStats, iter_refs, open_trace

from record_helpers import only, written


STAT_NAMES = ("numel", "mean", "absmax", "l2", "var", "nan", "inf")


# -- helpers ----------------------------------------------------------------------------------------------------
class OpLog(TorchDispatchMode):
    """Entered inside ``replaydiff.record``, so it sits above the recorder and sees every op the recorder sees."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def all_refs(op: OpRecord) -> list[TensorRef]:
    """Every tensor reference of an op: arguments, keyword arguments, written-after values, outputs."""
    return list(iter_refs([op.args, list(op.kwargs.values()), [after for _, after in op.writes], op.outputs]))


def rng_bytes(reader, op: OpRecord) -> torch.Tensor:
    return reader.rng_state(op.rng)


def stats_of(ref: TensorRef) -> list:
    """A reference's recorded statistics, in TensorStats.FIELDS order."""
    assert ref.stats is not None, ref
    return [getattr(ref.stats, k) for k in TensorStats.FIELDS]


def data_keys(rank_dir: Path) -> list[str]:
    keys: list[str] = []
    for f in sorted((rank_dir / "data").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            keys.extend(fh.keys())
    return keys


def small_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def fresh_state(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for k, v in sorted(opt.state[p].items()):
            if isinstance(v, torch.Tensor):
                out.append((f"{i}.{k}", v.detach().clone()))
    return out


def train_tiny(ctx=None, steps: int = 1):
    """TinyTransformer (dropout on) from torch.manual_seed(0), ``steps`` AdamW steps, the first one inside ``ctx``.

    Returns everything a recorder could disturb: losses, parameters, gradients, optimizer state, RNG state."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = make_step(model, model.example_batch(), opt)
    losses = []
    for s in range(steps):
        if s == 0 and ctx is not None:
            with ctx:
                losses.append(step())
        else:
            losses.append(step())
    return {
        "losses": losses,
        "params": [(n, p.detach().clone()) for n, p in model.named_parameters()],
        "grads": [(n, p.grad.clone()) for n, p in model.named_parameters()],
        "state": fresh_state(opt),
        "rng_state": torch.get_rng_state(),
    }


def assert_bitwise_same(a: dict, b: dict) -> None:
    assert len(a["losses"]) == len(b["losses"])
    for x, y in zip(a["losses"], b["losses"]):
        assert torch.equal(x, y), (x, y)
    for key in ("params", "grads", "state"):
        assert [n for n, _ in a[key]] == [n for n, _ in b[key]]
        assert len(a[key]) > 0
        for (n, x), (_, y) in zip(a[key], b[key]):
            assert torch.equal(x, y), f"{key} {n} differs"
    assert torch.equal(a["rng_state"], b["rng_state"]), "the recorder consumed random numbers"


def replaydiff_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "replaydiff" in str(w.message)]


# -- 1. numbering, names, phases, modules, backward links, source lines, optimizers ------------------------------
def test_ops_numbered_in_dispatch_order_named_by_func_with_phases(tmp_path, tiny_step):
    model, opt, batch = tiny_step.model, tiny_step.optimizer, tiny_step.batch
    log = OpLog()
    with replaydiff.record(tmp_path / "t"):
        with log:
            loss = model(*batch)
            seed = torch.ones_like(loss)
            n_forward = len(log.names)
            loss.backward(seed)
            n_backward = len(log.names)
            opt.step()
    r = open_trace(tmp_path / "t").rank(0)
    ops = list(r)
    assert r.complete and r.lost == []
    assert [o.index for o in ops] == list(range(len(log.names)))
    assert [o.name for o in ops] == log.names
    assert r.manifest["ops_seen"] == len(log.names)
    regions = {"forward": ops[:n_forward], "backward": ops[n_forward:n_backward], "optimizer": ops[n_backward:]}
    for phase, region in regions.items():
        aten = [o for o in region if o.name.startswith("aten.")]
        assert aten, f"no aten op in the {phase} region"
        wrong = [(o.index, o.name, o.phase) for o in aten if o.phase != phase]
        assert not wrong, f"ops of the {phase} region recorded with another phase: {wrong[:5]}"


def test_module_paths_in_forward_and_backward(tmp_path, tiny_step):
    model = tiny_step.model
    layer_norm_calls: list[str] = []
    names = {m: f"TinyTransformer.{n}" for n, m in model.named_modules() if n}
    hooks = [m.register_forward_pre_hook(lambda mod, inp: layer_norm_calls.append(names[mod]))
             for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    try:
        with replaydiff.record(tmp_path / "t"):
            tiny_step()
    finally:
        for h in hooks:
            h.remove()
    ops = list(open_trace(tmp_path / "t").rank(0))

    fwd_ln = [o.module for o in ops if o.name == "aten.native_layer_norm.default"]
    assert fwd_ln == layer_norm_calls
    bwd_ln = [o for o in ops if o.name == "aten.native_layer_norm_backward.default"]
    assert all(o.phase == "backward" for o in bwd_ln)
    assert [o.module for o in bwd_ln] == layer_norm_calls[::-1]  # backward visits them in reverse
    assert "TinyTransformer.blocks.1.ln2" in [o.module for o in bwd_ln]
    # Two sibling embeddings whose inputs need no grad: each backward op carries its own module.
    emb = sorted(o.module for o in ops if o.name == "aten.embedding_dense_backward.default")
    assert emb == ["TinyTransformer.pos", "TinyTransformer.tok"]
    # Every module holding parameters has forward and backward ops attributed to it.
    leaves = {f"TinyTransformer.{n}" for n, m in model.named_modules()
              if n and not list(m.children()) and list(m.parameters(recurse=False))}
    for phase in ("forward", "backward"):
        seen = {o.module for o in ops if o.phase == phase}
        assert leaves <= seen, f"{phase}: no op attributed to {sorted(leaves - seen)}"
    # A backward op belongs to the module of the forward op that made its autograd node.
    linked = [o for o in ops if o.phase == "backward" and o.forward_index is not None]
    assert linked
    mismatched = [(o.index, o.name, o.module, ops[o.forward_index].module) for o in linked
                  if o.module != ops[o.forward_index].module]
    assert not mismatched


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = torch.nn.Conv2d(1, 2, 3), torch.nn.Linear(2 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv(x)).flatten(1))


class TinyGRU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gru, self.out = torch.nn.Embedding(5, 4), torch.nn.GRU(4, 4, batch_first=True), \
            torch.nn.Linear(4, 3)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.gru(self.emb(t))[0][:, -1])


def test_gradient_accumulation_ops_belong_to_the_parameters_module(record_one):
    """Two models trained in one loop: the ops that put each gradient into ``.grad`` (AccumulateGrad's detach)
    carry the module of that parameter, not whichever module ModuleTracker last saw in backward."""
    torch.manual_seed(0)
    cnn, gru = SmallCNN(), TinyGRU()
    x, t, y = torch.randn(2, 1, 6, 6), torch.randint(0, 5, (2, 3)), torch.tensor([0, 1])

    def step():
        (F.cross_entropy(cnn(x), y) + F.cross_entropy(gru(t), y)).backward()

    _, r = record_one(step)
    owner = {p: f"{type(model).__name__}.{name.rpartition('.')[0]}"
             for model in (cnn, gru) for name, p in model.named_parameters()}
    ops = [o for o in r if o.phase == "backward" and o.name == "aten.detach.default"]
    checked = []
    for p, module in owner.items():
        # the op that stored this gradient: a backward detach whose output is p.grad, bit for bit
        stored = [o for o in ops if o.outputs.shape == p.grad.shape and torch.equal(r.tensor(o.outputs), p.grad)]
        assert stored, module
        checked += [(o.index, o.module, module) for o in stored]
    wrong = [c for c in checked if c[1] != c[2]]
    assert not wrong, wrong
    assert {m for _, m, _ in checked} >= {"SmallCNN.fc", "SmallCNN.conv", "TinyGRU.emb", "TinyGRU.gru"}


class _Doubled(torch.autograd.Function):
    """A custom autograd Function: its forward runs without grad, so no recorded forward op makes its node."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


class _WithFunction(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Doubled.apply(x).sum()


def test_recording_puts_no_hooks_on_the_jobs_tensors(record_one):
    """Module paths are tracked with forward hooks alone: no hook on the tensors a module takes or returns (hooks
    there run in the job's backward and cost ~5 us per op of a small step), and backward ops still carry the module
    of the forward op that made their node."""
    torch.manual_seed(0)
    model = _Outer()
    x = torch.randn(2, 3, requires_grad=True)
    outs: list[torch.Tensor] = []
    handle = model.inner.register_forward_hook(lambda mod, inp, out: outs.append(out))
    hooked: list[int] = []

    def step():
        y = model(x)
        hooked.extend(len(t._backward_hooks or {}) for t in (x, outs[0], y))  # as backward begins
        y.sum().backward()

    try:
        _, r = record_one(step)
    finally:
        handle.remove()
    assert hooked == [0, 0, 0], "the recorder hooked tensors of the job"
    assert {o.module for o in r if o.phase == "backward" and o.name == "aten.mm.default"} == {"_Outer.inner",
                                                                                            "_Outer.head"}


def test_ops_of_a_callback_the_engine_runs_as_backward_ends_are_backward(record_one):
    """FSDP2 reduce-scatters the last parameter group's gradients in a callback it queues on the autograd engine,
    which runs as the backward pass ends, in no autograd node: those ops are backward, and what runs after
    backward() returns is forward again (a new-user trial's show --list phased FSDP2's last reduce-scatter forward)."""
    torch.manual_seed(0)
    w, x = torch.randn(4, requires_grad=True), torch.randn(4)
    done: list[torch.Tensor] = []

    def finish():  # as FSDP2's final callback: every node has run, the gradient is in .grad
        done.append(w.grad.abs().sqrt())

    def hook(grad):
        torch.autograd.Variable._execution_engine.queue_callback(finish)
        return grad

    def step():
        y = w * x
        y.register_hook(hook)
        y.sum().backward()
        return torch.exp(w.detach())

    after, r = record_one(step)
    assert torch.equal(done[0], x.abs().sqrt()) and torch.equal(after, torch.exp(w.detach()))  # the job's own values
    phases = {o.name: o.phase for o in r}
    assert (phases["aten.abs.default"], phases["aten.sqrt.default"]) == ("backward", "backward"), phases
    assert phases["aten.exp.default"] == "forward" and phases["aten.sum.default"] == "forward", phases


def test_backward_ops_of_a_custom_function_belong_to_the_module_that_called_it(record_one):
    torch.manual_seed(0)
    model = _WithFunction()
    x = torch.randn(4, requires_grad=True)
    _, r = record_one(lambda: model(x).backward())
    ops = list(r)
    doubled = [o for o in ops if o.phase == "backward" and o.name == "aten.mul.Tensor"]
    assert len(doubled) == 1 and doubled[0].forward_index is None  # the Function's backward: g * 2
    assert doubled[0].module == "_WithFunction"
    assert [o.module for o in ops if o.phase == "forward" and o.name == "aten.mul.Tensor"] == ["_WithFunction"]


def test_backward_ops_point_to_their_forward_op(record_one, tiny_step):
    _, r = record_one(tiny_step)
    ops = list(r)
    by_index = {o.index: o for o in ops}
    pairs = {
        "aten.native_layer_norm_backward.default": "aten.native_layer_norm.default",
        "aten.gelu_backward.default": "aten.gelu.default",
        "aten.embedding_dense_backward.default": "aten.embedding.default",
        "aten._softmax_backward_data.default": "aten._softmax.default",
        "aten.nll_loss_backward.default": "aten.nll_loss_forward.default",
    }
    for bwd_name, fwd_name in pairs.items():
        bwd = [o for o in ops if o.name == bwd_name]
        assert bwd, bwd_name
        for o in bwd:
            assert o.forward_index is not None, f"#{o.index} {bwd_name} has no forward op"
            f = by_index[o.forward_index]
            assert f.index < o.index and f.phase == "forward"
            assert f.name == fwd_name, (o.index, f.name)
    for o in ops:
        if o.forward_index is not None:
            assert o.phase == "backward" and by_index[o.forward_index].phase == "forward" and o.forward_index < o.index
    # The link is the right call, not only the right kind: layer-norm backward reads the mean and rstd that its
    # forward op produced (same storage versions).
    for o in (o for o in ops if o.name == "aten.native_layer_norm_backward.default"):
        f = by_index[o.forward_index]
        assert o.args[3].version == f.outputs[1].version and o.args[4].version == f.outputs[2].version


def test_source_line_points_at_the_calling_line(record_one, tiny_step):
    x = torch.arange(4.0)

    def work():
        y = torch.mul(x, 3); line = sys._getframe().f_lineno  # noqa: E702 -- one line on purpose
        tiny_step()
        return y, line

    (_, line), r = record_one(work)
    ops = list(r)
    mul = ops[0]
    assert mul.name == "aten.mul.Tensor"
    path, lineno = mul.source.rsplit(":", 1)
    assert Path(path).resolve() == Path(__file__).resolve() and int(lineno) == line
    # replaydiff's own models are user code: their ops point into tiny.py, not into torch.
    ln = next(o for o in ops if o.name == "aten.native_layer_norm.default")
    assert ln.source.rsplit(":", 1)[0].endswith(os.path.join("replaydiff", "models", "tiny.py"))
    assert not any(os.sep + "torch" + os.sep in (o.source or "") for o in ops if o.phase == "forward")


def _import_file(path: Path):
    """Import a Python file as a module (the user's own code, outside the test and outside replaydiff)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_source_lines_keep_their_text_and_the_files_hash(tmp_path, record_one, monkeypatch):
    import hashlib

    user = tmp_path / "user_code.py"
    user.write_text("import torch\n\n\ndef work(x):\n    y = torch.mul(x, 3)  # scaled\n    return y + 1\n")
    work = _import_file(user).work
    x = torch.arange(4.0)
    _, r = record_one(lambda: work(x))
    mul, add = list(r)
    assert (mul.name, add.name) == ("aten.mul.Tensor", "aten.add.Tensor")
    assert mul.source == f"{user}:5" and add.source == f"{user}:6"
    assert (mul.source_text, add.source_text) == ("y = torch.mul(x, 3)  # scaled", "return y + 1")
    # one hash per file, in the manifest, of the bytes that ran
    assert r.source_files == {str(user): hashlib.sha256(user.read_bytes()).hexdigest()}
    monkeypatch.chdir(tmp_path)  # the user's project: the only place a trace's named files are read
    line = r.source_line(mul)
    assert (line.changed, line.current, line.warning()) == (False, "y = torch.mul(x, 3)  # scaled", None)
    # The user edits the file: the recorded text stays, the reader says the file changed and where the line went.
    user.write_text("import torch\n# a comment\n\n\ndef work(x):\n    y = torch.mul(x, 3)  # scaled\n"
                    "    return y + 1\n")
    line = open_trace(r.root.parent).rank(0).source_line(mul)
    assert (line.changed, line.moved_to, line.recorded) == (True, 6, "y = torch.mul(x, 3)  # scaled")
    assert line.warning() == f"{user} has changed since it was recorded; the recorded line is now line 6"
    # Read from outside that folder (a received trace naming files anywhere), no file is read: unknown, not clean.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    line = open_trace(r.root.parent).rank(0).source_line(mul)
    assert (line.changed, line.path, line.recorded) == (None, None, "y = torch.mul(x, 3)  # scaled")


OPTIMIZERS = {
    "adamw-loop": (lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False), ["aten.addcdiv_.default"], False),
    "adamw-foreach": (lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True), ["aten._foreach_addcdiv_."], True),
    "adamw-fused": (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), ["aten._fused_adamw_.default"], None),
    "sgd-momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False), ["aten.add_.Tensor"], False),
    "sgd-momentum-foreach": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
                             ["aten._foreach_mul_.", "aten._foreach_add_."], True),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_each_optimizers_ops_are_recorded_with_every_parameters_new_value(record_one, kind):
    make, expected, uses_foreach = OPTIMIZERS[kind]  # uses_foreach None: either way
    torch.manual_seed(0)
    model = small_mlp()
    opt = make(model.parameters())
    x, y = torch.randn(6, 4), torch.randn(6, 2)

    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        return before

    step()  # state exists (momentum buffers, moments): the recorded step is a steady-state one
    before, r = record_one(step)
    after = [p.detach().clone() for p in model.parameters()]
    ops = list(r)
    opt_ops = [o for o in ops if o.phase == "optimizer"]
    names = [o.name for o in opt_ops]
    for prefix in expected:
        assert any(n.startswith(prefix) for n in names), (prefix, sorted(set(names)))
    if uses_foreach is not None:
        assert any("_foreach_" in n for n in names) == uses_foreach
    if kind == "adamw-fused":
        fused = only(ops, "aten._fused_adamw_.default")
        assert all(torch.equal(r.tensor(t), p) for t, p in zip(fused.args[0], before))
        assert all(torch.equal(r.tensor(t), p) for t, p in zip(written(fused)[("arg", 0)], after))
    # Whatever the implementation, each parameter's new value is among the values the optimizer ops wrote.
    writes = [ref for o in opt_ops for _, w in o.writes for ref in iter_refs(w)]
    for p_before, p_after in zip(before, after):
        assert not torch.equal(p_before, p_after)
        assert any(ref.shape == tuple(p_after.shape) and torch.equal(r.tensor(ref), p_after) for ref in writes)


CLOSURE_STEPS = {  # optimizer, how step() is given the closure, closure calls per step
    "lbfgs-positional": (lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=2), lambda opt, c: opt.step(c), 2),
    # as frameworks' automatic optimization calls it (Lightning: optimizer.step(closure=...))
    "adam-keyword": (lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False), lambda opt, c: opt.step(closure=c), 1),
}


@pytest.mark.parametrize("kind", sorted(CLOSURE_STEPS))
def test_phases_inside_a_closure_optimizer_step(record_one, kind):
    """LBFGS evaluates the loss (forward and backward) inside ``optimizer.step(closure)``: those ops are forward
    and backward; only the optimizer's own update is ``optimizer``. Recording changes no bit of the result."""
    make, step, calls = CLOSURE_STEPS[kind]

    def run(record: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                    torch.nn.Linear(2 * 4 * 4, 3))
        opt = make(model.parameters())
        x, y = torch.randn(4, 1, 6, 6), torch.tensor([0, 1, 2, 0])

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        if record:
            _, r = record_one(lambda: step(opt, closure))
        else:
            step(opt, closure)
            r = None
        return [p.detach().clone() for p in model.parameters()], r

    plain, _ = run(False)
    params, r = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, params))
    ops = list(r)
    by_name = lambda name: [o.phase for o in ops if o.name == name]  # noqa: E731
    # each call of the closure: one forward and one backward pass
    assert by_name("aten.convolution.default") == ["forward"] * calls
    assert by_name("aten.addmm.default") == ["forward"] * calls
    assert by_name("aten._log_softmax.default") == ["forward"] * calls
    assert by_name("aten.convolution_backward.default") == ["backward"] * calls
    assert {o.module for o in ops if o.name == "aten.convolution_backward.default"} == {"Sequential.0"}
    # each parameter's final value is written by an op of the optimizer phase (LBFGS's p.add_, Adam's addcdiv_)
    update = [o for o in ops if o.writes]
    for p in params:
        writers = [o for o in update for _, w in o.writes for ref in iter_refs(w)
                   if ref.shape == tuple(p.shape) and torch.equal(r.tensor(ref), p)]
        assert writers and {o.phase for o in writers} == {"optimizer"}, [(o.index, o.name, o.phase) for o in writers]


# -- 2. in-place, out= and _foreach_*_ ops -----------------------------------------------------------------------
def test_inplace_out_and_foreach_record_before_and_after(record_one):
    x = torch.tensor([1.0, 2.0, 3.0])
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]), torch.full((2,), -7.0)
    ts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    x0, c0, ts0 = x.clone(), c.clone(), [t.clone() for t in ts]

    def work():
        x.add_(1)
        torch.add(a, b, out=c)
        torch._foreach_mul_(ts, 2)
        return x.mul(5)

    _, r = record_one(work)
    ops = list(r)

    add_ = only(ops, "aten.add_.Tensor")
    assert torch.equal(r.tensor(add_.args[0]), x0)
    (path, after), = add_.writes
    assert path == ArgPath("arg", 0) and torch.equal(r.tensor(after), x0 + 1) and torch.equal(x, x0 + 1)
    assert after.version != add_.args[0].version  # a write makes a new storage version
    # The next op reads the new version, not the stale one.
    mul = only(ops, "aten.mul.Tensor")
    assert mul.args[0].version == after.version and torch.equal(r.tensor(mul.args[0]), x0 + 1)

    out = only(ops, "aten.add.out")
    assert torch.equal(r.tensor(out.kwargs["out"]), c0)  # before: what was in c
    assert torch.equal(r.tensor(out.args[0]), a) and torch.equal(r.tensor(out.args[1]), b)
    assert torch.equal(r.tensor(written(out)[("kwarg", "out")]), a + b)

    fe = only(ops, "aten._foreach_mul_.Scalar")
    assert [r.tensor(t).tolist() for t in fe.args[0]] == [t.tolist() for t in ts0]
    assert fe.outputs is None  # returns nothing: the written list is the result
    assert [r.tensor(t).tolist() for t in written(fe)[("arg", 0)]] == [(t * 2).tolist() for t in ts0]


def test_writes_through_aliases_are_seen(record_one):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def work():
        x.data.mul_(2)  # a .data alias has its own version counter
        x[1:3].add_(100)  # a write through a view
        return x.sum()

    total, r = record_one(work)
    s = only(list(r), "aten.sum.default")
    assert torch.equal(r.tensor(s.args[0]), torch.tensor([2.0, 104.0, 106.0, 8.0]))
    assert torch.equal(r.tensor(s.outputs), total)


# -- 3. views and aliases ----------------------------------------------------------------------------------------
def test_views_share_a_storage_version_stored_once(tmp_path, record_one):
    base = torch.arange(16.0).reshape(4, 4)

    def work():
        v = base.t()
        return base.add(v), v.mul(2)

    _, r = record_one(work, chunk_ops=1)  # one op per chunk: "stored once" must hold across chunks too
    ops = list(r)
    t = only(ops, "aten.t.default")
    add = only(ops, "aten.add.Tensor")
    mul = only(ops, "aten.mul.Tensor")
    version = t.args[0].version
    assert t.outputs.version == version == add.args[0].version == add.args[1].version == mul.args[0].version
    assert add.args[1].stride == (1, 4) and add.args[0].stride == (4, 1)
    assert torch.equal(r.tensor(add.args[1]), base.t())
    assert torch.equal(r.tensor(mul.args[0]), base.t())
    assert torch.equal(r.tensor(t.outputs), base.t()) and torch.equal(r.tensor(t.args[0]), base)
    keys = data_keys(tmp_path / "trace" / "rank0")
    assert keys.count(str(version)) == 1
    assert len(keys) == len(set(keys))
    stored = {ref.version for o in ops for ref in all_refs(o) if ref.chunk is not None}
    assert set(keys) == {str(v) for v in stored}
    # base + its transpose + two results: three storages, each stored once.
    assert len(stored) == 3


def test_a_new_storage_at_a_freed_ones_address_is_a_new_storage(record_one):
    """Storages are told apart by address while they live; once one is freed, the allocator hands its address to
    the next one, which must get a version (and bytes) of its own."""
    addresses = []

    def work():
        for k in range(40):
            t = torch.full((4,), float(k))
            addresses.append(t.untyped_storage()._cdata)
            t.neg()
            del t

    _, r = record_one(work)
    assert len(set(addresses)) < len(addresses)  # the allocator did reuse addresses
    negs = [op for op in r if op.name == "aten.neg.default"]
    assert len({op.args[0].version for op in negs}) == 40
    assert [r.tensor(op.args[0]).tolist() for op in negs] == [[float(k)] * 4 for k in range(40)]


# -- 4. random ops and uninitialised outputs ---------------------------------------------------------------------
def test_random_ops_carry_generator_state(record_one):
    x = torch.ones(64)
    state = torch.get_rng_state()

    def work():
        d = F.dropout(x, 0.3, training=True)
        return d, torch.randn(5), x * 2

    (d, noise, _), r = record_one(work)
    ops = list(r)
    bern = only(ops, "aten.bernoulli_.float")
    assert bern.rng.device == "cpu"
    assert torch.equal(rng_bytes(r, bern), state)  # the state just before the op
    # Restoring the recorded state redoes the draw bit for bit.
    torch.set_rng_state(rng_bytes(r, bern).clone())
    assert bern.args[1] == pytest.approx(0.7)  # keep probability
    redo = torch.empty(64).bernoulli_(bern.args[1])
    assert torch.equal(redo, r.tensor(written(bern)[("arg", 0)]))
    assert torch.equal((d != 0).float(), redo)
    randn = only(ops, "aten.randn.default")
    torch.set_rng_state(rng_bytes(r, randn).clone())
    assert torch.equal(torch.randn(5), noise) and torch.equal(r.tensor(randn.outputs), noise)
    for o in ops:
        if o.name not in ("aten.bernoulli_.float", "aten.randn.default"):
            assert o.rng is None, o.name


def test_uninitialised_outputs_are_marked(record_one):
    a = torch.arange(3.0)

    def work():
        e = torch.empty_like(a)
        e.fill_(1.5)
        return e + a

    _, r = record_one(work)
    ops = list(r)
    empty = only(ops, "aten.empty_like.default")
    assert empty.uninitialised is True and empty.outputs.uninitialised is True and empty.outputs.chunk is None
    fill = only(ops, "aten.fill_.Scalar")
    assert fill.args[0].version == empty.outputs.version and fill.args[0].uninitialised is True
    after = written(fill)[("arg", 0)]
    assert not after.uninitialised and torch.equal(r.tensor(after), torch.full((3,), 1.5))
    add = only(ops, "aten.add.Tensor")
    assert not add.uninitialised and not add.args[0].uninitialised and not add.outputs.uninitialised


# -- 6. environment ----------------------------------------------------------------------------------------------
def test_environment_snapshot_holds_the_flags_threads_and_variables_set_at_record_time(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("REPLAYDIFF_TEST_UNRELATED", "x")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    saved = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
             torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    try:
        # Away from every default, so that a snapshot of defaults (or of the wrong moment) fails.
        torch.set_num_threads(1)
        torch.backends.cuda.matmul.allow_tf32 = not saved[1]
        torch.set_float32_matmul_precision("medium" if saved[2] != "medium" else "high")
        torch.use_deterministic_algorithms(not saved[3])
        torch.backends.cudnn.deterministic = not saved[4]
        expected_precision = torch.get_float32_matmul_precision()
        with replaydiff.record(tmp_path / "t"):
            torch.ones(2).add(1)
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cuda.matmul.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])
        torch.use_deterministic_algorithms(saved[3])
        torch.backends.cudnn.deterministic = saved[4]
    r = open_trace(tmp_path / "t").rank(0)
    env = r.environment
    assert env.torch == torch.__version__
    assert env.hostname == socket.gethostname()
    assert env.rank == 0 and env.world_size == 1
    assert env.num_threads == 1
    assert env.cuda == torch.version.cuda
    flags = env.flags
    assert flags.matmul_tf32 == (not saved[1])
    assert flags.float32_matmul_precision == expected_precision != saved[2]
    assert flags.deterministic_algorithms == (not saved[3])
    assert flags.cudnn_deterministic == (not saved[4])
    assert flags.cudnn_tf32 is not None
    variables = env.variables
    assert variables["NCCL_ALGO"] == "Tree"
    assert variables["TORCH_SHOW_CPP_STACKTRACES"] == "1"
    assert variables["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "REPLAYDIFF_TEST_UNRELATED" not in variables
    assert r.manifest["rank"] == 0 and r.manifest["world_size"] == 1


def test_rank_and_world_size_are_read_from_launcher_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with replaydiff.record(tmp_path / "t"):
        torch.ones(2).add(1)
    assert (tmp_path / "t" / "rank3").is_dir()
    r = open_trace(tmp_path / "t").rank(3)
    assert r.manifest["rank"] == 3 and r.manifest["world_size"] == 4
    assert r.environment.rank == 3 and r.environment.world_size == 4


# -- 7. tensor modes and filters ---------------------------------------------------------------------------------
def hand_stats(t: torch.Tensor) -> list:
    v = t.detach().reshape(-1).to(torch.float64)
    finite = v[torch.isfinite(v)]
    return [t.numel(), finite.mean().item(), finite.abs().max().item(), finite.norm().item(),
            finite.var(unbiased=False).item(), int(torch.isnan(v).sum()), int(torch.isinf(v).sum())]


def assert_stats(got: list, t: torch.Tensor) -> None:
    want = hand_stats(t)
    assert len(got) == len(STAT_NAMES)
    for name, g, w in zip(STAT_NAMES, got, want):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-12), f"{name}: {g} != {w}"


def test_stats_mode_matches_hand_computed_statistics(tmp_path, record_one):
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([1.5, float("nan"), -3.25, float("inf"), 2.0, float("-inf"), -0.5, float("inf")])
    half = (torch.randn(33, generator=g) * 7 + 2).half()
    ints = torch.randint(-50, 50, (10,), generator=g)

    def work():
        return special * 2, half + 1, ints * 3

    (s2, h1, i3), r = record_one(work, tensors="stats")
    ops = list(r)
    muls = [o for o in ops if o.name == "aten.mul.Tensor"]
    assert len(muls) == 2
    for op, inp, out in ((muls[0], special, s2), (only(ops, "aten.add.Tensor"), half, h1), (muls[1], ints, i3)):
        assert_stats(stats_of(op.args[0]), inp)
        assert_stats(stats_of(op.outputs), out)
    assert stats_of(muls[0].args[0])[5:] == [1, 3]  # one NaN, three infinities
    for o in ops:
        assert all(ref.chunk is None for ref in all_refs(o))
    assert data_keys(tmp_path / "trace" / "rank0") == []


def test_statistics_of_a_broadcast_view_are_of_its_values_when_the_op_ran(record_one):
    """An expanded scalar (every stride 0, as autograd expands a loss's gradient) is measured as it was at its op,
    not as its memory is when the batch of statistics is computed (written or freed by then)."""
    def work():
        a = torch.ones(())
        b = a.expand(4, 4)
        a.fill_(5.0)  # the storage behind b changes before the batch is measured
        return b

    _, r = record_one(work, tensors="stats")
    expand = only(list(r), "aten.expand.default")
    assert stats_of(expand.outputs) == [16, 1.0, 1.0, 4.0, 0.0, 0, 0]


def test_statistics_are_float64_sums_and_the_exact_absmax(record_one):
    """The values trend compares across traces: sums of float64 values (a large tensor in chunks of 65,536 values,
    in order), and the largest magnitude exactly, +0.0 for zeros of either sign, 128 for int8's -128."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    large = torch.randn(70_000, generator=g) * 3 - 1  # over 256 KiB: measured in place, in chunks
    small = torch.randn(50, generator=g).to(torch.bfloat16)
    tensors = [large, small, -torch.zeros(8), torch.tensor([-128, 5], dtype=torch.int8), -large[:1000]]

    _, r = record_one(lambda: [t.clone() for t in tensors], tensors="stats")
    clones = [o for o in r if o.name == "aten.clone.default"]
    assert len(clones) == len(tensors)
    for op, t in zip(clones, tensors):
        v = t.float().numpy().astype(np.float64)
        chunks = [v[i:i + 65_536] for i in range(0, v.size, 65_536)]
        s = ss = 0.0
        for c in chunks:
            s += float(c.sum()) if len(chunks) > 1 else 0.0
            ss += float((c * c).sum()) if len(chunks) > 1 else 0.0
        got = stats_of(op.outputs)
        assert got[2] == float(np.abs(v).max()) and math.copysign(1.0, got[2]) == 1.0, (t.dtype, got)
        if len(chunks) > 1:
            assert got[1] == s / v.size and got[3] == math.sqrt(ss), got


def test_meta_mode_stores_no_data(tmp_path, tiny_step):
    with replaydiff.record(tmp_path / "t", tensors="meta"):
        loss = tiny_step()
    r = open_trace(tmp_path / "t").rank(0)
    ops = list(r)
    assert r.complete and len(ops) > 100
    assert list((tmp_path / "t" / "rank0" / "data").iterdir()) == []
    refs = [ref for o in ops for ref in all_refs(o)]
    assert refs and all(ref.chunk is None and ref.stats is None for ref in refs)
    nll = only(ops, "aten.nll_loss_forward.default")
    assert nll.outputs[0].shape == tuple(loss.shape) and nll.outputs[0].dtype == "float32"
    assert r.options.tensors == "meta"


def test_op_glob_filter_keeps_numbering(tmp_path):
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    log = OpLog()
    with replaydiff.record(tmp_path / "t", ops="aten.mm*"):
        with log:
            c = a @ b
            d = (c + 1).relu()
            e = d @ a
    everything = list(open_trace(tmp_path / "t").rank(0))
    assert [o.name for o in everything] == log.names  # every op recorded, in order
    ops = [o for o in everything if o.data_left_out is None]
    expected = [i for i, n in enumerate(log.names) if fnmatch.fnmatchcase(n, "aten.mm*")]
    assert len(expected) == 2 and len(log.names) > 2
    assert [o.index for o in ops] == expected
    assert all(o.name == "aten.mm.default" for o in ops)
    assert torch.equal(open_trace(tmp_path / "t").rank(0).tensor(ops[1].outputs), e)
    # the others: statistics instead of data, and the reason
    add = next(o for o in everything if o.name == "aten.add.Tensor")
    assert add.data_left_out == "filtered" and add.outputs.chunk is None
    assert add.outputs.stats.mean == pytest.approx(float((a @ b + 1).mean()), rel=1e-6)


def test_module_glob_keeps_data_of_matching_modules_and_marks_the_rest_filtered(tmp_path, tiny_step):
    glob = "TinyTransformer.blocks.1.*"
    with replaydiff.record(tmp_path / "t", modules=glob):
        tiny_step()
    r = open_trace(tmp_path / "t").rank(0)
    ops = [o for o in r if o.data_left_out is None]
    assert ops and len(ops) < r.manifest["ops_seen"]
    assert all(fnmatch.fnmatchcase(o.module or "", glob) for o in ops)
    others = [o for o in r if o.data_left_out is not None]
    assert all(o.data_left_out == "filtered" and not fnmatch.fnmatchcase(o.module or "", glob) for o in others)
    assert len(ops) + len(others) == r.manifest["ops_seen"]
    phases = {o.phase for o in ops}
    assert {"forward", "backward"} <= phases
    assert any(o.module == "TinyTransformer.blocks.1.ln2" and o.phase == "backward" for o in ops)
    assert not any(o.phase == "optimizer" for o in ops)  # no module around the optimizer


def test_max_tensor_bytes_stores_statistics_instead(record_one):
    g = torch.Generator().manual_seed(2)
    small, big = torch.randn(3, 3, generator=g), torch.randn(30, 30, generator=g)

    def work():
        return small @ small, big @ big

    (_, bb), r = record_one(work, max_tensor_bytes=100)
    ops = list(r)
    mm_small, mm_big = [o for o in ops if o.name == "aten.mm.default"]
    assert mm_small.args[0].chunk is not None and torch.equal(r.tensor(mm_small.args[0]), small)
    assert mm_big.args[0].chunk is None and mm_big.outputs.chunk is None
    assert_stats(stats_of(mm_big.args[0]), big)
    assert_stats(stats_of(mm_big.outputs), bb)


# -- 8. the recorder never changes numerics ----------------------------------------------------------------------
@pytest.mark.parametrize("tensors", ["full", "stats"])
def test_recording_changes_no_bit(tmp_path, tensors):
    plain = train_tiny(steps=2)
    recorded = train_tiny(replaydiff.record(tmp_path / "t", tensors=tensors, chunk_ops=64), steps=2)
    assert_bitwise_same(plain, recorded)
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete and r.lost == []
    nll = only(list(r), "aten.nll_loss_forward.default")
    if tensors == "full":
        assert torch.equal(r.tensor(nll.outputs[0]), recorded["losses"][0])


# -- 9. a guest in someone else's job ----------------------------------------------------------------------------
def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _record_catching(path, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_tiny(replaydiff.record(path, **options))
    return result, replaydiff_warnings(caught)


def test_disk_full_on_data_files_is_one_warning_and_noted(tmp_path, monkeypatch):
    plain = train_tiny()
    monkeypatch.setattr(trace_writer.safetensors, "serialize_file", _no_space)
    recorded, warned = _record_catching(tmp_path / "t", chunk_ops=16)
    assert_bitwise_same(plain, recorded)
    assert len(warned) == 1, warned
    r = open_trace(tmp_path / "t").rank(0)
    assert r.lost and any("No space left on device" in line for line in r.lost)
    # The same case as a budget: every op is recorded, none refers to data that is not there, and those that lost
    # data say why.
    ops = list(r)
    assert r.complete and len(ops) == r.manifest["ops_seen"]
    assert all(ref.chunk is None for op in ops for ref in [*op.inputs(), *op.outputs_refs()])
    assert {op.data_left_out for op in ops if op.inputs() or op.outputs_refs()} == {"disk full"}
    (left,) = r.data_left_out
    first = min(op.index for op in ops if op.inputs() or op.outputs_refs())
    assert (left.reason, left.first, left.last) == ("disk full", first, ops[-1].index) and left.nbytes > 0


def test_disk_full_on_ops_chunks_is_one_warning_and_noted(tmp_path, monkeypatch):
    plain = train_tiny()
    real = trace_writer.write_atomic

    def fail_on_chunks(path, data):
        if path.parent.name == "ops":
            _no_space()
        real(path, data)

    monkeypatch.setattr(trace_writer, "write_atomic", fail_on_chunks)
    recorded, warned = _record_catching(tmp_path / "t", chunk_ops=16)
    assert_bitwise_same(plain, recorded)
    assert len(warned) == 1, warned
    r = open_trace(tmp_path / "t").rank(0)
    assert any("No space left on device" in line and "#0" in line for line in r.lost), r.lost


def test_disk_full_from_the_start_is_one_warning(tmp_path, monkeypatch):
    plain = train_tiny()
    monkeypatch.setattr(trace_writer, "write_atomic", _no_space)
    recorded, warned = _record_catching(tmp_path / "t")
    assert_bitwise_same(plain, recorded)
    assert len(warned) == 1 and "No space left on device" in warned[0], warned


def test_final_manifest_failure_leaves_a_truncated_readable_trace(tmp_path, monkeypatch):
    plain = train_tiny()
    real = trace_writer.write_atomic
    calls = []

    def fail_second_manifest(path, data):
        if path.name == "manifest.rdt":
            calls.append(path)
            if len(calls) > 1:
                _no_space()
        real(path, data)

    monkeypatch.setattr(trace_writer, "write_atomic", fail_second_manifest)
    recorded, warned = _record_catching(tmp_path / "t", chunk_ops=64)
    assert_bitwise_same(plain, recorded)
    assert len(warned) == 1, warned
    r = open_trace(tmp_path / "t").rank(0)
    ops = list(r)
    assert not r.complete and r.truncated_after == ops[-1].index == len(ops) - 1


def test_existing_trace_turns_recording_off_with_a_warning(tmp_path, tiny_step):
    with replaydiff.record(tmp_path / "t"):
        torch.ones(3).add(1)
    manifest = (tmp_path / "t" / "rank0" / "manifest.rdt").read_bytes()
    plain = train_tiny()
    recorded, warned = _record_catching(tmp_path / "t")
    assert_bitwise_same(plain, recorded)
    assert len(warned) == 1 and "already" in warned[0], warned
    assert (tmp_path / "t" / "rank0" / "manifest.rdt").read_bytes() == manifest
    assert [o.name for o in open_trace(tmp_path / "t").rank(0)] == ["aten.ones.default", "aten.add.Tensor"]


def test_the_recorders_warnings_point_at_the_users_line_and_say_what_to_do(tmp_path):
    """A warning from the Python API is located at the user's ``with replaydiff.record(...)`` line, not at the
    recorder's line that noticed the problem; the one for a directory holding a trace says how to go on."""
    with replaydiff.record(tmp_path / "t"):
        torch.ones(3).add(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t"):
            torch.ones(3).add(1)
        with replaydiff.record(tmp_path / "p", plant="aten.add.Tensor:1:1e-3"):
            torch.ones(3).add(1)
    ours = [w for w in caught if "replaydiff" in str(w.message)]
    assert [w.filename for w in ours] == [__file__, __file__], [(w.filename, str(w.message)) for w in ours]
    existing, planted = (str(w.message) for w in ours)
    assert "already holds a trace" in existing and "pass another directory, or remove that trace" in existing
    assert "PLANTED FAULT" in planted, planted


def test_a_rank_directory_holding_other_files_is_left_alone(tmp_path):
    """The recorder writes into a rank directory only when it is new or empty: it never replaces or truncates a
    file it did not write (a user's rank0/index.rdt, say)."""
    mine = tmp_path / "t" / "rank0" / "index.rdt"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"the user's")
    plain = train_tiny()
    recorded, warned = _record_catching(tmp_path / "t")
    assert_bitwise_same(plain, recorded)
    assert len(warned) == 1 and "rank0" in warned[0] and "index.rdt" in warned[0], warned
    assert [p.name for p in mine.parent.iterdir()] == ["index.rdt"] and mine.read_bytes() == b"the user's"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_every_trace_file_follows_the_umask(tmp_path, umask, mode):
    """A trace is shared with colleagues: every file of it, its data files too (safetensors writes through a
    temporary file of its own, mode 600), follows the umask."""
    old = os.umask(umask)
    try:
        with replaydiff.record(tmp_path / "t", chunk_ops=8):
            torch.randn(4, 4).matmul(torch.randn(4, 4)).relu().sum()
    finally:
        os.umask(old)
    files = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777
             for p in (tmp_path / "t").rglob("*") if p.is_file()}
    assert any(name.endswith(".safetensors") for name in files) and any(name.endswith(".rdt") for name in files)
    assert files == dict.fromkeys(files, mode)
    dirs = {p.stat().st_mode & 0o777 for p in (tmp_path / "t").rglob("*") if p.is_dir()}
    assert dirs == {0o777 & ~umask}


def test_a_recording_that_cannot_start_leaves_no_writer_thread(tmp_path, monkeypatch):
    """The trace was opened (its writer thread started), then attaching failed: the thread must not outlive the
    recording (a thread of ours waking every 0.25 s until the job exits; gloo's teardown races with such threads)."""
    import importlib
    import threading

    recorder_module = importlib.import_module("replaydiff.record.recorder")

    def cannot_attach(rec):
        raise RuntimeError("no dispatch mode today")

    plain = train_tiny()
    monkeypatch.setattr(recorder_module, "RecordingMode", cannot_attach)
    monkeypatch.setattr(recorder_module, "CapturingMode", cannot_attach)  # record(compiled="capture")'s mode
    recorded, warned = _record_catching(tmp_path / "t")
    assert_bitwise_same(plain, recorded)
    assert len(warned) == 1 and "no dispatch mode today" in warned[0], warned
    assert [t.name for t in threading.enumerate() if t.name.startswith("replaydiff")] == []
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete and list(r) == [] and "no dispatch mode today" in r.manifest["disabled"]


# -- 10. GPU -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_cuda_step_is_recorded_whole_with_its_asynchronous_copies_landed(tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = model.example_batch("cuda")
    step = make_step(model, batch, opt)
    tok_before = model.tok.weight.detach().cpu().clone()
    with replaydiff.record(tmp_path / "t"):
        loss = step()
    torch.cuda.synchronize()
    r = open_trace(tmp_path / "t").rank(0)
    ops = list(r)
    assert r.complete and r.lost == []
    assert {"forward", "backward", "optimizer"} <= {o.phase for o in ops}
    env = r.environment
    assert env.cuda == torch.version.cuda and env.devices and env.devices[0].name
    emb = next(o for o in ops if o.name == "aten.embedding.default")
    assert emb.args[0].device.startswith("cuda")
    assert torch.equal(r.tensor(emb.args[0]), tok_before)  # asynchronous copies landed before they were written
    nll = only(ops, "aten.nll_loss_forward.default")
    assert torch.equal(r.tensor(nll.outputs[0]), loss.cpu())
    bern = [o for o in ops if o.rng is not None]
    assert bern and all(o.rng.device.startswith("cuda") for o in bern)
    assert any(o.name.startswith("aten._foreach_") or o.name.startswith("aten._fused_adam") for o in ops
               if o.phase == "optimizer")
    written_after = [p.detach().cpu() for p in model.parameters()]
    writes = [ref for o in ops if o.phase == "optimizer" for _, w in o.writes for ref in iter_refs(w)]
    for p in written_after:
        assert any(ref.shape == tuple(p.shape) and torch.equal(r.tensor(ref), p) for ref in writes)


def test_filtered_out_in_place_op_still_makes_a_new_storage_version(tmp_path):
    """An op the filters leave out still writes: the next stored op must see the bytes after that write."""
    x = torch.arange(4.0)
    with replaydiff.record(tmp_path, ops=["aten.mul.Tensor"]):
        a = x * 2          # stored: input x as it is now
        x.add_(10)         # filtered out, but it writes x
        b = x * 3          # stored: its input must be x after the add_
    reader = open_trace(tmp_path).rank(0)
    muls = [op for op in reader if op.name == "aten.mul.Tensor"]
    assert len(muls) == 2
    first_in, second_in = muls[0].args[0], muls[1].args[0]
    assert first_in.version != second_in.version
    assert torch.equal(reader.tensor(first_in), torch.arange(4.0))
    assert torch.equal(reader.tensor(second_in), torch.arange(4.0) + 10)
    report = replay_trace(str(tmp_path), ReplayOptions())
    assert report.counts()["divergent"] == 0 and report.counts()["ok"] == 2
    del a, b


def _write_behind_torchs_back(t: torch.Tensor) -> None:
    """A write the dispatcher never sees, as numpy or a C extension would make it."""
    import ctypes

    ctypes.memset(t.data_ptr(), 0, t.numel() * t.element_size())


@pytest.mark.parametrize("verify", [False, True])
def test_verify_writes_notices_writes_torch_never_saw(tmp_path, verify):
    x = torch.arange(1.0, 9.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path, verify_writes=verify):
            a = x * 2
            _write_behind_torchs_back(x)
            b = x * 3
    assert torch.equal(b, torch.zeros(8)) and torch.equal(a, torch.arange(1.0, 9.0) * 2)
    reader = open_trace(tmp_path).rank(0)
    muls = [op for op in reader if op.name == "aten.mul.Tensor"]
    report = replay_trace(str(tmp_path), ReplayOptions())
    second = next(r for r in report.ops if r.index == muls[1].index)
    notes = [str(w.message) for w in caught if "outside torch's dispatcher" in str(w.message)]
    if verify:
        # a new version holding the zeros: the op replays from what it really read
        assert muls[0].args[0].version != muls[1].args[0].version
        assert torch.equal(reader.tensor(muls[1].args[0]), torch.zeros(8))
        assert second.status is Status.OK and report.counts()["divergent"] == 0
        assert reader.manifest["unseen_writes"] == 1 and len(notes) == 1
    else:
        # the documented limit: without the check, the stale bytes are replayed and the op looks divergent
        assert muls[0].args[0].version == muls[1].args[0].version
        assert second.status is Status.DIVERGENT
        assert reader.manifest["unseen_writes"] == 0 and notes == []


def test_full_copies_wait_for_the_writer_and_every_byte_arrives(tmp_path):
    """With staging memory for 1 MiB of copies, a step storing 16 MiB (and one 2 MiB storage, copied alone) waits
    for the writer instead of holding more, and every stored tensor reads back as it was."""
    x = torch.arange(65536.0)  # 256 KiB
    big = torch.arange(float(1 << 19))  # 2 MiB: larger than the bound
    with replaydiff.record(tmp_path / "t", queue_bytes=1 << 20) as rec:
        for _ in range(64):
            x = x + 1
        y = big * 2
    staging = rec.writer.staging
    assert staging.waits > 0 and staging.peak <= big.numel() * 4
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete and r.lost == []
    adds = [op for op in r if op.name == "aten.add.Tensor"]
    assert [r.tensor(op.args[0]).tolist() for op in adds] == [(torch.arange(65536.0) + k).tolist() for k in range(64)]
    (mul,) = [op for op in r if op.name == "aten.mul.Tensor"]
    assert torch.equal(r.tensor(mul.args[0]), big) and torch.equal(r.tensor(mul.outputs), y)


def test_a_full_disk_while_copies_wait_for_room_ends_the_recording_not_the_job(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_writer.safetensors, "serialize_file", _no_space)
    x = torch.arange(65536.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t", queue_bytes=1 << 20):
            for _ in range(64):
                x = x + 1
    assert torch.equal(x, torch.arange(65536.0) + 64)
    assert len(replaydiff_warnings(caught)) == 1
    assert any("No space left on device" in line for line in open_trace(tmp_path / "t").rank(0).lost)


@pytest.mark.gpu
def test_device_memory_with_recording_stays_at_the_plain_steps_peak(tmp_path):
    """A copy to the host holds its device source only until the copy is enqueued (the caching allocator orders a
    reuse of the block after it): the device peak of a recorded step is the plain step's. The pinned host memory
    of copies in flight stays within queue_bytes, and is handed back when the recording stops. Reserved bytes, not only
    allocated ones: memory the caching allocators keep is memory the job no longer has."""
    queue_bytes = 32 << 20

    def step():
        x = torch.randn(1 << 20, device="cuda")  # 4 MiB
        for _ in range(200):
            x = x * 1.0001
        return float(x[0])

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    plain_peak, plain_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_peak_host_memory_stats()
    pinned_before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    # statistics: one tensor's finite values copied at a time (the reductions go a slice of the op's tensors at a
    # time), plus their rows; the caching allocator may carve that from one more 20 MiB segment
    extra = {"full": 0, "stats": (4 << 20) + (1 << 20)}
    for tensors in ("full", "stats"):
        torch.cuda.reset_peak_memory_stats()
        with replaydiff.record(tmp_path / tensors, tensors=tensors, queue_bytes=queue_bytes):
            step()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() <= plain_peak + extra[tensors], tensors
        assert torch.cuda.max_memory_reserved() <= plain_reserved + (extra[tensors] and 20 << 20), tensors
        host = torch.cuda.host_memory_stats()
        assert host["active_bytes.peak"] <= queue_bytes, tensors
        assert host["allocated_bytes.current"] <= pinned_before, tensors  # released at stop, cached blocks too
    r = open_trace(tmp_path / "full").rank(0)
    assert r.complete and r.lost == []
    assert sum(op.name == "aten.mul.Tensor" for op in r) == 200


def test_the_fast_argument_encoder_gives_what_encode_value_gives(tmp_path: Path) -> None:
    """OpBuilder.encode/encode_list (the recorder's hot path) must produce exactly schema.encode_value's
    form, keys in the same order, for every kind of aten argument, so traces stay byte for byte the same."""
    import msgpack

    from replaydiff.trace import schema

    base = torch.arange(12.0).reshape(3, 4)
    values = [base, base.t(), base[1:], torch.nn.Parameter(torch.ones(2)), torch.zeros(0, 3), None, True, False,
              3, -(1 << 63), (1 << 64) - 1, 1 << 70, -(1 << 64), 2.5, float("inf"), "mean", torch.float16,
              torch.device("cpu"), torch.strided, torch.channels_last, 1 + 2j, [base, [1, None, (base, 2.0)]],
              (4, 5), [], torch.Generator()]
    with replaydiff.record(tmp_path / "t", tensors="meta") as rec:
        b = rec._builder
        fast = b.encode_list(values)
        one_by_one = [b.encode(v) for v in values]
        slow = [schema.encode_value(v, lambda t: b.ref(t, True)) for v in values]
    assert msgpack.packb(fast) == msgpack.packb(slow)
    assert msgpack.packb(one_by_one) == msgpack.packb(slow)
    assert [list(x) if isinstance(x, dict) else x for x in fast[:3]] == [list(x) for x in slow[:3]]





RECORD_TWICE = """
import sys, torch, replaydiff
with replaydiff.record(sys.argv[1], tensors="meta"):
    torch.ones(3) + 1
"""


def test_a_directory_that_already_holds_a_trace_is_said_even_where_warnings_are_ignored(tmp_path):
    """Recording into a trace of an earlier run records nothing (the recorder deletes nothing): a job that ignores
    warnings (PYTHONWARNINGS=ignore, warnings.filterwarnings("ignore")) said nothing, and the earlier run's trace was
    then taken for this one's. The line now reaches stderr all the same; shown as a warning, it is said once."""
    import subprocess

    out = tmp_path / "t"

    def run(**env: str) -> str:
        done = subprocess.run([sys.executable, "-c", RECORD_TWICE, str(out)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "already holds" not in run()
    ignored = run(PYTHONWARNINGS="ignore")
    assert ignored.count("already holds a trace") == 1 and "recording is off" in ignored, ignored
    shown = run()
    assert shown.count("already holds a trace") == 1 and "RuntimeWarning" in shown, shown
