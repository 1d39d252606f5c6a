"""The compiled statistics kernel (record/native) writes the numpy path's statistics bit for bit, and recording
carries on silently with numpy where it cannot be built.

Oracle: ``values_stats`` over ``cpu_values`` (the numpy path the recorder takes without the kernel); floats are
compared as their bytes, so -0.0 against 0.0 and the last bit of a sum count."""
from __future__ import annotations

import ctypes
import logging
import os
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff import open_trace
from replaydiff.record import mode as rec_mode
from replaydiff.record import native
from replaydiff.record import stats as rec_stats
from replaydiff.record.stats import cpu_values, dense, kernel_stats, values_stats

LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 136, 255, 256, 257, 1000, 8191, 8193, 65535, 65536, 65537,
           131072, 200000]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def _bytes(stats: list | None) -> bytes | None:
    return None if stats is None else struct.pack(f"<{len(stats)}d", *map(float, stats))


def _numpy_path(t: torch.Tensor) -> list:
    is_dense = dense(list(t.shape), list(t.stride()))
    return values_stats([(cpu_values(t, is_dense), t.dtype is torch.bfloat16)])[0]


def _kernel_path(t: torch.Tensor) -> list | None:
    return kernel_stats(t, dense(list(t.shape), list(t.stride())), list(t.shape), list(t.stride()))


def _assert_same(t: torch.Tensor, what: str) -> None:
    got = _kernel_path(t)
    assert got is not None, "no statistics kernel here: is there a C compiler (cc, gcc or $CC)?"
    assert _bytes(got) == _bytes(_numpy_path(t)), f"{what}: {got} != {_numpy_path(t)}"


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Magnitudes from 1e-8 to 1e8, both signs: sums whose last bits depend on the order of the additions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.pow(10.0, torch.randint(-8, 9, (n,), generator=g))
    if dtype is torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return (x * 1e3).clamp(info.min, info.max).to(dtype)
    return x.clamp(-6e4, 6e4).to(dtype) if dtype is torch.float16 else x.to(dtype)


# Each way the kernel can be built: as this processor runs it (AVX here), SSE2 alone, plain C.
VARIANTS = {"native": (), "sse2": ("REPLAYDIFF_NO_AVX",), "scalar": ("REPLAYDIFF_SCALAR",)}


