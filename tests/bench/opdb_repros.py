"""Minimal reproductions of the failure classes found by tests/opdb_sweep.py (see docs/design/opdb-triage.md).

    python tests/bench/opdb_repros.py [NAME ...]

Each repro records a few ops with replaydiff.record, replays the trace at fp64 and at same, and prints every op
that is not ok (and any warning or lost line). Nothing here is asserted: the output is what docs/design/opdb-triage.md quotes.
"""
from __future__ import annotations

import sys
import tempfile
import warnings
from typing import Optional

import torch

import replaydiff
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.trace import open_trace

REPROS = {}


def repro(fn):
    REPROS[fn.__name__] = fn
    return fn


def record_and_replay(fn, precisions=("fp64", "same"), show_all: bool = False) -> str:
    path = tempfile.mkdtemp(prefix="rd-repro-") + "/t"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(path):
            fn()
    for w in caught:
        if str(w.message).startswith("replaydiff:"):
            print("  warning:", w.message)
    for line in open_trace(path).rank(0).lost:
        print("  lost:", line)
    for prec in precisions:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = replay_trace(path, ReplayOptions(precision=prec))
        bad = [r for r in report.ops if r.status != "ok" or show_all]
        print(f"  {prec}: {len(report.ops)} ops, {sum(r.status == 'ok' for r in report.ops)} ok")
        for r in bad:
            print(f"    #{r.index} {r.op} {r.status}: {r.reason}")
    return path


@repro
def unseen_write_native_batch_norm():
    """native_batch_norm writes running_mean/var although its schema does not mark them written."""
    x, rm, rv = torch.randn(4, 3), torch.zeros(3), torch.ones(3)

    def step():
        torch.native_batch_norm(x, None, None, rm, rv, True, 0.5, 1e-5)  # updates rm, rv in place
        rm.clone()  # reads the updated running mean

    record_and_replay(step)


@repro
def unseen_write_with_verify_writes():
    """The same with record(..., verify_writes=True): the stale read is caught, the write itself is still not
    compared (native_batch_norm's running stats are not among its recorded written arguments)."""
    x, rm, rv = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    path = tempfile.mkdtemp(prefix="rd-repro-") + "/t"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(path, verify_writes=True):
            torch.native_batch_norm(x, None, None, rm, rv, True, 0.5, 1e-5)
            rm.clone()
    print("  warnings:", [str(w.message) for w in caught if str(w.message).startswith("replaydiff:")])
    for prec in ("fp64", "same"):
        report = replay_trace(path, ReplayOptions(precision=prec))
        print(f"  {prec}:", [(r.op, r.status, r.reason) for r in report.ops])


@repro
def custom_op_mutable_optional_and_lists():
    """Custom ops whose schemas mark Tensor(a!)?, Tensor(a!)[] and Tensor?(a!)[] written: handled (all ok)."""
    @torch.library.custom_op("rdrepro::opt_add_", mutates_args={"buf"})
    def opt_add_(x: torch.Tensor, buf: Optional[torch.Tensor]) -> None:
        if buf is not None:
            buf.add_(x)

    @torch.library.custom_op("rdrepro::list_add_", mutates_args={"bufs"})
    def list_add_(x: torch.Tensor, bufs: list[torch.Tensor]) -> None:
        for b in bufs:
            b.add_(x)

    @torch.library.custom_op("rdrepro::optlist_add_", mutates_args={"bufs"})
    def optlist_add_(x: torch.Tensor, bufs: list[Optional[torch.Tensor]]) -> None:
        for b in bufs:
            if b is not None:
                b.add_(x)

    x, b1, b2, b3 = torch.ones(3), torch.zeros(3), torch.zeros(3), torch.zeros(3)

    def step():
        opt_add_(x, b1)
        b1.clone()
        list_add_(x, [b2])
        b2.clone()
        optlist_add_(x, [b3, None])
        b3.clone()

    record_and_replay(step)


@repro
def conj_bit_lost():
    """A conjugate view (z.conj()) read by another op: the conj bit is not recorded, so replay reads z itself."""
    z = torch.randn(4, dtype=torch.complex64)

    def step():
        torch.mul(z.conj(), 2)

    record_and_replay(step)


@repro
def neg_bit_lost():
    """A negative view (torch._neg_view, or .imag of a conjugate view) read by another op: the neg bit is lost."""
    z = torch.randn(4, dtype=torch.complex64)
    x = torch.randn(4)

    def step():
        torch.mul(z.conj().imag, 2)
        torch.mul(torch._neg_view(x), 2)

    record_and_replay(step)


@repro
def conj_bit_fft_hfft2():
    """fft.hfft2 conjugates internally (a conj view fed to clone): divergent at fp64 and same."""
    x = torch.randn(4, 5, dtype=torch.complex64)
    record_and_replay(lambda: torch.fft.hfft2(x))


@repro
def ctc_loss_uninitialised():
    """_ctc_loss's second output (log_alpha) is only partly written; the rest is whatever memory held."""
    torch.manual_seed(0)
    log_probs = torch.randn(50, 3, 15).log_softmax(2)
    targets = torch.randint(1, 15, (3, 30), dtype=torch.long)
    input_lengths, target_lengths = [50, 40, 30], [30, 25, 20]
    record_and_replay(lambda: torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths))


