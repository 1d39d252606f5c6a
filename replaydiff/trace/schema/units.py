"""Compiled units (record/unit_capture.py): one call of a compiled graph, its graph stored as data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from replaydiff.trace.schema.keys import _UNIT, _typed
from replaydiff.trace.schema.values import MAX_DEPTH, decode_value, encode_value

# Node kinds; a graph is a list of nodes in execution order, each argument a value tree whose {"node": i} markers
# refer to earlier nodes. Targets are names (``aten.mul.Tensor``, ``operator.getitem``): never code.
NODE_INPUT, NODE_CONST, NODE_CALL, NODE_OUTPUT = "input", "const", "call", "output"
_U_REGION, _U_BACKEND, _U_GRAPH, _U_KIND, _U_NODES, _U_CONSTS, _U_KERNELS, _U_NOTE = (
    "region", "backend", "graph", "kind", "nodes", "consts", "kernels", "note")
_NODE_REF = "node"


class NodeRef(NamedTuple):
    """An argument of a graph node that is the value of an earlier node (by position in the graph)."""

    index: int


@dataclass(frozen=True)
class UnitNode:
    kind: str  # input / const / call / output
    name: str  # the node's name in the graph (``erf``, ``mul_1``)
    target: str | None  # op name of a call (``aten.erf.default``); const: its position in the unit's consts
    args: list
    kwargs: dict
    module: str | None = None  # the module it was traced in, under the region's root: ``Sequential.1 (GELU)``

    def describe(self) -> str:
        return f"{self.name} ({self.target})" if self.kind == NODE_CALL else self.name


@dataclass(frozen=True)
class UnitInfo:
    """What a compiled unit record holds beside its inputs and outputs."""

    region: str | None  # ``Net.forward (model.py:12)``
    backend: str | None  # inductor / aot_eager ...
    graph_id: str | None  # one compiled graph (every call of it shares the id)
    kind: str | None  # forward / backward / inference
    nodes: tuple[UnitNode, ...]
    consts: list  # TensorRefs (and scalars) the graph reads as attributes
    kernels: tuple[str, ...] = ()  # the backend's kernel names, when it gives them
    note: str | None = None  # why the graph is not stored, when it is not

    @classmethod
    def from_wire(cls, d: dict) -> "UnitInfo":
        nodes = tuple(UnitNode(str(n[0]), str(n[1]), n[2], _decode_graph_value(n[3]),
                               {str(k): _decode_graph_value(v) for k, v in (n[4] or {}).items()},
                               n[5] if len(n) > 5 else None) for n in d.get(_U_NODES) or [])
        return cls(_typed(d.get(_U_REGION), str), _typed(d.get(_U_BACKEND), str), _typed(d.get(_U_GRAPH), str),
                   _typed(d.get(_U_KIND), str), nodes, decode_value(d.get(_U_CONSTS) or []),
                   tuple(str(k) for k in d.get(_U_KERNELS) or []), _typed(d.get(_U_NOTE), str))

    def calls(self) -> list[UnitNode]:
        return [n for n in self.nodes if n.kind == NODE_CALL]

    def to_json(self) -> dict:
        return {"region": self.region, "backend": self.backend, "graph": self.graph_id, "kind": self.kind,
                "nodes": [{"kind": n.kind, "name": n.name, "target": n.target, "module": n.module}
                          for n in self.nodes], "kernels": list(self.kernels), "note": self.note}


def _decode_graph_value(v: Any, depth: int = 0) -> Any:
    if isinstance(v, list):
        if depth >= MAX_DEPTH:
            raise ValueError(f"a value nested more than {MAX_DEPTH} deep")
        return [_decode_graph_value(x, depth + 1) for x in v]
    if isinstance(v, dict) and len(v) == 1 and _NODE_REF in v:
        return NodeRef(int(v[_NODE_REF]))
    return decode_value(v, depth)


def encode_graph_value(v: Any, node_index: Callable[[Any], int | None], tensor_ref: Callable[[torch.Tensor], dict]
                       ) -> Any:
    """A graph node's argument tree: nodes (``node_index`` gives their position, None for a non-node) become
    {"node": i}; everything else as ``encode_value``."""
    if isinstance(v, (list, tuple)):
        return [encode_graph_value(x, node_index, tensor_ref) for x in v]
    i = node_index(v)
    if i is not None:
        return {_NODE_REF: i}
    return encode_value(v, tensor_ref)


def wire_node(kind: str, name: str, target: Any, args: Any, kwargs: dict, module: str | None) -> list:
    return [kind, name, target, args, kwargs, module]


def wire_set_unit(rec: dict, region: str | None, backend: str | None, graph_id: str | None, kind: str | None,
                  nodes: list | None, consts: list, kernels: list[str], note: str | None = None) -> None:
    rec[_UNIT] = {_U_REGION: region, _U_BACKEND: backend, _U_GRAPH: graph_id, _U_KIND: kind,
                  _U_NODES: nodes or [], _U_CONSTS: consts, _U_KERNELS: kernels, _U_NOTE: note}
