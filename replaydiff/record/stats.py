"""Per-tensor summary statistics: ``[numel, mean, absmax, l2, var, nan, inf]`` over a tensor's finite values.

Why it is done this way (profiled on the tiny transformer step): ``stats`` recording cost more than
``full`` because every tensor took ~8 torch calls (``_foreach_norm`` ~190 us, ``aminmax`` ~120 us, ``sum`` ~70 us
each on the shared 2-core machine): each torch CPU reduction goes through the dispatcher and wakes the intra-op
thread pool, which on a busy machine costs far more than the arithmetic. Now a CPU tensor's values are copied flat
through numpy straight from its storage (``cpu_values``: no torch op, no dispatch, no mode below the recorder sees it,
no reference kept past the op) and the statistics of a whole batch of tensors come from a few numpy calls
(``values_stats``: one concatenation, sums per segment with ``reduceat``). What remains is arithmetic on every value
the step produces. Device tensors keep the batched torch path (``batch_stats``: one transfer per op). NaN and Inf are
counted only when a sum says there are some (the common all-finite case costs nothing more).

Where the compiled kernel builds (``native/``), a CPU tensor is measured right when the recorder sees it
(``kernel_stats``: read in place, no copy, no batch): the same sums in the same order as ``values_stats``, so the
trace holds the same bytes either way; the numpy path is the fallback.
"""
from __future__ import annotations

import ctypes
import math
import threading
import time
from typing import Any

import numpy as np
import torch

from replaydiff import device as seam
from replaydiff.record import native
from replaydiff.trace.codec import address_view

# torch dtype -> the numpy dtype with the same bytes (bfloat16 has none: read as uint16 and widened by hand)
_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16,
          torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
          torch.uint8: np.uint8, torch.bool: np.bool_}


def _from_values(x: np.ndarray) -> list:
    """Statistics of a float64 array; the slow path (a mask) only when a sum says NaN or Inf are present."""
    # inf - inf in a sum is NaN by design here (it sends us to the slow path): no RuntimeWarning into the job,
    # where warnings may be errors.
    with np.errstate(all="ignore"):
        return _from_values_quiet(x)


def _from_values_quiet(x: np.ndarray) -> list:
    n = x.size
    s = float(x.sum())
    ss = float(np.dot(x, x)) if n < 4096 else float(np.square(x).sum())  # np.dot threads above ~10,000
    amax = float(np.abs(x).max())
    if math.isfinite(s) and math.isfinite(ss) and math.isfinite(amax):
        mean = s / n
        return [n, mean, amax, math.sqrt(ss), max(ss / n - mean * mean, 0.0), 0, 0]
    finite = np.isfinite(x)
    nan = int(np.isnan(x).sum())
    v = x[finite]
    m = v.size
    inf = n - m - nan
    if m == 0:
        return [n, 0.0, 0.0, 0.0, 0.0, nan, inf]
    s, ss, amax = float(v.sum()), float(np.square(v).sum()), float(np.abs(v).max())
    mean = s / m
    # The L2 norm over finite values can itself overflow float64 only for values near its range: say so as inf.
    return [n, mean, amax, math.sqrt(ss), max(ss / m - mean * mean, 0.0) if math.isfinite(ss) else math.inf,
            nan, inf]


def dense(shape: tuple | list, stride: tuple | list) -> bool:
    """Whether a view covers exactly ``numel`` consecutive elements from its offset, in some order (contiguous,
    transposed, permuted): its statistics are then those of that flat range, whatever the shape."""
    # Row-major first, without the sort: most tensors are, and this runs for every tensor of a statistics recording
    # (py-spy: the sort was ~9% of a tiny step's stats recording). Anything else, or an empty tensor, takes the sort.
    expected = 1
    for i in range(len(shape) - 1, -1, -1):
        sz = shape[i]
        if sz != 1:
            if sz == 0 or stride[i] != expected:
                break
            expected *= sz
    else:
        return True
    expected = 1
    for st, sz in sorted(zip(stride, shape)):
        if sz == 1:
            continue
        if st != expected:
            return False
        expected *= sz
    return True