@repro
def embedding_bag_shapes():
    """_embedding_bag_forward_only's auxiliary outputs have other shapes in float64 than in float32."""
    w = torch.randn(10, 3)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 4])

    def step():
        out = torch.ops.aten._embedding_bag_forward_only(w, idx, offsets, False, 0)
        print("  float32 output shapes:", [tuple(t.shape) for t in out])
        out64 = torch.ops.aten._embedding_bag_forward_only(w.double(), idx, offsets, False, 0)
        print("  float64 output shapes:", [tuple(t.shape) for t in out64])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
    psw = torch.randn(8)
    record_and_replay(lambda: torch.nn.functional.embedding_bag(idx, w, offsets, mode="sum", per_sample_weights=psw))


@repro
def complex32_same():
    """An op producing complex32 (chalf): the exact comparison at `same` has no complex32 kernel."""
    x = torch.randn(4)
    record_and_replay(lambda: x.to(torch.complex32))


@repro
def zerotensor_stops_recording():
    """Backward through an op whose derivative is an efficient zero tensor stops the recording."""
    x = torch.randn(4, requires_grad=True)
    record_and_replay(lambda: torch.sgn(x).sum().backward())


@repro
def bf16_overflow_is_divergent():
    """linalg_matrix_exp in bfloat16 overflows to Inf; the fp64 reference does not: called divergent, although
    the op run again at bfloat16 gives the same Inf (the `same` replay is ok)."""
    torch.manual_seed(0)
    a = (torch.randn(3, 3) * 12).to(torch.bfloat16)
    record_and_replay(lambda: torch.linalg.matrix_exp(a))


@repro
def sparse_layouts():
    """A sparse input is skipped as 'inputs not stored in the trace'; a sparse output passes as ok, compared with
    nothing, under the reason given to views."""
    x = torch.randn(3, 3)
    s = x.to_sparse()

    def step():
        x.to_sparse()
        torch.sparse.mm(s, x)

    record_and_replay(step, precisions=("fp64",), show_all=True)


@repro
def frozen_backend_flags():
    """After torch.backends.disable_global_flags() (what importing torch.testing._internal.common_utils does),
    replay_trace raises instead of replaying."""
    x = torch.randn(3)
    path = tempfile.mkdtemp(prefix="rd-repro-") + "/t"
    with replaydiff.record(path):
        x.exp()
    torch.backends.disable_global_flags()
    try:
        replay_trace(path, ReplayOptions(precision="fp64"))
        print("  replayed")
    except Exception as exc:
        print(f"  replay_trace raised {type(exc).__name__}: {exc}")
    finally:
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


@repro
def any_dispatch_mode_changes_svdvals():
    """torch.linalg.svdvals gives other bits under any dispatch mode (here a no-op one), so under recording too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            print("    op seen by the mode:", func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    a = torch.randn(5, 5) * 5
    plain = torch.linalg.svdvals(a)
    with NoOp():
        moded = torch.linalg.svdvals(a)
    print("  max |plain - under a no-op mode| =", float((plain - moded).abs().max()))


@repro
def lstsq_gelsy_not_deterministic():
    """torch.linalg.lstsq(driver='gelsy') differs from call to call on this CPU build (no recorder involved)."""
    torch.manual_seed(0)
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    outs = [torch.linalg.lstsq(a, b, driver="gelsy").solution for _ in range(50)]
    print("  calls differing from the first of 50:", sum(not torch.equal(o, outs[0]) for o in outs))


@repro
def torch_custom_ops_need_import():
    """torch's own Python-registered custom ops (torch_nn::, fsdp::) exist only once their module is imported:
    a replay in a fresh process skips them as 'not registered here'."""
    import subprocess

    from torch.nn import LinearCrossEntropyOptions

    import torch.distributed.fsdp  # noqa: F401  (registers the fsdp:: ops)

    inp, weight, target = torch.randn(3), torch.randn(4, 3), torch.tensor(1)
    opts = LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True)
    gathered, outs = torch.randn(4, 3), [torch.empty(2, 3), torch.empty(2, 3)]

    def step():
        torch.nn.functional.linear_cross_entropy(inp, weight, target, options=opts)
        torch.ops.fsdp.split_with_sizes_copy(gathered, [2, 2], dim=0, out=outs)

    path = record_and_replay(step, precisions=())
    code = ("import sys, torch\n"
            "from replaydiff.replay import ReplayOptions, replay_trace\n"
            "for ns, op in [('torch_nn', '_linear_cross_entropy_batch_chunked'), ('fsdp', 'split_with_sizes_copy')]:\n"
            "    known = 'registered' if hasattr(getattr(torch.ops, ns), op) else 'NOT registered'\n"
            "    print('  fresh process:', ns, op, known)\n"
            "for r in replay_trace(sys.argv[1], ReplayOptions(precision='fp64')).ops:\n"
            "    if r.status != 'ok': print(f'  fresh process replay: #{r.index} {r.op} {r.status}: {r.reason}')\n")
    print(subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True).stdout, end="")
    report = replay_trace(path, ReplayOptions(precision="fp64"))
    print("  this process (module imported): statuses", sorted({str(r.status) for r in report.ops}))


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names or REPROS:
        print(f"== {name}: {REPROS[name].__doc__.splitlines()[0]}")
        REPROS[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
