"""The environment diff shown before any op: what differs between the two runs' snapshots, with a hint where a
difference is a known cause of numerical differences (TF32 on one side only, other CPU thread counts, another NCCL
algorithm).

Each trace's manifest carries the environment snapshot of replaydiff.record (versions, devices, numerics flags, thread
counts, NCCL_* / TORCH_* / CUDA_* ... variables, world size). Both snapshots are flattened to dotted keys and compared;
hostname and rank always differ between processes and explain nothing, so they are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_IGNORED = frozenset({"hostname", "rank"})

_TF32 = ("TF32 on one side only: float32 matmuls and convolutions on the TF32 side round their inputs to 10 mantissa "
         "bits (~1e-3 relative error)")
_HINTS: dict[str, str] = {
    "flags.cuda.matmul.allow_tf32": _TF32,
    "flags.cudnn.allow_tf32": _TF32,
    "flags.float32_matmul_precision": "another float32 matmul precision: 'high'/'medium' allow TF32 or bf16 inner "
                                      "products (~1e-3 relative error)",
    "flags.cuda.matmul.allow_bf16_reduced_precision_reduction": "reduced-precision reductions in bf16 matmuls on one "
                                                                "side only",
    "flags.cuda.matmul.allow_fp16_reduced_precision_reduction": "reduced-precision reductions in fp16 matmuls on one "
                                                                "side only",
    "flags.cudnn.benchmark": "cudnn.benchmark picks convolution kernels by timing them: the kernel (and its "
                             "summation order) can change from run to run",
    "flags.cudnn.deterministic": "deterministic cuDNN on one side only: the other may use atomics-based kernels",
    "flags.deterministic_algorithms": "deterministic algorithms on one side only: the other may run "
                                      "non-deterministic (atomicAdd) reductions",
    "num_threads": "different CPU thread counts: CPU reductions (LayerNorm and convolution backward, sums) split "
                   "the work differently and differ in the last bits",
    "variables.OMP_NUM_THREADS": "different OpenMP thread counts: CPU reductions split differently",
    "variables.MKL_NUM_THREADS": "different MKL thread counts: CPU matmuls split differently",
    "variables.NCCL_ALGO": "a different NCCL algorithm (Ring, Tree ...) sums all-reduces in another order",
    "variables.NCCL_PROTO": "a different NCCL protocol (LL, LL128, Simple) can change the all-reduce summation order",
    "world_size": "a different world size: gradients are all-reduced in another order (and the batch may be split "
                  "differently)",
    "torch": "another torch version: kernels and their dispatch can differ",
    "cuda": "another CUDA version: cuBLAS and cuDNN kernels can differ",
    "cudnn": "another cuDNN version: convolution kernels can differ",
    "nccl": "another NCCL version: collective algorithms can differ",
    "variables.CUBLAS_WORKSPACE_CONFIG": "another cuBLAS workspace configuration: deterministic cuBLAS needs "
                                         ":4096:8 or :16:8",
}
_PREFIX_HINTS = (
    ("devices.", "other GPUs: another GPU generation picks other kernels"),
    ("variables.NCCL_", "NCCL settings differ: they can change how collectives sum"),
)


@dataclass(frozen=True)
class EnvDifference:
    key: str  # dotted, e.g. "flags.cuda.matmul.allow_tf32", "variables.NCCL_ALGO", "devices.0.name"
    ref: Any  # None when the key is absent on that side
    target: Any
    hint: str | None = None

    def to_json(self) -> dict:
        return {"key": self.key, "ref": self.ref, "target": self.target, "hint": self.hint}


def _flatten(v: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(v, dict):
        for k, x in v.items():
            _flatten(x, f"{prefix}{k}.", out)
    elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        for n, x in enumerate(v):
            _flatten(x, f"{prefix}{n}.", out)
    else:
        out[prefix[:-1]] = v


def _hint(key: str) -> str | None:
    if key in _HINTS:
        return _HINTS[key]
    return next((h for p, h in _PREFIX_HINTS if key.startswith(p)), None)


def environment_diff(ref: dict, target: dict) -> list[EnvDifference]:
    """Every environment entry that differs, those with a known numerical effect (a hint) first."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    _flatten(ref, "", a)
    _flatten(target, "", b)
    diffs = [EnvDifference(k, a.get(k), b.get(k), _hint(k)) for k in sorted(set(a) | set(b))
             if k not in _IGNORED and a.get(k) != b.get(k)]
    return sorted(diffs, key=lambda d: d.hint is None)