def dense_numel(shape: tuple | list, stride: tuple | list) -> int:
    """The number of values ``n`` where the view is ``dense`` (one range of ``n`` consecutive elements), else
    ``-1 - n``: both facts the statistics key needs, in one call (``extension().dense_numel`` is this in C)."""
    n = math.prod(shape)
    return n if dense(shape, stride) else -1 - n


def cpu_values(t: torch.Tensor, is_dense: bool, copy: bool = True) -> np.ndarray | None:
    """A flat numpy copy of a strided CPU tensor's values, read in place (no torch op, no dispatch); None where numpy
    cannot read its dtype. A copy, so that the statistics can wait for a batch while the job writes the tensor."""
    npdt = _NUMPY.get(t.dtype)
    if npdt is None:
        return None
    n = t.numel()
    itemsize = t.element_size()
    if is_dense and copy:
        # The flat range copied by one C call into a bytes object: ~0.4 us against ~2 us for a memoryview, a numpy
        # view of it and its copy (most tensors of a step are small, and this runs for each one).
        return np.frombuffer(ctypes.string_at(t.data_ptr(), n * itemsize), dtype=npdt)
    storage = t.untyped_storage()
    buf = address_view(storage.data_ptr(), storage.nbytes())
    if is_dense:  # the flat range: no strided view to build (as_strided alone costs ~7 us)
        return np.frombuffer(buf, dtype=npdt, count=n, offset=t.storage_offset() * itemsize)
    base = np.frombuffer(buf, dtype=npdt)
    view = np.lib.stride_tricks.as_strided(base[t.storage_offset():], shape=tuple(t.shape),
                                           strides=tuple(s * itemsize for s in t.stride()), writeable=False)
    # flatten() always copies; reshape(-1) would return a view where it can (every stride 0: an expanded scalar), and
    # the batch would then read memory the job has since written or freed.
    return view.flatten()


_CHUNK = 1 << 16  # values per pass over a large tensor: float64 scratch that stays in cache
_BATCH = 1 << 20  # values of small tensors measured together
_scratch = threading.local()


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float64 scratch arrays of at least n values, reused: a fresh large array costs page faults (measured:
    astype(float64) of 262,144 floats 1.06 ms, a dot product over them 0.02 ms)."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None or bufs[0].size < n:
        bufs = _scratch.bufs = (np.empty(max(n, _CHUNK)), np.empty(max(n, _CHUNK)))
    return bufs


def values_stats(values: list[tuple[np.ndarray, bool]]) -> list[list]:
    """Statistics of many flat copies at once: ``(array, is_bfloat16)`` each.

    Small tensors are cast together into one float64 scratch array and summed per segment with ``reduceat`` (a few
    numpy calls per batch instead of ~10 per tensor); large ones are walked in cache-sized float64 chunks (sums
    accumulate in float64)."""
    with np.errstate(all="ignore"):  # NaN/Inf are expected here; no RuntimeWarning into the job
        return _values_stats(values)


def _widen(v: np.ndarray, bf16: bool) -> np.ndarray:
    if bf16:  # the high half of a float32
        return (v.astype(np.uint32) << 16).view(np.float32)
    return v


def _large_stats(v: np.ndarray) -> list:
    n = v.size
    buf, _ = _buffers(_CHUNK)
    s = ss = amax = 0.0
    for i in range(0, n, _CHUNK):
        c = v[i:i + _CHUNK]
        b = buf[:c.size]
        np.copyto(b, c, casting="unsafe")
        s += float(b.sum())
        # Not np.dot: above ~10,000 values OpenBLAS wakes its own threads, which on a busy machine costs
        # milliseconds (measured: 8 tensors of 262,144 values, median 22 ms, fastest 3 ms). Squared in place: one
        # scratch array stays in cache.
        np.multiply(b, b, out=b)
        ss += float(b.sum())
        amax = max(amax, _absmax(c))
    if not (math.isfinite(s) and math.isfinite(ss) and math.isfinite(amax)):
        return _from_values_quiet(v.astype(np.float64))  # NaN/Inf inside, or an overflowing square
    return _finish(n, s, ss, amax)


