"""A device runtime for tests on a machine without an accelerator (``replaydiff.device.use(FakeDevice())``).

The CPU stands in for an accelerator: its ops count as asynchronous, so the recorder takes its device paths (pinned
copies, events, statistics reduced on the device and read later). The copies are real and land at once on a CPU,
so the fake models what an accelerator's would do: the bytes of a copy into pinned memory read as garbage (0xFF)
until the event recorded after it completes, and the test decides when events complete (``hold``: never, until
``release()``). ``capturing`` stands for a stream capturing a graph. Calls are counted, so a test can assert that
nothing touched the device while it should not have.
"""
from __future__ import annotations

import threading
from collections import Counter

import torch

from replaydiff.device import DeviceFacts, Runtime


class FakeEvent:
    def __init__(self, device: "FakeDevice", on_done: list) -> None:
        self.owner = device
        self.done = False
        self.on_done = on_done  # what lands when the event completes (the pinned bytes' true values)

    def query(self) -> bool:
        self.owner._check_capture("an event was queried")
        with self.owner.lock:
            if not self.done and not self.owner.hold:
                self._complete()
            return self.done

    def _complete(self) -> None:
        for fill in self.on_done:
            fill()
        self.on_done = []
        self.done = True

    def synchronize(self) -> None:  # a real one would block the caller behind the device's queue
        raise AssertionError("the recorder blocked in an event's synchronize()")


class FakeDevice(Runtime):
    def __init__(self, hold: bool = False, processors: int = 132) -> None:
        self.hold = hold
        self.capture = False
        self.lock = threading.RLock()
        self.calls: Counter = Counter()
        self.events: list[FakeEvent] = []
        self.processors = processors
        self._landing: list = []  # pinned copies made since the last event: they land with the next event

    # the device's semantics --------------------------------------------------------------------------------------
    def asynchronous(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def in_use(self) -> bool:
        return True

    def capture_check(self):
        return lambda: self.capture

    def record_event(self, device: torch.device) -> FakeEvent:
        self.calls["record_event"] += 1
        self._check_capture("an event was recorded")
        with self.lock:
            landing, self._landing = self._landing, []
            # a pinned copy enqueued before this event: its bytes are unreadable until the event completes
            fills = []
            for host in landing:
                true = host.clone()
                host.fill_(0xFF if host.dtype == torch.uint8 else float("nan"))
                fills.append(lambda host=host, true=true: host.copy_(true))
            ev = FakeEvent(self, fills)
            self.events.append(ev)
            return ev

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.calls["pinned"] += 1
        self._check_capture("pinned memory was allocated")
        t = torch.empty(nbytes, dtype=torch.uint8)
        self._landing.append(t)
        return t

    def pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        self.calls["pinned"] += 1
        self._check_capture("pinned memory was allocated")
        host = torch.empty(t.shape, dtype=t.dtype)
        self._landing.append(host)
        return host

    def rng_state(self, device: torch.device) -> torch.Tensor | None:
        self.calls["rng_state"] += 1
        self._check_capture("a generator was read")
        return super().rng_state(device)

    def release_pinned(self) -> None:
        self.calls["release_pinned"] += 1

    def facts(self) -> list[DeviceFacts]:
        return [DeviceFacts("cuda", 0, "Fake H100", (9, 0), 80 << 30, self.processors)]

    def versions(self) -> dict:
        return {"cuda": None, "hip": "6.2.41133", "xpu": None, "nccl": "2.21.5", "driver": None}

    # the test's controls ---------------------------------------------------------------------------------------
    def release(self) -> None:
        """The device catches up: every event recorded so far completes (and events from now on at once)."""
        with self.lock:
            self.hold = False
            for ev in self.events:
                if not ev.done:
                    ev._complete()

    def _check_capture(self, what: str) -> None:
        if self.capture:
            self.calls["during_capture"] += 1
