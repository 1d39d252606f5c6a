"""The agreement limit of a reordered sum: how far a value the ranks of a parallel run computed may land from the
single process's, from the length of the sums that made it and the magnitude of their terms.

The model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2; Higham and Mary, "A New
Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019). A sum of n terms t_k computed
in floating point, in whatever order and grouping (one pass, blocks, one partial sum per rank then an all-reduce),
lands within gamma_(n-1) * sum|t_k| ~ n * u * sum|t_k| of the exact sum (u = eps/2, the unit roundoff). Roundings
behave as independent zero-mean errors in practice, so the error grows like sqrt(n) instead:
lambda * sqrt(n) * u * sum|t_k| holds with probability at least 1 - 2 exp(-lambda^2 / 2) per element. Two orders of the
same sum are each that close to the exact one, so they differ by at most lambda * sqrt(n) * eps * sum|t_k|.

Over a tensor, in the diff's metric (the relative L2 error, in eps of the recorded dtype):

    limit = LAMBDA * sqrt(n) * kappa * acc  +  kappa * (reads + ROUNDINGS)

- n: the number of terms of each element's sum (a matrix product's inner dimension K, the elements a sum over
  dimensions adds up);
- kappa = ||S|| / ||value||, with S the sum of |terms| element by element: the condition of the sums, 1 when no terms
  cancel, large when they do (a gradient that sums to almost nothing). For a matrix product S = |A| @ |B| and by
  Cauchy-Schwarz ||S|| <= ||A|| * ||B|| (per matrix of a batch), which costs two norms instead of a product and is
  within a factor 2/pi of ||S|| for dense random factors;
- acc = eps(accumulation type) / eps(recorded dtype): the sums of float16 and bfloat16 values accumulate in float32
  (torch's CPU and CUDA kernels do), so their reordering moves the value far less than one of their own eps;
- reads: the error already measured (rel_l2 / eps) on the values the op reads, where every one of them was measured
  upstream: terms whose factors are off by a relative delta move the sum by at most delta * S;
- ROUNDINGS = 2: the results rounded to the recorded dtype (each rank's partial sum, the additions of the all-reduce
  that sums them, the single process's result), half an eps of the terms each: 2 covers 16 such roundings taken as
  independent;
- LAMBDA = 6: Higham and Mary's theorem 3.1 gives the sqrt(n) bound with probability 1 - 2n exp(-LAMBDA^2 / 2) per
  element (1 - 3e-5 at n = 1024); it also covers the n roundings of the products and blocked or pairwise
  accumulation (whose errors are smaller still).

This bound is safe rather than tight: for terms of random signs kappa itself grows like sqrt(n), so the limit grows
like n while the error a reordering makes grows like sqrt(n) (a correct 4-rank step of the tiny transformer uses
1/500 of its counted limits). It scales with the model, which a fixed limit cannot, and stays far below the
relative 1e-2 of a 1% bug in float32 up to n*kappa ~ 1e5.

Where the terms are known: the matrix products (aten.MATMUL_PACKETS) and sums and means over dimensions. A value
partial over the ranks (summed by an all-reduce) of such an op is covered by it: the single process's sum over the
whole batch holds every term the ranks' partial sums and their all-reduce add in another order.

Where they are not (an elementwise op, a normalisation, a value from outside the step, a sum of a kind not listed,
a value read from something not measured): the limit is sqrt(eps) of the dtype, half its digits, the limit every
mapped value had before the terms were counted; or twice the error measured on what it reads, when that is larger
(an elementwise op of condition 1 carries its inputs' relative errors, a product the sum of its two factors').
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from replaydiff import aten

LAMBDA = 6.0  # see the module docstring: Higham and Mary's lambda
ROUNDINGS = 2.0  # the results' own roundings to the recorded dtype, in eps of the terms (see the module docstring)
READ_FACTOR = 2.0  # an op of unknown terms carries twice the relative error of what it reads (a product's factors)
_NARROW = (torch.float16, torch.bfloat16)  # accumulated in float32 by torch's kernels


@dataclass(frozen=True)
class Limit:
    """The rel_l2 / eps a mapped value may reach and still be the reference's, and how it was formed.

    ``terms`` and ``condition`` are the sum's n and kappa where its terms are known; None: they are not, and the
    limit is the fallback (sqrt(eps), or ``READ_FACTOR`` times ``reads``)."""

    eps: float  # the limit, in eps of the recorded dtype
    terms: int | None = None
    condition: float | None = None
    reads: float = 0.0  # the error measured upstream on what the op reads, in eps, that the limit carries
    what: str = ""  # the op's sum in words: 'a matrix product over K=256'
    acc: float = 1.0  # eps of the accumulation type over eps of the recorded dtype
    accumulates: str = ""  # the accumulation type's name where it is not the recorded dtype

    @property
    def counted(self) -> bool:
        """Whether the limit comes from the sum's terms (else it is the fallback)."""
        return self.terms is not None

    def describe(self) -> str:
        """How the limit was formed, e.g. '6*sqrt(n)*kappa + kappa*2, n=256, kappa=16: a matrix product over K=256,
        reordered', 'sqrt(eps): the terms of its sums are unknown'."""
        if self.terms is None:
            if self.reads > 0 and READ_FACTOR * self.reads >= self.eps:
                return f"{READ_FACTOR:g}x the {self.reads:.3g} eps measured on what it reads, over sqrt(eps): " \
                       f"the terms of its sums are unknown"
            return "sqrt(eps): the terms of its sums are unknown"
        acc = f"*eps({self.accumulates})/eps" if self.accumulates else ""
        read = f"{self.reads:.3g}+" if self.reads else ""
        return f"{LAMBDA:g}*sqrt(n)*kappa{acc} + kappa*{read}{ROUNDINGS:g} with n={self.terms}, " \
               f"kappa={self.condition:.3g}: {self.what}, reordered"

    def to_json(self) -> dict:
        return {"over_eps": self.eps, "terms": self.terms, "condition": self.condition, "reads_over_eps": self.reads,
                "how": self.describe()}


