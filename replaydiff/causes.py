"""Known causes of numerical differences between runs: one table, one entry per kind.

An entry names the recorded environment entries it concerns (``trace.schema.env_key`` names them), a one-line hint
that ``diff`` shows beside a difference in one of them, and, for the causes the health report can find evidence of in
a replayed trace, a title and a remedy. The health report registers its evidence finder per kind with
``@finds(kind)`` (as ``torch.utils.flop_counter`` registers a formula per op), so a cause, its hint and its remedy
are written once and read by both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from replaydiff.trace.schema.environment import env_key

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class KnownCause:
    kind: str
    hint: str | None = None  # beside an environment difference (diff)
    keys: tuple[str, ...] = ()  # dotted environment keys whose difference it explains
    prefixes: tuple[str, ...] = ()  # ... or keys starting with these (weaker: exact keys are looked up first)
    title: str | None = None  # heading in the health report
    remedy: str | None = None  # what to do, in the health report (``{name}`` fields filled by the finder)


CAUSES: dict[str, KnownCause] = {}
_FINDERS: dict[str, Callable] = {}


def _cause(kind: str, hint: str | None = None, env: tuple[str, ...] = (), prefixes: tuple[str, ...] = (),
           title: str | None = None, remedy: str | None = None) -> None:
    if kind in CAUSES:
        raise ValueError(f"cause {kind!r} is defined twice")
    CAUSES[kind] = KnownCause(kind, hint, tuple(env_key(e) for e in env), tuple(env_key(p) + "." if not
                              p.startswith("$") else env_key(p) for p in prefixes), title, remedy)


def finds(kind: str) -> Callable[[F], F]:
    """Register ``fn`` as the evidence finder of cause ``kind`` (one per kind)."""
    def register(fn: F) -> F:
        if kind not in CAUSES:
            raise KeyError(f"no known cause {kind!r}")
        if kind in _FINDERS:
            raise ValueError(f"cause {kind!r} already has a finder ({_FINDERS[kind].__qualname__})")
        _FINDERS[kind] = fn
        return fn
    return register


def finders() -> list[tuple[KnownCause, Callable]]:
    """The registered finders, in the table's order (the order the health report lists causes in)."""
    return [(c, _FINDERS[k]) for k, c in CAUSES.items() if k in _FINDERS]


def hint_for(key: str) -> str | None:
    """The hint for a difference in the dotted environment entry ``key``, or None if none is known."""
    for c in CAUSES.values():
        if key in c.keys:
            return c.hint
    return next((c.hint for c in CAUSES.values() for p in c.prefixes if key.startswith(p)), None)


# -- the table ------------------------------------------------------------------------------------------------------
_cause("tf32", env=("matmul_tf32", "cudnn_tf32", "fp32_precision", "matmul_fp32_precision", "cudnn_fp32_precision",
                    "cudnn_conv_fp32_precision", "cudnn_rnn_fp32_precision", "mkldnn_fp32_precision",
                    "mkldnn_matmul_fp32_precision"),
       hint="TF32 on one side only: float32 matmuls and convolutions on the TF32 side round their inputs to 10 "
            "mantissa bits (~1e-3 relative error)",
       title="TF32 matmul / convolution",
       remedy="torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False (or "
              "torch.set_float32_matmul_precision(\"highest\"); with torch's newer API, "
              "torch.backends.fp32_precision = \"ieee\") in the job, then record again")
_cause("float32_matmul_precision", env=("float32_matmul_precision",),
       hint="another float32 matmul precision: 'high'/'medium' allow TF32 or bf16 inner products (~1e-3 relative "
            "error)")
_cause("bf16_reduced_reduction", env=("matmul_bf16_reduced",),
       hint="reduced-precision reductions in bf16 matmuls on one side only")
_cause("fp16_reduced_reduction", env=("matmul_fp16_reduced",),
       hint="reduced-precision reductions in fp16 matmuls on one side only")
_cause("cudnn_benchmark", env=("cudnn_benchmark",),
       hint="cudnn.benchmark picks convolution kernels by timing them: the kernel (and its summation order) can "
            "change from run to run")
_cause("cudnn_deterministic", env=("cudnn_deterministic",),
       hint="deterministic cuDNN on one side only: the other may use atomics-based kernels")
_cause("nondeterministic_kernel", env=("deterministic_algorithms",),
       hint="deterministic algorithms on one side only: the other may run non-deterministic (atomicAdd) reductions",
       title="a non-deterministic kernel",
       remedy="torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8 in the job (an op "
              "without a deterministic kernel then raises and names itself), or replace the op (index_add_/"
              "scatter_add_ by a sort-based segment sum) where the difference matters")
_cause("threads", env=("num_threads",),
       hint="different CPU thread counts: CPU reductions (LayerNorm and convolution backward, sums) split the work "
            "differently and differ in the last bits",
       title="a result that depends on the CPU thread count",
       remedy="fix the thread count (torch.set_num_threads, OMP_NUM_THREADS) across the runs you compare; replay "
              "--precision same --threads {threads} checks bit for bit")
_cause("omp_threads", env=("$OMP_NUM_THREADS",),
       hint="different OpenMP thread counts: CPU reductions split differently")
_cause("mkl_threads", env=("$MKL_NUM_THREADS",),
       hint="different MKL thread counts: CPU matmuls split differently")
_cause("nccl_algorithm", env=("$NCCL_ALGO",),
       hint="a different NCCL algorithm (Ring, Tree ...) sums all-reduces in another order")
_cause("nccl_protocol", env=("$NCCL_PROTO",),
       hint="a different NCCL protocol (LL, LL128, Simple) can change the all-reduce summation order")
_cause("world_size", env=("world_size",),
       hint="a different world size: gradients are all-reduced in another order (and the batch may be split "
            "differently)")
_cause("torch_version", env=("torch",), hint="another torch version: kernels and their dispatch can differ")
_cause("cuda_version", env=("cuda",), hint="another CUDA version: cuBLAS and cuDNN kernels can differ")
_cause("cudnn_version", env=("cudnn",), hint="another cuDNN version: convolution kernels can differ")
_cause("cublas_workspace", env=("$CUBLAS_WORKSPACE_CONFIG",),
       hint="another cuBLAS workspace configuration: deterministic cuBLAS needs :4096:8 or :16:8")
_cause("gpu", prefixes=("devices",), hint="other GPUs: another GPU generation picks other kernels")
_cause("rounding", title="an error at the level of the dtype's rounding",
       remedy="most likely a valid but different summation order (another kernel, thread split or accumulation "
              "precision), not a bug: check bit for bit with replay --precision same on the recording backend, "
              "or widen the limit with --tolerance DTYPE=MAX,REL if such differences are expected")
_cause("nccl_version", env=("nccl",), hint="another NCCL version: collective algorithms can differ")
# A collective's disagreement across ranks and the NCCL settings: any NCCL_* variable.
_cause("collective", prefixes=("$NCCL_",),
       hint="NCCL settings differ: they can change how collectives sum",
       title="a collective that disagrees across ranks",
       remedy="check that every rank runs the same NCCL version and NCCL_* settings (NCCL_ALGO, NCCL_PROTO), run "
              "nccl-tests' all_reduce_perf on that node, and look for a faulty GPU or link on the rank named; "
              "replay --rank R alone to confirm")
