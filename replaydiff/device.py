"""Everything that depends on the kind of device, in one place: which devices run their work asynchronously, the
events that say when it is done, whether a stream is capturing a graph, pinned host memory, a device's generator
state, and what a trace records about each device.

The recorder, the trace writer and replay call ``RUNTIME`` and nothing of ``torch.cuda``: through torch's generic
device API (``torch.accelerator``, ``torch.Event``, ``torch.get_device_module``) CUDA, ROCm, XPU, NPU and MPS are one
code path. ``RUNTIME`` is also the seam a test drives device semantics through on a machine without an
accelerator: ``use(fake)`` swaps in an object with the same methods (events whose completion the test controls, a
stream that says it is capturing). Callers read ``device.RUNTIME`` at each call, never a copy of it.

The bottom of the house (``rebuild_and_judge``, copied as the standalone repro script) cannot import this module:
it reaches a device's generator through ``torch.get_device_module`` itself.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

# Devices whose tensors live in host memory: their ops are done when they return.
HOST_TYPES = frozenset({"cpu", "meta"})
# Accelerators a trace describes (torch.get_device_module knows each; a torch without one skips it).
ACCELERATOR_TYPES = ("cuda", "xpu", "npu", "mps", "hpu", "mtia")


@dataclass(frozen=True)
class DeviceFacts:
    """One accelerator as a trace records it: what replay needs to judge a replay on another device."""

    type: str
    index: int
    name: str | None
    capability: tuple[int, ...]  # (major, minor) on CUDA and ROCm; () where the device does not say
    memory: int | None  # bytes
    processors: int | None  # streaming multiprocessors (CUDA), compute units (ROCm, XPU)


class Runtime:
    """torch's device runtime, as the project calls it. Every method is safe to call on a machine without the
    device (it answers "none" rather than raising), except those that act on a device the caller has."""

    def asynchronous(self, device: torch.device) -> bool:
        """Whether an op on ``device`` may still be running when it returns (any accelerator)."""
        return device.type not in HOST_TYPES

    def module(self, device_type: str) -> ModuleType | None:
        """``torch.cuda``, ``torch.xpu``, ...; None for a type this torch does not know."""
        try:
            return torch.get_device_module(device_type)
        except Exception:
            return None

    def available(self, device_type: str) -> bool:
        mod = self.module(device_type)
        try:
            return bool(mod is not None and mod.is_available())
        except Exception:
            return False

    def count(self, device_type: str) -> int:
        mod = self.module(device_type)
        try:
            return int(mod.device_count()) if mod is not None and self.available(device_type) else 0
        except Exception:
            return 0

    def set_device(self, device: torch.device) -> None:
        mod = self.module(device.type)
        if mod is not None and hasattr(mod, "set_device"):
            mod.set_device(device)

    def in_use(self) -> bool:
        """Whether this process has started an accelerator (what makes a graph capture possible at all)."""
        acc = _current_accelerator()
        if acc is None:
            return False
        mod = self.module(acc.type)
        try:
            return bool(mod is not None and mod.is_initialized())
        except Exception:
            return True  # cannot tell: check for a capture at each op rather than miss one

    def record_event(self, device: torch.device) -> Any:
        """An event recorded on ``device``'s current stream: it completes when the work queued there so far has."""
        event = torch.Event(device=device)
        event.record(self.current_stream(device))
        return event

    def current_stream(self, device: torch.device) -> Any:
        mod = self.module(device.type)
        own = getattr(mod, "current_stream", None)
        return own(device) if own is not None else torch.accelerator.current_stream(device)

    def capturing(self) -> bool:
        """Whether the current stream of the current accelerator is capturing a graph (CUDA graphs and the like):
        while it is, nothing may synchronise, allocate pinned memory, record an event on it or read a generator."""
        try:
            return bool(self.capture_check()())
        except Exception:
            return False

    def capture_check(self) -> Callable[[], bool]:
        """``capturing`` as the cheapest call this runtime has (the recorder asks it at every op of an accelerator
        job): the device module's own check, looked up once."""
        acc = _current_accelerator()
        mod = self.module(acc.type) if acc is not None else None
        check = getattr(mod, "is_current_stream_capturing", None)
        return check if check is not None else _never

    _pinning = True  # whether this process can pin host memory (MPS, on unified memory, has no pinned allocator)

    def pinned(self, nbytes: int) -> torch.Tensor:
        """Page-locked host bytes, the target of an asynchronous copy from a device (plain host memory where this
        device has no pinned memory: its copies then complete as torch defines for pageable memory)."""
        return self._host((nbytes,), torch.uint8)

    def pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory of ``t``'s shape and dtype."""
        return self._host(tuple(t.shape), t.dtype)

    def _host(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self._pinning:
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError:
                self._pinning = False
        return torch.empty(shape, dtype=dtype)

    def release_pinned(self) -> None:
        """Give torch's cache of page-locked host memory back to the system (it keeps every block it ever made)."""
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            with contextlib.suppress(Exception):
                empty()

    def rng_state(self, device: torch.device) -> torch.Tensor | None:
        """The state of ``device``'s default generator; None where it has none this runtime can read."""
        if device.type == "cpu":
            return torch.get_rng_state()
        mod = self.module(device.type)
        if mod is None or not hasattr(mod, "get_rng_state"):
            return None
        return mod.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            self.module(device.type).set_rng_state(state, device)  # type: ignore[union-attr]

    def facts(self) -> list[DeviceFacts]:
        """Every accelerator this process can see."""
        out = []
        for kind in ACCELERATOR_TYPES:
            mod = self.module(kind)
            for i in range(self.count(kind)):
                props = _safe(lambda mod=mod, i=i: mod.get_device_properties(i))
                cap = _safe(lambda mod=mod, i=i: tuple(mod.get_device_capability(i)), ())
                processors = getattr(props, "multi_processor_count", None)
                if processors is None:  # XPU names its compute units so
                    processors = getattr(props, "gpu_eu_count", None)
                out.append(DeviceFacts(kind, i, getattr(props, "name", None),
                                       tuple(c for c in cap if isinstance(c, int)) if isinstance(cap, tuple) else (),
                                       getattr(props, "total_memory", None),
                                       processors if isinstance(processors, int) else None))
        return out

    def versions(self) -> dict[str, Any]:
        """The runtime's versions: CUDA or HIP, NCCL (or RCCL), the driver; None each where there is none."""
        cuda = self.available("cuda")
        return {
            "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None),
            "xpu": getattr(torch.version, "xpu", None),
            "nccl": _safe(lambda: ".".join(map(str, torch.cuda.nccl.version()))) if cuda else None,
            "driver": _safe(lambda: torch._C._cuda_getDriverVersion()) if cuda else None,
        }


def _never() -> bool:
    return False


def _safe(fn: Any, default: Any = None) -> Any:
    try:
        return fn()
    except Exception:
        return default


def _current_accelerator() -> torch.device | None:
    try:
        return torch.accelerator.current_accelerator()
    except Exception:
        return None


RUNTIME: Runtime = Runtime()

# Seconds the trace writer waits for an accelerator's work before it writes the records that wait on it without
# that data: a hung kernel (an NCCL collective that never completes) must not hold back every later record, nor the
# marker of the collective entered, which the hang's diagnosis reads.
EVENT_DEADLINE = 10.0


@contextlib.contextmanager
def use(runtime: Runtime) -> Iterator[Runtime]:
    """Calls go to ``runtime`` inside the block (a test's fake device); the real one after."""
    global RUNTIME
    saved, RUNTIME = RUNTIME, runtime
    try:
        yield runtime
    finally:
        RUNTIME = saved


# While a stream captures a graph in CUDA's default ("global") mode, a query of an event from any thread invalidates
# the capture. The recorder, which sees each captured op, holds queries from its first captured op to the first op
# after the capture (``hold_queries``); waits then only sleep.
_queries_held = False


def hold_queries(held: bool) -> None:
    global _queries_held
    _queries_held = held


def queries_held() -> bool:
    return _queries_held


def wait(event: Any, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event`` to complete; whether it has. Polls ``query()`` instead of
    ``synchronize()``: a thread blocked in a synchronisation behind a hung kernel (an NCCL collective that never
    completes) could never come back to say so."""
    if not _queries_held and event.query():
        return True
    deadline = time.monotonic() + timeout
    pause = 50e-6
    while True:
        if not _queries_held and event.query():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 5e-3)


class Arrival:
    """Bytes copied from a device asynchronously: readable once ``event`` has completed."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self, timeout: float) -> bool:
        return wait(self.event, timeout)

    def abandon(self) -> None:
        """Given up on: the memory stays torch's until the copy completes (its pinned allocator waits for it)."""


def replay_device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run a replay here (None: it can)."""
    if device.type == "cpu":
        return None
    if device.type in HOST_TYPES:
        return f"device type {device.type!r} holds no values to replay on"
    rt = RUNTIME
    if not rt.available(device.type):
        return f"device {device} asked for, but this machine has no {device.type.upper()} device"
    n = rt.count(device.type)
    if device.index is not None and device.index >= n:
        return f"device {device} asked for, but only {n} {device.type.upper()} devices"
    return None