def _finish(n: int, s: float, ss: float, amax: float) -> list:
    """The statistics of n finite values from their sum, sum of squares and largest magnitude (both paths)."""
    mean = s / n
    return [n, mean, amax, math.sqrt(ss), max(ss / n - mean * mean, 0.0), 0, 0]


def _absmax(c: np.ndarray) -> float:
    """max(|c|) from the values as they are: min and max read them in their own width (no float64 pass, no abs
    written), and are exact, so the result is the float64 abs-max bit for bit (+0.0 for all zeros: abs())."""
    lo, hi = float(c.min()), float(c.max())
    return abs(max(-lo, hi))


def _values_stats(values: list[tuple[np.ndarray, bool]]) -> list[list]:
    out: list[list] = [[0, 0.0, 0.0, 0.0, 0.0, 0, 0]] * len(values)
    small: list[tuple[int, np.ndarray]] = []
    total = 0
    for i, (v, bf16) in enumerate(values):
        if v.size == 0:
            continue
        v = _widen(v, bf16)
        if v.size >= _CHUNK:
            out[i] = _large_stats(v)
            continue
        if total + v.size > _BATCH:
            _small_stats(small, total, out)
            small, total = [], 0
        small.append((i, v))
        total += v.size
    if small:
        _small_stats(small, total, out)
    return out


def _small_stats(members: list[tuple[int, np.ndarray]], total: int, out: list[list]) -> None:
    x = _buffers(total)[0][:total]
    np.concatenate([v for _, v in members], out=x, casting="unsafe")
    lengths = [v.size for _, v in members]
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    sums = np.add.reduceat(x, starts).tolist()
    # max |x| as max(-min, max): exact, and no abs written (see _absmax)
    amax = np.maximum(np.negative(np.minimum.reduceat(x, starts)), np.maximum.reduceat(x, starts))
    np.abs(amax, out=amax)  # max(-0.0, 0.0) is -0.0; abs() makes it the +0.0 abs(x).max() gives
    amax = amax.tolist()
    np.multiply(x, x, out=x)
    sqs = np.add.reduceat(x, starts).tolist()
    for k, (i, v) in enumerate(members):
        n = lengths[k]
        sm, ss, a = sums[k], sqs[k], amax[k]
        if not (math.isfinite(sm) and math.isfinite(ss) and math.isfinite(a)):
            out[i] = _from_values_quiet(v.astype(np.float64))  # NaN/Inf inside, or an overflowing square
            continue
        out[i] = _finish(n, sm, ss, a)


# torch dtype -> the kernel's code for it (native/stats.c)
_CODES = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4, torch.int32: 5,
          torch.int16: 6, torch.int8: 7, torch.uint8: 8, torch.bool: 9}


def kernel_code(dtype: torch.dtype) -> int | None:
    """The kernel's code for a dtype (native/stats.c), None for one it cannot read."""
    return _CODES.get(dtype)


_kernel: Any = None  # the loaded kernel, False where there is none in this process
# The kernel as an extension module (native/hotpath.c: measure, dense_numel), False where there is none: loaded
# with the kernel, used only where the kernel is and only where it agrees with the Python it replaces
_ext: Any = None
_local = threading.local()  # each thread's out-array: (its address, the array)


