"""The environment snapshot stored in every trace: what decides which kernels ran.

Versions (CUDA or HIP), devices of every accelerator type with what replay on another one needs to know (compute
capability, multiprocessor count), numerics flags and the variables that change NCCL, cuBLAS and torch behaviour. Thread count is here
too: on CPU, LayerNorm and convolution backward reduce in a different order with 2 threads than with 1.
"""
from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any

import torch

from replaydiff import device
from replaydiff.rebuild_and_judge import tf32_settings
from replaydiff.trace.schema.environment import wire_device, wire_environment

_ENV_PREFIXES = ("NCCL_", "TORCH_", "OMP_", "MKL_", "CUDA_", "CUBLAS_", "CUDNN_", "PYTORCH_")


def _safe(fn, default: Any = None) -> Any:
    try:
        return fn()
    except Exception:
        return default


def environment_snapshot(rank: int, world_size: int) -> dict[str, Any]:
    """The snapshot as stored (trace.schema.wire_environment names the keys; RankTrace.environment reads it)."""
    runtime = device.RUNTIME
    devices = [wire_device(d.index, d.name, list(d.capability), d.memory, d.type, d.processors)
               for d in _safe(runtime.facts, [])]
    versions = _safe(runtime.versions, {})
    scalars = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "rank": rank,
        "world_size": world_size,
        "cuda": versions.get("cuda"),
        "hip": versions.get("hip"),
        "xpu": versions.get("xpu"),
        "cudnn": _safe(torch.backends.cudnn.version),
        "nccl": versions.get("nccl"),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": _safe(torch.get_num_interop_threads),
        "driver": versions.get("driver"),
    }
    # Every flag read so that it cannot raise: a snapshot that raises switches the whole recording off. TF32 through
    # whichever of torch's two APIs the job used (tf32_settings), the rest each on its own.
    flags = {  # EnvFlags attributes
        **tf32_settings(),
        "matmul_bf16_reduced": _safe(lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "matmul_fp16_reduced": _safe(lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cudnn_benchmark": _safe(lambda: torch.backends.cudnn.benchmark),
        "cudnn_deterministic": _safe(lambda: torch.backends.cudnn.deterministic),
        "deterministic_algorithms": _safe(torch.are_deterministic_algorithms_enabled),
        "deterministic_warn_only": _safe(torch.is_deterministic_algorithms_warn_only_enabled),
    }
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}
    return wire_environment(scalars, flags, variables, devices)
