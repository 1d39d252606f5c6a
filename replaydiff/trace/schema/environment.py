"""The environment snapshot of a manifest (record/environment.py writes it through ``wire_environment`` and
``wire_device``), typed once at open.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from replaydiff.trace.schema.keys import _mapping, _typed

# Environment keys (record/environment.py builds the snapshot through wire_environment and wire_device).
_E_FLAGS, _E_VARIABLES, _E_DEVICES = "flags", "variables", "devices"
_E_SCALARS = ("torch", "python", "platform", "hostname", "rank", "world_size", "cuda", "cudnn", "nccl",
              "num_threads", "num_interop_threads", "driver", "hip", "xpu")
_D_INDEX, _D_NAME, _D_CAPABILITY, _D_MEMORY = "index", "name", "capability", "memory"
_D_TYPE, _D_PROCESSORS = "type", "processors"
# The numerics flags: attribute of EnvFlags -> its key under "flags" (the torch setting it reads).
_FLAG_KEYS = {
    "matmul_tf32": "cuda.matmul.allow_tf32",
    "matmul_bf16_reduced": "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "matmul_fp16_reduced": "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cudnn_tf32": "cudnn.allow_tf32",
    "cudnn_benchmark": "cudnn.benchmark",
    "cudnn_deterministic": "cudnn.deterministic",
    "deterministic_algorithms": "deterministic_algorithms",
    "deterministic_warn_only": "deterministic_warn_only",
    "float32_matmul_precision": "float32_matmul_precision",
    # torch's newer per-backend TF32 API (torch.backends.fp32_precision and below: "ieee", "tf32", "none"); the
    # legacy flags above are read through it where the job set it (torch refuses their legacy getters then).
    "fp32_precision": "fp32_precision",
    "matmul_fp32_precision": "cuda.matmul.fp32_precision",
    "cudnn_fp32_precision": "cudnn.fp32_precision",
    "cudnn_conv_fp32_precision": "cudnn.conv.fp32_precision",
    "cudnn_rnn_fp32_precision": "cudnn.rnn.fp32_precision",
    "mkldnn_fp32_precision": "mkldnn.fp32_precision",
    "mkldnn_matmul_fp32_precision": "mkldnn.matmul.fp32_precision",
}
_STRING_FLAGS = {"float32_matmul_precision", "fp32_precision", "matmul_fp32_precision", "cudnn_fp32_precision",
                 "cudnn_conv_fp32_precision", "cudnn_rnn_fp32_precision", "mkldnn_fp32_precision",
                 "mkldnn_matmul_fp32_precision"}



def flatten_keys(v: Any, prefix: str = "") -> dict[str, Any]:
    """A nested manifest entry as dotted keys ("flags.cudnn.allow_tf32", "devices.0.name"): what a diff compares."""
    out: dict[str, Any] = {}

    def walk(x: Any, p: str) -> None:
        if isinstance(x, dict):
            for k, y in x.items():
                walk(y, f"{p}{k}.")
        elif isinstance(x, list) and x and all(isinstance(y, dict) for y in x):
            for n, y in enumerate(x):
                walk(y, f"{p}{n}.")
        else:
            out[p[:-1]] = x

    walk(v, prefix)
    return out


def env_key(name: str) -> str:
    """The dotted key of an environment entry as ``Environment.flat()`` names it: an EnvFlags attribute
    ("matmul_tf32" -> "flags.cuda.matmul.allow_tf32"), a variable ("$NCCL_ALGO" -> "variables.NCCL_ALGO"), the
    devices ("devices" -> "devices", a prefix) or a top-level entry ("num_threads")."""
    if name in _FLAG_KEYS:
        return f"{_E_FLAGS}.{_FLAG_KEYS[name]}"
    if name.startswith("$"):
        return f"{_E_VARIABLES}.{name[1:]}"
    if name in _E_SCALARS or name == _E_DEVICES:
        return name
    raise KeyError(f"no environment entry {name!r}")


@dataclass(frozen=True)
class EnvFlags:
    """The numerics flags the job ran with; None where the trace does not say (an older recorder)."""
    matmul_tf32: bool | None = None
    matmul_bf16_reduced: bool | None = None
    matmul_fp16_reduced: bool | None = None
    cudnn_tf32: bool | None = None
    cudnn_benchmark: bool | None = None
    cudnn_deterministic: bool | None = None
    deterministic_algorithms: bool | None = None
    deterministic_warn_only: bool | None = None
    float32_matmul_precision: str | None = None
    fp32_precision: str | None = None
    matmul_fp32_precision: str | None = None
    cudnn_fp32_precision: str | None = None
    cudnn_conv_fp32_precision: str | None = None
    cudnn_rnn_fp32_precision: str | None = None
    mkldnn_fp32_precision: str | None = None
    mkldnn_matmul_fp32_precision: str | None = None
    recorded: tuple[tuple[str, Any], ...] = ()  # every flag as recorded (torch's name, value), for display

    @classmethod
    def from_wire(cls, d: Any) -> "EnvFlags":
        d = _mapping(d)
        typed = {a: _typed(d.get(k), str if a in _STRING_FLAGS else bool) for a, k in _FLAG_KEYS.items()}
        return cls(**typed, recorded=tuple((str(k), v) for k, v in d.items()))


@dataclass(frozen=True)
class Device:
    """One accelerator the recording process could see."""
    index: int | None
    name: str | None
    capability: tuple[int, ...]  # () when unknown
    memory: int | None
    type: str = "cuda"  # traces from before other accelerators were recorded listed CUDA devices only
    # Streaming multiprocessors (compute units): how many decides how some random kernels number their elements
    processors: int | None = None

    @classmethod
    def from_wire(cls, d: Any) -> "Device":
        d = _mapping(d)
        cap = d.get(_D_CAPABILITY)
        return cls(_typed(d.get(_D_INDEX), int), _typed(d.get(_D_NAME), str),
                   tuple(c for c in cap if isinstance(c, int)) if isinstance(cap, list) else (),
                   _typed(d.get(_D_MEMORY), int), _typed(d.get(_D_TYPE), str) or "cuda",
                   _typed(d.get(_D_PROCESSORS), int))

    @property
    def label(self) -> str:
        """``cuda:0``: the device as torch names it."""
        return f"{self.type}:{self.index}" if self.index is not None else self.type


@dataclass(frozen=True)
class Environment:
    """The environment snapshot of one rank (record/environment.py); every entry None when the trace lacks it."""
    torch: str | None = None
    python: str | None = None
    platform: str | None = None
    hostname: str | None = None
    rank: int | None = None
    world_size: int | None = None
    cuda: str | None = None
    cudnn: int | None = None
    nccl: str | None = None
    num_threads: int | None = None
    num_interop_threads: int | None = None
    driver: int | None = None
    hip: str | None = None  # ROCm: torch.version.hip (the cuda entry is None there)
    xpu: str | None = None
    devices: tuple[Device, ...] = ()
    flags: EnvFlags = field(default_factory=EnvFlags)
    variables: dict[str, str] = field(default_factory=dict)  # NCCL_*, TORCH_*, OMP_* ... as recorded
    wire: dict = field(default_factory=dict, repr=False, compare=False)  # the snapshot as stored

    @classmethod
    def from_wire(cls, d: Any) -> "Environment":
        d = _mapping(d)
        kinds = {"rank": int, "world_size": int, "cudnn": int, "num_threads": int, "num_interop_threads": int,
                 "driver": int}
        scalars = {k: _typed(d.get(k), kinds.get(k, str)) for k in _E_SCALARS}
        devices = d.get(_E_DEVICES)
        return cls(**scalars, devices=tuple(Device.from_wire(x) for x in devices) if isinstance(devices, list) else (),
                   flags=EnvFlags.from_wire(d.get(_E_FLAGS)),
                   variables={str(k): str(v) for k, v in _mapping(d.get(_E_VARIABLES)).items()}, wire=d)

    def flat(self) -> dict[str, Any]:
        """The snapshot as dotted keys (see ``env_key``), as stored: what ``diff`` compares."""
        return flatten_keys(self.wire)

    def to_json(self) -> dict:
        return self.wire


def wire_device(index: int, name: Any, capability: list, memory: Any, type: str = "cuda",
                processors: int | None = None) -> dict:
    return {_D_INDEX: index, _D_NAME: name, _D_CAPABILITY: capability, _D_MEMORY: memory, _D_TYPE: type,
            _D_PROCESSORS: processors}


def wire_environment(scalars: dict[str, Any], flags: dict[str, Any], variables: dict[str, str],
                     devices: list[dict]) -> dict:
    """The snapshot as stored: ``scalars`` keyed by Environment attribute (torch, num_threads ...), ``flags`` by EnvFlags attribute."""
    unknown = set(scalars) - set(_E_SCALARS) or set(flags) - set(_FLAG_KEYS)
    if unknown:
        raise KeyError(f"not environment entries: {sorted(unknown)}")
    out = {k: scalars.get(k) for k in _E_SCALARS if k != "driver"}
    out[_E_DEVICES] = devices
    out["driver"] = scalars.get("driver")
    out[_E_FLAGS] = {_FLAG_KEYS[a]: v for a, v in flags.items()}
    out[_E_VARIABLES] = variables
    return out
