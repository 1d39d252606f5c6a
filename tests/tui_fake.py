"""A small in-memory trace implementing the read API's contract (RankTrace, OpRecord, TensorRef, TraceIndex),
for TUI tests that need exact control over ops, producers and verdicts."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class FakeStats:
    numel: int
    mean: float
    absmax: float
    l2: float
    var: float
    nan: int
    inf: int


@dataclass(eq=False)
class FakeRef:
    dtype: str
    shape: tuple
    stride: tuple | None = None
    offset: int = 0
    device: str = "cpu"
    version: int | None = None
    stored: bool = True
    uninitialised: bool = False
    requires_grad: bool = False
    stats: FakeStats | None = None
    data: Any = None

    def describe(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass
class FakeOp:
    index: int
    name: str
    phase: str | None
    module: str | None
    source: str | None
    forward_index: int | None
    args: list
    kwargs: dict
    outputs: Any
    writes: list = field(default_factory=list)
    collective: dict | None = None
    uninitialised: bool = False
    recorded: bool = True
    schema: str | None = None

    def inputs(self) -> list:
        out: list = []

        def walk(v):
            if isinstance(v, FakeRef):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)
            elif isinstance(v, dict):
                for x in v.values():
                    walk(x)
        walk(self.args)
        walk(self.kwargs)
        return out

    def outputs_refs(self) -> list:
        return [self.outputs] if isinstance(self.outputs, FakeRef) else list(self.outputs or [])


class FakeIndex:
    def __init__(self, ops: list[FakeOp]) -> None:
        self.name = [o.name for o in ops]
        self.phase = [o.phase for o in ops]
        self.module = [o.module for o in ops]
        self.source = [o.source for o in ops]
        self.forward = [o.forward_index for o in ops]
        self.output = [o.outputs_refs()[0].describe() if o.outputs_refs() else "" for o in ops]
        self.cheap = [o.name.split(".")[1] in ("view", "t", "detach", "_unsafe_view") for o in ops]
        self.recorded = [True for _ in ops]
        self.status = [None for _ in ops]

    def __len__(self) -> int:
        return len(self.name)


class FakeRankTrace:
    def __init__(self, rank: int, ops: list[FakeOp], producers: dict, tensors: dict) -> None:
        self.rank = rank
        self.ops = ops
        self.complete = True
        self.truncated_after = None
        self.environment: dict = {}
        self.lost: list = []
        self.options: dict = {}
        self.index = FakeIndex(ops)
        self._producers = producers
        self._tensors = tensors
        self._consumers: dict = {}
        for j, prods in producers.items():
            for _, p in prods.items():
                if p is not None:
                    self._consumers.setdefault(p, []).append(j)

    def __len__(self) -> int:
        return len(self.ops)

    def __getitem__(self, i: int) -> FakeOp:
        return self.ops[i]

    def tensor(self, ref: FakeRef) -> torch.Tensor:
        return ref.data

    def producers(self, i: int) -> dict:
        return dict(self._producers.get(i, {}))

    def consumers(self, i: int) -> dict:
        return {0: sorted(self._consumers[i])} if i in self._consumers else {}


class FakeTrace:
    def __init__(self, ranks: dict[int, FakeRankTrace], path: str = "fake") -> None:
        self._ranks = ranks
        self.path = Path(path)
        self.ranks = sorted(ranks)

    def rank(self, r: int) -> FakeRankTrace:
        return self._ranks[r]


def linear_chain(rank: int = 0, n_layers: int = 3) -> FakeRankTrace:
    """forward: per layer mm, view, relu; backward: per layer (reverse) threshold_backward, mm; optimizer: add_ per
    layer. Each op reads the previous op's output."""
    ops: list[FakeOp] = []
    producers: dict = {}
    tensors: dict = {}
    prev = None

    def add(name, phase, module, fwd=None, extra_in=0):
        nonlocal prev
        i = len(ops)
        t = torch.linspace(-1, 1, 12).reshape(3, 4) * (i + 1)
        out = FakeRef("float32", (3, 4), (4, 1), data=t, stats=FakeStats(12, float(t.mean()), float(t.abs().max()),
                                                                                 float(t.norm()), float(t.var()), 0, 0))
        ins = []
        prods = {}
        if prev is not None:
            ins.append(ops[prev].outputs)
            prods[0] = prev
        for k in range(extra_in):
            ins.append(FakeRef("float32", (4, 4), (4, 1), stats=None, stored=False))
            prods[len(prods)] = None
        ops.append(FakeOp(i, name, phase, module, f"model.py:{10 + i}", fwd, ins, {}, out,
                          schema=f"{name.split('.')[1]}(Tensor self) -> Tensor"))
        producers[i] = prods
        prev = i
        return i

    fwd_of = {}
    for layer in range(n_layers):
        fwd_of[layer] = add("aten.mm.default", "forward", f"Model.layers.{layer}.linear", extra_in=1)
        add("aten.view.default", "forward", f"Model.layers.{layer}.linear")
        add("aten.relu.default", "forward", f"Model.layers.{layer}.act")
    for layer in reversed(range(n_layers)):
        add("aten.threshold_backward.default", "backward", f"Model.layers.{layer}.act", fwd=fwd_of[layer] + 2)
        add("aten.mm.default", "backward", f"Model.layers.{layer}.linear", fwd=fwd_of[layer], extra_in=1)
    for layer in range(n_layers):
        add("aten.add_.Tensor", "optimizer", None)
    return FakeRankTrace(rank, ops, producers, tensors)