def past_storage(n: int, offset: int, itemsize: int, nbytes: int, is_dense: bool, shape: list | tuple,
                 stride: list | tuple) -> bool:
    """Whether a view of ``n`` values reads past the end of its storage of ``nbytes`` (a storage resized to 0 bytes
    under it, as FSDP frees the parameters it gathered): its values are not there to measure, and reading them would
    read memory that is not the tensor's (which could crash the job)."""
    if n == 0:
        return False
    last = offset + (n - 1 if is_dense else sum((size - 1) * st for size, st in zip(shape, stride)))
    return (last + 1) * itemsize > nbytes


def kernel_stats(t: torch.Tensor, is_dense: bool, shape: list | tuple, stride: list | tuple) -> list | None:
    """A CPU tensor's statistics, measured now and in place by the compiled kernel; None where there is no kernel
    or it cannot read the dtype (the caller takes the numpy path). The same list as ``values_stats`` gives for the
    tensor's values, bit for bit: the kernel sums in numpy's order, and NaN, Inf or an overflowing square take
    numpy's slow path here too."""
    fn = _kernel if _kernel is not None else _load_kernel()
    if fn is False:
        return None
    code = _CODES.get(t.dtype)
    if code is None:
        return None
    n = t.numel()
    if n == 0:
        return [0, 0.0, 0.0, 0.0, 0.0, 0, 0]
    try:
        out = _local.out
    except AttributeError:
        arr = (ctypes.c_double * 3)()
        out = _local.out = (ctypes.addressof(arr), arr)
    if is_dense:
        rc = fn(t.data_ptr(), code, n, 0, None, None, _CHUNK, out[0])
    else:
        nd = len(shape)
        geometry = (ctypes.c_int64 * (2 * nd))(*shape, *stride)
        at = ctypes.addressof(geometry)
        rc = fn(t.data_ptr(), code, n, nd, at, at + 8 * nd, _CHUNK, out[0])
    if rc == 0:
        return _finish(n, *out[1])
    if rc == 1:  # NaN or Inf inside, or an overflowing square: numpy's slow path, as values_stats takes it
        return values_stats([(cpu_values(t, is_dense, copy=False), t.dtype is torch.bfloat16)])[0]
    return None


def _load_kernel() -> Any:
    """Load the kernel once (building it if needed) and check it against numpy on values whose sums depend on the
    order they are added in; False, and numpy measures, where it fails or disagrees."""
    global _kernel
    fn = native.kernel()
    if fn is not None:
        _kernel = fn  # for the check's own calls
        try:
            why = None if _kernel_agrees() else "its sums differ from numpy's"
        except Exception as exc:
            why = f"its check failed ({type(exc).__name__}: {exc})"
        if why is not None:
            native.log.debug("statistics kernel not used, numpy measures: %s", why)
            fn = None
    _kernel = fn if fn is not None else False
    _load_extension()
    return _kernel


def extension() -> Any:
    """The statistics extension module (``measure``, ``dense_numel``; native/hotpath.c), or None: where the kernel
    is not used (none built, ``REPLAYDIFF_NATIVE=0``, or it disagreed with numpy) neither is the extension. Loads
    (and builds) both at the first call."""
    if _kernel is None:
        _load_kernel()
    return _ext or None if _kernel is not False else None


def _load_extension() -> None:
    """Load the extension beside a kernel that agrees with numpy, and check it gives what ``kernel_stats`` and
    ``dense_numel`` give, bit for bit; False where it cannot load or disagrees (the ctypes kernel measures)."""
    global _ext
    _ext = False
    if _kernel is False:
        return
    mod = native.extension()
    if mod is None:
        return
    try:
        why = None if _extension_agrees(mod) else "it differs from the ctypes kernel"
    except Exception as exc:
        why = f"its check failed ({type(exc).__name__}: {exc})"
    if why is not None:
        native.log.debug("statistics extension not used, the ctypes kernel measures: %s", why)
        return
    _ext = mod