@pytest.fixture(scope="module")
def variant_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(params=list(VARIANTS))
def variant(request, monkeypatch: pytest.MonkeyPatch, variant_cache: str) -> str:
    """The kernel built as ``request.param`` names (in a cache of this module's), in place of the one this process
    loaded."""
    monkeypatch.setenv("XDG_CACHE_HOME", variant_cache)
    monkeypatch.setattr(rec_stats, "_kernel", native.load(native.build(VARIANTS[request.param])))
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_numpy_on_every_length_of_a_dense_tensor(dtype: torch.dtype, variant: str) -> None:
    for n in LENGTHS:
        _assert_same(_values(n, dtype, n), f"{dtype} n={n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64], ids=str)
def test_kernel_matches_numpy_on_views(dtype: torch.dtype, variant: str) -> None:
    """Dense views in memory order (transposed, permuted), strided ones in row-major order, an expanded one."""
    for n in (24, 1000, 70000, 140000):
        t = _values(n, dtype, n + 1)
        m = t[:n - n % 8].view(8, -1)
        views = {"every other": t[::2], "every third of a transposed one": m.t()[::3],
                 "transposed (dense)": m.t(), "permuted (dense)": m.view(2, 4, -1).permute(2, 0, 1),
                 "column": m[:, 1], "expanded": t[:3].view(3, 1).expand(3, n // 3),
                 "a window of rows": m[2:5, 1:-1], "3-d strided": m.view(2, 4, -1)[:, 1:, ::3],
                 "4-d permuted and strided": m.view(2, 1, 4, -1).permute(3, 1, 2, 0)[::2, :, 1:]}
        for name, v in views.items():
            _assert_same(v, f"{dtype} n={n} {name} {tuple(v.shape)} {v.stride()}")


def test_kernel_matches_numpy_on_special_values(variant: str) -> None:
    nan, inf = float("nan"), float("inf")
    cases = {
        "-0.0 alone": torch.tensor([-0.0]),
        "-0.0 seven times": torch.full((7,), -0.0),
        "-0.0 nine times": torch.full((9,), -0.0, dtype=torch.float64),
        "-0.0 in chunks": torch.full((70000,), -0.0),
        "-0.0 and 0.0": torch.tensor([0.0, -0.0, -0.0]),
        "NaN": torch.tensor([1.0, nan, -2.0]),
        "Inf": torch.tensor([1.0, inf, -2.0] * 50),
        "-Inf in chunks": torch.cat([torch.ones(70000), torch.tensor([-inf])]),
        "Inf and -Inf": torch.tensor([inf, -inf]),
        "all NaN": torch.full((300,), nan),
        "squares overflow": torch.tensor([1e200, -3e200, 5.0], dtype=torch.float64),
        "squares overflow in chunks": torch.full((66000,), 1e160, dtype=torch.float64),
        "float16 subnormals and extremes": torch.tensor([6e-8, -6e-8, 1e-5, 65504.0, -65504.0, 0.0, -0.0],
                                                        dtype=torch.float16),
        "float16 NaN": torch.tensor([1.0, nan], dtype=torch.float16),
        "bfloat16 large and small": torch.tensor([3e38, -1e-38, 1e-40, 2.0], dtype=torch.bfloat16),
        "int64 not exact in float64": torch.tensor([2**62 + 1, -(2**63), 2**53 + 1, 3], dtype=torch.int64),
        "uint8 range": torch.arange(256, dtype=torch.int32).to(torch.uint8),
        "one float32 denormal": torch.tensor([1e-45]),
    }
    for name, t in cases.items():
        _assert_same(t, name)


def _step(seed: int = 0):
    """A step whose tensors take every way through statistics: float32, a bfloat16 and a float64 branch, integers,
    views that are not dense, tensors over one chunk (65,536 values), a NaN."""
    torch.manual_seed(seed)
    lin = torch.nn.Sequential(torch.nn.Linear(300, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    x = torch.randn(40, 300)
    x[3, 7] = float("nan")
    idx = torch.arange(40) % 5

    def step() -> None:
        h = lin(x.nan_to_num())
        side = h.t()[::2].to(torch.bfloat16).float().sum() + h[:, ::3].double().square().mean().float()
        loss = h.square().mean() + side * 1e-3 + h.index_select(0, idx).abs().mean() - (h[:, -1] == 0.0).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _op_records(path: Path) -> list[dict]:
    """Every op record of the trace as stored (the manifest differs by its times, and the split of the records into
    ops files by the writer's clock: a chunk is written after half a second on a busy machine)."""
    return [op.to_json() for op in open_trace(path).rank(0)]


def _stats_bytes(path: Path) -> list:
    out = []
    for op in open_trace(path).rank(0):
        for ref in [*op.inputs(), *op.outputs_refs()]:
            st = ref.stats
            out.append((op.index, op.name, ref.version,
                        None if st is None else _bytes([getattr(st, f) for f in st.FIELDS])))
    return out


def test_a_recording_writes_the_same_statistics_with_the_kernel_and_with_numpy(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    assert rec_stats._load_kernel() is not False, "no statistics kernel here: is there a C compiler?"
    calls = []
    kernel = rec_stats.kernel_stats
    monkeypatch.setattr(rec_mode, "kernel_stats", lambda *a: calls.append(1) or kernel(*a))
    step = _step()
    with replaydiff.record(tmp_path / "kernel", tensors="stats"):
        step()
    monkeypatch.setattr(rec_stats, "_kernel", False)  # as REPLAYDIFF_NATIVE=0 leaves it
    step = _step()
    with replaydiff.record(tmp_path / "numpy", tensors="stats"):
        step()
    assert len(calls) > 100  # the kernel measured the first recording
    with_kernel, with_numpy = _stats_bytes(tmp_path / "kernel"), _stats_bytes(tmp_path / "numpy")
    assert len(with_kernel) > 250 and with_kernel == with_numpy
    measured = [s for *_, s in with_kernel if s is not None]
    assert len(measured) > 200
    nan_counts = [struct.unpack("<7d", s)[5] for s in measured]
    assert max(nan_counts) >= 1  # the NaN took the slow path in both
    ops = _op_records(tmp_path / "kernel")
    assert ops and ops == _op_records(tmp_path / "numpy")


def _fresh_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as if it had not tried to load the kernel (nor its extension module) yet."""
    monkeypatch.setattr(native, "_loaded", [])
    monkeypatch.setattr(native, "_ext_loaded", [])
    monkeypatch.setattr(rec_stats, "_kernel", None)
    monkeypatch.setattr(rec_stats, "_ext", None)


@pytest.mark.parametrize("why", ["no compiler", "failing compiler", "REPLAYDIFF_NATIVE=0"])
def test_without_a_kernel_recording_measures_with_numpy_and_says_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, why: str) -> None:
    _fresh_kernel(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing built yet
    if why == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "nonexistent-cc"))
    elif why == "failing compiler":
        fake = tmp_path / "cc"
        fake.write_text("#!/bin/sh\necho 'fake cc 1.0'\nexit 1\n")
        fake.chmod(0o755)
        monkeypatch.setenv("CC", str(fake))
    else:
        monkeypatch.setenv("REPLAYDIFF_NATIVE", "0")
    caplog.set_level(logging.INFO, logger="replaydiff")
    step = _step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t", tensors="stats"):
            step()
    assert rec_stats._kernel is False and native.kernel() is None
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records if "kernel" in r.getMessage()] == []  # not even at INFO
    assert not list((tmp_path / "cache").rglob("*.so"))
    stats = [s for *_, s in _stats_bytes(tmp_path / "t") if s is not None]
    assert len(stats) > 200


# The loader alone (it needs only the standard library): the ranks reach the compiler together, not after torch.
_BUILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("native", sys.argv[2])
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
print(native.build())
"""


def test_ranks_building_at_once_end_with_one_good_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("CC", None)
    start = time.time() + 0.5  # all past their imports, then compiling together
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, str(start), native.__file__], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    files = [p.name for p in (tmp_path / "cache" / "replaydiff").iterdir()]
    assert files == [Path(paths.pop()).name]  # no temporary file left behind
    _fresh_kernel(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert rec_stats._load_kernel() is not False  # it loads, and agrees with numpy
    _assert_same(_values(1000, torch.float32, 3), "with the library built at once")


def test_a_kernel_whose_sums_differ_from_numpy_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The check at load: a kernel off by one rounding in the sum (another compiler's fused multiply-add, another
    numpy's order) leaves numpy measuring, with a debug line."""
    real = native.load(native.build())

    def off_by_a_bit(ptr, code, n, nd, shape, strides, chunk, out):
        rc = real(ptr, code, n, nd, shape, strides, chunk, out)
        sums = (ctypes.c_double * 3).from_address(out)
        sums[0] = sums[0] + abs(sums[0]) * 2.0 ** -52
        return rc

    _fresh_kernel(monkeypatch)
    monkeypatch.setattr(native, "_loaded", [off_by_a_bit])
    caplog.set_level(logging.DEBUG, logger="replaydiff")
    assert rec_stats._load_kernel() is False
    assert _kernel_path(_values(1000, torch.float32, 5)) is None  # the numpy path measures
    assert [r.levelno for r in caplog.records if "kernel" in r.getMessage()] == [logging.DEBUG]


PAST_STORAGE = """
import sys, torch, replaydiff
from replaydiff import open_trace
x = torch.randn(1 << 20)
v = x.view(1024, 1024)
x.untyped_storage().resize_(0)  # as FSDP frees a gathered parameter: v now reaches past its storage
with replaydiff.record(sys.argv[1], tensors="stats"):
    torch.ops.aten.detach.default(v)
op = next(op for op in open_trace(sys.argv[1]).rank(0) if op.name == "aten.detach.default")
print("STATS", op.inputs()[0].stats, op.outputs_refs()[0].stats)
"""


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_a_view_past_the_end_of_its_storage_is_not_read(tmp_path: Path, native_on: str) -> None:
    """A view whose storage was resized to 0 bytes under it (FSDP frees its gathered parameters so) is recorded
    without statistics: its values are not in its storage, and the kernel read the memory after it (the job died of
    a segmentation fault)."""
    env = dict(os.environ, REPLAYDIFF_NATIVE=native_on)
    done = subprocess.run([sys.executable, "-c", PAST_STORAGE, str(tmp_path / "t")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "STATS None None" in done.stdout, done.stdout


# -- the kernel as an extension module (native/hotpath.c): what a statistics recording calls where it builds ------
def _extension():
    ext = rec_stats.extension()
    assert ext is not None, "no statistics extension here: is there a C compiler and Python.h?"
    return ext


def _extension_path(t: torch.Tensor) -> list | None:
    """What the recorder's statistics path gives with the extension (OpBuilder._new_stats)."""
    ext = _extension()
    shape, stride = tuple(t.shape), t.stride()
    n = ext.dense_numel(shape, stride)
    is_dense = n >= 0
    n = n if is_dense else -1 - n
    assert n == t.numel() and is_dense == dense(shape, stride)
    got = ext.measure(t.data_ptr(), rec_stats.kernel_code(t.dtype), n, None if is_dense else shape,
                      None if is_dense else stride)
    if got == 1:
        return _numpy_path(t)
    return got


def test_the_extension_writes_the_numpy_paths_statistics_on_every_length_view_and_special_value() -> None:
    cases = {f"{dtype} n={n}": _values(n, dtype, n) for dtype in DTYPES for n in LENGTHS}
    for n in (24, 1000, 70000):
        t = _values(n, torch.float32, n + 1)
        m = t[:n - n % 8].view(8, -1)
        cases.update({f"n={n} every other": t[::2], f"n={n} transposed": m.t(), f"n={n} column": m[:, 1],
                      f"n={n} expanded": t[:3].view(3, 1).expand(3, n // 3), f"n={n} window": m[2:5, 1:-1],
                      f"n={n} 4-d": m.view(2, 1, 4, -1).permute(3, 1, 2, 0)[::2, :, 1:],
                      f"n={n} empty view": m[:, :0]})
    nan, inf = float("nan"), float("inf")
    cases.update({"-0.0 and 0.0": torch.tensor([0.0, -0.0, -0.0]), "NaN": torch.tensor([1.0, nan, -2.0]),
                  "Inf in chunks": torch.cat([torch.ones(70000), torch.tensor([-inf])]),
                  "squares overflow": torch.tensor([1e200, -3e200, 5.0], dtype=torch.float64),
                  "empty": torch.empty(0), "a scalar": torch.tensor(3.5)})
    for name, t in cases.items():
        got, want = _extension_path(t), _numpy_path(t) if t.numel() else [0, 0.0, 0.0, 0.0, 0.0, 0, 0]
        assert _bytes(got) == _bytes(want), f"{name}: {got} != {want}"
        assert [type(v) for v in got] == [type(v) for v in want], name  # ints stay ints in the record


@pytest.mark.parametrize("shape,stride", [((), ()), ((0,), (1,)), ((2, 0), (1, 1)), ((3, 1, 4), (4, 99, 1)),
                                          ((4, 3), (1, 4)), ((4, 3), (1, 5)), ((2, 3, 4), (1, 2, 6)),
                                          ((2, 3, 4), (12, 1, 3)), ((5, 5), (0, 1)), ((1, 1), (7, 9)),
                                          ((3, 2, 2), (4, 2, 1)), ((2, 2), (2, 2)), ((6,), (2,))])
def test_the_extensions_dense_numel_is_the_python_one(shape: tuple, stride: tuple) -> None:
    assert _extension().dense_numel(shape, stride) == rec_stats.dense_numel(shape, stride)


def test_a_statistics_recording_with_the_extension_writes_what_numpy_writes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _extension()
    step = _step()
    with replaydiff.record(tmp_path / "ext", tensors="stats") as rec:
        assert rec.builder._measure is not None  # the extension measured
        step()
    monkeypatch.setattr(rec_stats, "_kernel", False)  # as REPLAYDIFF_NATIVE=0 leaves it: no extension either
    step = _step()
    with replaydiff.record(tmp_path / "numpy", tensors="stats") as rec:
        assert rec.builder._measure is None
        step()
    with_ext, with_numpy = _stats_bytes(tmp_path / "ext"), _stats_bytes(tmp_path / "numpy")
    assert len(with_ext) > 250 and with_ext == with_numpy
    assert max(struct.unpack("<7d", s)[5] for *_, s in with_ext if s is not None) >= 1  # the NaN's slow path
    ops = _op_records(tmp_path / "ext")
    assert ops and ops == _op_records(tmp_path / "numpy")


def test_an_extension_that_differs_from_the_kernel_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The check at load: an extension whose statistics differ from the ctypes kernel's by one rounding (its mean
    computed another way) leaves the ctypes kernel measuring, with a debug line."""
    real = native.load_extension(native.build_extension())

    class OffByABit:
        dense_numel = staticmethod(real.dense_numel)

        @staticmethod
        def measure(*args):
            got = real.measure(*args)
            if isinstance(got, tuple) and got[0]:
                got = (got[0], got[1] + abs(got[1]) * 2.0 ** -52, *got[2:])
            return got

    _fresh_kernel(monkeypatch)
    monkeypatch.setattr(native, "_ext_loaded", [OffByABit])
    caplog.set_level(logging.DEBUG, logger="replaydiff")
    assert rec_stats._load_kernel() is not False  # the ctypes kernel agrees and measures
    assert rec_stats.extension() is None
    assert [r.levelno for r in caplog.records if "extension" in r.getMessage()] == [logging.DEBUG]