def sum_limit(terms: int, condition: float, dtype: torch.dtype = torch.float32, reads: float = 0.0,
              what: str = "a sum") -> Limit:
    """The limit (rel_l2 / eps of ``dtype``) of a sum of ``terms`` terms of condition ``condition`` (||sum of
    |terms||| / ||value||) whose inputs were measured ``reads`` eps off the reference's (see the module docstring)."""
    n = max(int(terms), 1)
    kappa = max(float(condition), 1.0) if math.isfinite(condition) else math.inf
    narrow = dtype in _NARROW
    acc = torch.finfo(torch.float32).eps / torch.finfo(dtype).eps if narrow else 1.0
    return Limit(LAMBDA * math.sqrt(n) * kappa * acc + kappa * (reads + ROUNDINGS), n, kappa, reads, what, acc,
                 "float32" if narrow else "")


def fallback(dtype: torch.dtype, reads: float | None = None) -> Limit:
    """The limit of a value whose sums' terms are unknown: sqrt(eps) of ``dtype`` (in eps: 1/sqrt(eps)), or
    ``READ_FACTOR`` times the error measured on what it reads when that is larger."""
    base = 1 / math.sqrt(torch.finfo(dtype).eps)
    r = reads or 0.0
    return Limit(max(base, READ_FACTOR * r), reads=r)


def counts_terms(packet: str, output: int = 0) -> bool:
    """Whether the terms of the sums an op of ``packet`` computes its output ``output`` by are known here."""
    if packet == "convolution_backward":
        return output in (1, 2)  # the weight's and the bias's gradients: sums over the batch and positions
    return output == 0 and (packet in aten.MATMUL_PACKETS or packet in aten.DIM_SUM_PACKETS)


def terms_of(packet: str, args: Sequence[Any], kwargs: dict, value: torch.Tensor,
             output: int = 0) -> tuple[int, float, str] | None:
    """(n, ||S||, words) of the sum an op of ``packet`` computes its output ``output`` (``value``) by, from its
    arguments (tensors where the op read tensors); None when the op is no sum this module knows, or its arguments
    are not as expected."""
    try:
        if packet == "convolution_backward":
            return _conv_grad_terms(args, value, output)
        if packet in aten.MATMUL_PACKETS:
            return _matmul_terms(packet, args, kwargs, value)
        if packet in aten.DIM_SUM_PACKETS:
            return _dim_sum_terms(packet, args, kwargs, value)
    except (IndexError, TypeError, ValueError, RuntimeError):  # arguments not as this op's schema has them
        return None
    return None


def condition(s_norm: float, value: torch.Tensor) -> float:
    """kappa = ||S|| / ||value|| over the value's finite elements (inf when the value is all zeros and S is not)."""
    v = value.detach().to(torch.float64)
    norm = float(torch.linalg.vector_norm(v[torch.isfinite(v)]))
    if norm > 0:
        return s_norm / norm
    return 1.0 if s_norm == 0 else math.inf


def _norm(x: torch.Tensor) -> float:
    x = x.detach().to(torch.float64)
    return float(torch.linalg.vector_norm(x[torch.isfinite(x)]))