def _extension_agrees(mod: Any) -> bool:
    # The kernel's own check's values (see _kernel_agrees), dense and as strided views, through the ctypes kernel
    # with _finish (what kernel_stats returns) and through the extension, compared by repr as there; and the
    # extension's dense_numel against the Python one. numpy arrays: no torch op (this may run inside one).
    i = np.arange(_CHUNK + 1000, dtype=np.float64)
    x = (1 + i / 7) * np.power(10.0, (i % 17) - 8) * (1 - 2 * (i % 2))
    m = x[:4096].reshape(64, 64)
    views = [x[:300], x[:_CHUNK - 1].astype(np.float32), x, np.full(3, -0.0), x[:0], np.array([1.0, math.inf]),
             m.T, m[:, ::3], m.reshape(4, 16, 64).transpose(2, 0, 1)[::2], m[:0, 1:], m[5:6, 7:8]]
    out = (ctypes.c_double * 3)()
    for v in views:
        code = 1 if v.dtype == np.float32 else 0
        shape, stride = tuple(v.shape), tuple(s // v.itemsize for s in v.strides)
        is_dense = dense(shape, stride)
        if mod.dense_numel(shape, stride) != dense_numel(shape, stride):
            return False
        n = v.size
        got = mod.measure(v.ctypes.data, code, n, None if is_dense else shape, None if is_dense else stride)
        if n == 0:
            want: Any = [0, 0.0, 0.0, 0.0, 0.0, 0, 0]
        else:
            nd = len(shape)
            geometry = (ctypes.c_int64 * (2 * nd))(*shape, *stride)
            at = ctypes.addressof(geometry)
            rc = _kernel(v.ctypes.data, code, n, 0 if is_dense else nd, None if is_dense else at,
                         None if is_dense else at + 8 * nd, _CHUNK, ctypes.addressof(out))
            want = _finish(n, *out) if rc == 0 else rc
        if repr(list(got) if isinstance(got, tuple) else got) != repr(want):  # a tuple of _finish's values
            return False
    return True


def _kernel_agrees() -> bool:
    # Magnitudes from 1e-8 to 1e8 with alternating signs: any other order of additions changes the last bits. The
    # lengths take both of the kernel's ways (one segment, chunks) and every branch of the pairwise sum. Compared
    # by repr (the sign of a zero counts): the kernel mirrors one numpy's order, and another numpy might sum
    # otherwise. numpy arrays, not tensors: no torch op while the recorder is inside one.
    i = np.arange(_CHUNK + 1000, dtype=np.float64)
    x = (1 + i / 7) * np.power(10.0, (i % 17) - 8) * (1 - 2 * (i % 2))
    out = (ctypes.c_double * 3)()
    zeros = np.full(3, -0.0)  # the sign of a zero sum: where numpy's sums start (-0.0, 0.0 or the first value)
    for v, code in ((x[:300], 0), (x[:_CHUNK - 1].astype(np.float32), 1), (x, 0), (zeros[:1], 0), (zeros, 0)):
        if _kernel(v.ctypes.data, code, v.size, 0, None, None, _CHUNK, ctypes.addressof(out)) not in (0, 1) or \
                repr(_finish(v.size, *out)) != repr(values_stats([(v, False)])[0]):
            return False
    return True


# Dtypes with no statistics: packed sub-byte values (no element to convert) besides complex and quantized tensors.
_PACKED = frozenset(getattr(torch, n) for n in ("float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16")
                    if hasattr(torch, n))


def has_stats(t: torch.Tensor) -> bool:
    """Whether a tensor gets statistics at all (complex, quantized and packed sub-byte tensors do not)."""
    return not (t.is_complex() or t.is_quantized or t.dtype in _PACKED)


def _reducible(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a dtype torch's float64 reductions accept: integers and bool as float64, the 1-byte floats (float8
    and its kin, which torch refuses to promote) as float32, exactly (every float8 value is a float32 value)."""
    if not x.dtype.is_floating_point:
        return x.to(torch.float64)
    if x.element_size() == 1:
        return x.to(torch.float32)
    return x


def _finite_stats(x: torch.Tensor) -> list[float]:
    """The slow path, for a tensor holding NaN or Inf: statistics over its finite values plus the counts."""
    x = x.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(x)
    v = x[finite]
    n = v.numel()
    nan = int(torch.isnan(x).sum())
    inf = int(x.numel() - n - nan)
    if n == 0:
        return [x.numel(), 0.0, 0.0, 0.0, 0.0, nan, inf]
    s, ss, amax = torch.stack([v.sum(), (v * v).sum(), v.abs().max()]).tolist()
    mean = s / n
    return [x.numel(), mean, amax, math.sqrt(ss), max(ss / n - mean * mean, 0.0), nan, inf]


def batch_stats(tensors: list[torch.Tensor], failures: list[str] | None = None) -> list[list[float] | None]:
    """One ``[numel, mean, absmax, l2, var, nan, inf]`` per tensor (over finite values); None for a tensor without
    statistics (``has_stats``) and for a group of one device and dtype that torch could not reduce, whose reason is
    appended to ``failures`` (raised where no list is given).

    For device tensors: the L2 norms come from one ``_foreach_norm`` call, min and max from one ``aminmax`` per
    tensor, the sum from one float64 reduction each, and everything reaches the host in one transfer."""
    out: list[list[float] | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if not has_stats(t):
            continue
        if t.numel() == 0:
            out[i] = [0, 0.0, 0.0, 0.0, 0.0, 0, 0]
            continue
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), idx in groups.items():
        try:
            xs = [_reducible(tensors[i].detach()) for i in idx]
            # Measured on CPU: _foreach_norm(ord=inf) is slow (280 us for ten small tensors), so the absmax comes
            # from aminmax. The norms accumulate in float64: the variance is derived from them and must not lose
            # the digits.
            parts = [torch.stack(torch._foreach_norm(xs, 2, dtype=torch.float64))]
            mins, maxs = zip(*(torch.aminmax(x) for x in xs))
            parts += [torch.stack(mins).to(torch.float64), torch.stack(maxs).to(torch.float64),
                      torch.stack([x.sum(dtype=torch.float64) for x in xs])]
            rows = torch.stack(parts).tolist()
        except Exception as exc:
            if failures is None:
                raise
            failures.append(f"{dtype}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            continue
        for k, i in enumerate(idx):
            n = tensors[i].numel()
            norm, lo, hi, s = rows[0][k], rows[1][k], rows[2][k], rows[3][k]
            if not all(map(math.isfinite, (norm, lo, hi, s))):
                out[i] = _finite_stats(tensors[i])
                continue
            mean = s / n
            out[i] = [n, mean, max(-lo, hi), norm, max(norm * norm / n - mean * mean, 0.0), 0, 0]
    return out


class DeviceStats:
    """The statistics of a batch of device tensors, computed on their device and on their way to the host: no
    synchronisation of the job's stream (a sync debug mode set to "error" stays quiet). The reductions are queued
    behind the op on the current stream, a pinned host copy after them, and an event after that; ``result()``
    waits for that event alone (the writer thread calls it before it encodes the records that hold these
    statistics), and no longer than it is told.

    The figures are ``batch_stats``' own wherever the values are all finite (the same reductions of the same values,
    bit for bit). A NaN or Inf cannot send a tensor down a slow path here (that needs its values on the host, i.e. a
    synchronisation): non-finite values are counted on the device and the sums taken over the values with them
    replaced by 0, which gives the statistics of the finite values; their last bits can differ from those of
    ``batch_stats``' compacted sums. Tensors are reduced a slice of the batch at a time (``CHUNK_BYTES`` of
    values), so the copies the reductions make (finite values, float32 views of FP8) never hold a whole group of a
    fused optimizer step or a large logits tensor at once beside the job's own memory."""

    _ROWS = 6  # L2 norm, min, max, sum (float64), NaN count, Inf count
    CHUNK_BYTES = 64 << 20

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.numel = [t.numel() for t in tensors]
        self.fixed: list[list[float] | None] = [None] * len(tensors)
        # per device: (positions measured, in the columns' order; host copy; what says the copy has landed or None)
        self.copies: list[tuple[list[int], torch.Tensor, Any]] = []
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            if not has_stats(t):
                continue
            if t.numel() == 0:
                self.fixed[i] = [0, 0.0, 0.0, 0.0, 0.0, 0, 0]
                continue
            groups.setdefault((t.device, t.dtype), []).append(i)
        blocks: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        for (device, dtype), idx in groups.items():
            for part in _slices(idx, [tensors[i].numel() * max(8, tensors[i].element_size() * 2) for i in idx],
                                self.CHUNK_BYTES):
                blocks.setdefault(device, []).append((part, _device_rows([tensors[i] for i in part], dtype, device)))
        runtime = seam.RUNTIME
        for device, got in blocks.items():  # one copy per device (an op can read tensors of two GPUs)
            rows = torch.cat([b for _, b in got], dim=1)
            asynchronous = runtime.asynchronous(device)
            host = runtime.pinned_like(rows) if asynchronous else torch.empty(rows.shape, dtype=torch.float64)
            host.copy_(rows, non_blocking=asynchronous)
            event = runtime.record_event(device) if asynchronous else None
            self.copies.append(([i for idx, _ in got for i in idx], host, event))

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the copies to land; whether they all have."""
        end = time.monotonic() + timeout
        return all(event is None or seam.wait(event, max(0.0, end - time.monotonic()))
                   for _, _, event in self.copies)

    def result(self) -> list[list[float] | None]:
        """One ``[numel, mean, absmax, l2, var, nan, inf]`` per tensor (over finite values); None for complex ones.
        Waits for the copies (``wait`` first where that must not take long)."""
        self.wait(math.inf)
        out = list(self.fixed)
        for order, host, event in self.copies:
            rows = host.tolist()
            for k, i in enumerate(order):
                n = self.numel[i]
                norm, lo, hi, s, nan, inf = (rows[r][k] for r in range(self._ROWS))
                nan, inf = int(nan), int(inf)
                m = n - nan - inf
                if m == 0:
                    out[i] = [n, 0.0, 0.0, 0.0, 0.0, nan, inf]
                    continue
                mean = s / m
                ss = norm * norm
                out[i] = [n, mean, max(-lo, hi), norm,
                          max(ss / m - mean * mean, 0.0) if math.isfinite(ss) else math.inf, nan, inf]
        return out


def _slices(idx: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """``idx`` cut into runs whose ``sizes`` add up to at most ``limit`` (a larger one alone)."""
    out: list[list[int]] = []
    run: list[int] = []
    held = 0
    for i, n in zip(idx, sizes):
        if run and held + n > limit:
            out.append(run)
            run, held = [], 0
        run.append(i)
        held += n
    if run:
        out.append(run)
    return out


def _device_rows(ts: list[torch.Tensor], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """The ``DeviceStats._ROWS`` rows of some tensors of one dtype, on their device (float64, one column each)."""
    xs = [t.detach() for t in ts]
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8: measured through float32 (exact)
        xs = [x.to(torch.float32) for x in xs]
    if dtype.is_floating_point:
        bad = [torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()]) for x in xs]
        xs = [torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in xs]
    else:
        xs = [x.to(torch.float64) for x in xs]
        bad = None
    parts = [torch.stack(torch._foreach_norm(xs, 2, dtype=torch.float64))]
    mins, maxs = zip(*(torch.aminmax(x) for x in xs))
    parts += [torch.stack(mins).to(torch.float64), torch.stack(maxs).to(torch.float64),
              torch.stack([x.sum(dtype=torch.float64) for x in xs])]
    if bad is not None:
        parts += list(torch.stack(bad).t().to(torch.float64))
    else:
        parts += [torch.zeros(len(xs), dtype=torch.float64, device=dev)] * 2
    return torch.stack(parts)