def _matmul_terms(packet: str, args: Sequence[Any], kwargs: dict, value: torch.Tensor) -> tuple[int, float, str] | None:
    bias, beta, alpha = None, 1.0, 1.0
    if packet in aten.BIASED_MATMUL_PACKETS:
        bias, a, b = args[0], args[1], args[2]
        beta, alpha = float(kwargs.get("beta", 1.0)), float(kwargs.get("alpha", 1.0))
    elif packet == "linear":
        a, b = args[0], args[1].mT if args[1].dim() == 2 else args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
    else:
        a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() == 0 or b.dim() == 0:
        return None
    k = a.shape[-1]
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a.dim() <= 2 and b.dim() <= 2 or packet == "addbmm":
        # one product (addbmm: a sum of the batch's products, k terms each)
        if packet == "addbmm":
            s = float((torch.linalg.matrix_norm(a64) * torch.linalg.matrix_norm(b64)).sum())
            k = a.shape[0] * a.shape[-1]
        else:
            s = float(torch.linalg.vector_norm(a64)) * float(torch.linalg.vector_norm(b64))
    else:
        # a batch of products, broadcast: ||S||^2 <= sum over the batch of ||A_b||^2 ||B_b||^2
        na = torch.linalg.vector_norm(a64, dim=(-2, -1)) if a.dim() >= 2 else torch.linalg.vector_norm(a64)
        nb = torch.linalg.vector_norm(b64, dim=(-2, -1)) if b.dim() >= 2 else torch.linalg.vector_norm(b64)
        s = float(((na * nb) ** 2).sum().sqrt())
    s *= abs(alpha)
    n = int(k)
    if isinstance(bias, torch.Tensor) and beta != 0:
        # the bias is one more term of every element: its norm broadcast over the output
        s += abs(beta) * _norm(bias) * math.sqrt(value.numel() / max(bias.numel(), 1))
        n += 1
    return n, s, f"a matrix product over K={int(k)}"


def _dim_sum_terms(packet: str, args: Sequence[Any], kwargs: dict, value: torch.Tensor) -> tuple[int, float, str] | None:
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    dims = args[1] if len(args) > 1 and not isinstance(args[1], (bool, torch.dtype)) else kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    dims = list(range(x.dim())) if dims is None or len(dims) == 0 else [int(d) % max(x.dim(), 1) for d in dims]
    n = math.prod(x.shape[d] for d in dims) if x.dim() else 1
    s = x.detach().to(torch.float64).abs().nan_to_num(0.0, 0.0, 0.0)
    s = s.sum(dims) if x.dim() else s
    if packet == "mean":
        s = s / max(n, 1)
    over = ", ".join(str(d) for d in dims)
    return n, float(torch.linalg.vector_norm(s)), f"a {packet} over dim{'s' if len(dims) > 1 else ''} {over}"


def _conv_grad_terms(args: Sequence[Any], value: torch.Tensor, output: int) -> tuple[int, float, str] | None:
    """A convolution's weight gradient (output 1) or bias gradient (output 2): each element a sum over the batch and
    the output's positions (n of them) of products of the gradient and the input; ||S|| exactly, the same backward
    run in float64 on their magnitudes. A conv's bias before a normalisation has a gradient that cancels to rounding
    (its terms sum to zero): kappa is then large, and so is the limit, where sqrt(eps) of that near-zero value is
    no limit at all."""
    grad, x, w = args[0], args[1], args[2]
    if output not in (1, 2) or not all(isinstance(t, torch.Tensor) for t in (grad, x, w)) or grad.dim() < 3:
        return None
    n = int(grad.shape[0]) * math.prod(int(d) for d in grad.shape[2:])
    a = [t.detach().to(torch.float64).abs().nan_to_num(0.0, 0.0, 0.0) for t in (grad, x, w)]
    mask = [False, output == 1, output == 2]
    made = torch.ops.aten.convolution_backward(a[0], a[1], a[2], *args[3:10], mask)
    s = made[output]
    return n, float(torch.linalg.vector_norm(s)), \
        f"a convolution's {'weight' if output == 1 else 'bias'} gradient over {n} positions"


def limit_of(packet: str, args: Sequence[Any], kwargs: dict, value: torch.Tensor, reads: float | None,
             output: int = 0) -> Limit:
    """The limit of ``value``, the output an op of ``packet`` computed from ``args`` / ``kwargs``: counted from the
    terms of its sums where they are known and every value it reads was measured (``reads``: their largest error in
    eps; None: some was not), the fallback otherwise."""
    if not value.is_floating_point():
        raise ValueError("a limit in eps is for floating values; others must be exact")
    found = None if reads is None else terms_of(packet, args, kwargs, value, output)
    if found is None:
        return fallback(value.dtype, reads)
    n, s, what = found
    counted = sum_limit(n, condition(s, value), value.dtype, reads or 0.0, what)
    if packet == "convolution_backward":
        # counted only to widen: a convolution's kernel may sum in another way than one reordered sum (FFT,
        # Winograd), so its limit is never below the fallback's
        return max(counted, fallback(value.dtype, reads), key=lambda lim: lim.eps)
    return counted
