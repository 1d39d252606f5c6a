"""The agreement limit of a reordered sum (compare/reordered.py): wider for long, ill-conditioned sums than for short,
well-conditioned ones; the same sum in another order lands within it, and a 1% difference does not."""
from __future__ import annotations

import math

import torch

from replaydiff.compare.layout import rel_l2_close
from replaydiff.compare.reordered import fallback, limit_of

EPS32 = torch.finfo(torch.float32).eps


def _rel_l2_eps(x: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = x.to(torch.float64), ref.to(torch.float64)
    return float((a - b).norm() / b.norm()) / torch.finfo(ref.dtype).eps


def _sum_in_rank_order(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """The sum over dim 0 as a data-parallel run makes it: each rank's partial sum, then their sum."""
    return torch.stack([c.sum(0) for c in x.chunk(ranks)]).sum(0)


def test_a_long_ill_conditioned_sum_gets_a_wider_limit_than_a_short_well_conditioned_one():
    g = torch.Generator().manual_seed(0)
    short = torch.rand(4, 64, generator=g) + 0.5  # 4 positive terms: no cancellation
    long = torch.randn(4096, 64, generator=g)  # 4096 terms of both signs: they cancel
    ls = limit_of("sum", [short, [0]], {}, short.sum(0), reads=0.0)
    ll = limit_of("sum", [long, [0]], {}, long.sum(0), reads=0.0)
    assert ls.counted and ll.counted and ls.terms == 4 and ll.terms == 4096
    # the conditions, computed here as the definition has them: ||sum |t||| / ||sum t||
    assert math.isclose(ls.condition, 1.0, rel_tol=1e-6)  # the value is the float32 sum
    kappa = float(long.double().abs().sum(0).norm() / long.double().sum(0).norm())
    assert math.isclose(ll.condition, kappa, rel_tol=1e-5) and kappa > 10
    assert ll.eps > 100 * ls.eps
    # a short well-conditioned sum is held far tighter than the fixed sqrt(eps) every value had before
    assert ls.eps < 0.01 * fallback(torch.float32).eps
    assert math.isclose(fallback(torch.float32).eps, 1 / math.sqrt(EPS32))


def test_the_same_sum_in_another_order_fits_its_limit_and_one_percent_off_does_not():
    g = torch.Generator().manual_seed(1)
    for rows, ranks in ((8, 4), (1024, 4), (4096, 8)):
        x = torch.randn(rows, 256, generator=g)
        ref = x.sum(0)
        lim = limit_of("sum", [x, [0]], {}, ref, reads=0.0)
        close = rel_l2_close(lim.eps * EPS32)
        reordered = _sum_in_rank_order(x, ranks)
        backwards = x.flip(0).cumsum(0)[-1]  # one term after another, last row first
        for other in (reordered, backwards):
            assert _rel_l2_eps(other, ref) <= lim.eps and close(other, ref)
        assert not close(reordered * 1.01, ref)  # a 1% bug: outside the limit even of the longest sum here
        assert lim.eps * EPS32 < 2.5e-3  # a quarter of that 1%


def test_a_matrix_product_counts_its_inner_dimension_and_bounds_the_terms_from_above():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 1024, generator=g), torch.randn(1024, 32, generator=g)
    ref = a @ b
    lim = limit_of("mm", [a, b], {}, ref, reads=0.0)
    assert lim.terms == 1024
    exact = float((a.double().abs() @ b.double().abs()).norm() / ref.double().norm())
    assert exact <= lim.condition <= 2 * exact  # Cauchy-Schwarz: above ||(|A| @ |B|)||, and near it for dense factors
    split = sum(a[:, k:k + 256] @ b[k:k + 256] for k in range(0, 1024, 256))  # the inner dim split over 4 ranks
    assert _rel_l2_eps(split, ref) <= lim.eps
    assert not rel_l2_close(lim.eps * EPS32)(ref * 1.01, ref)
    # a bias is one more term; alpha scales the products
    bias = torch.randn(32, generator=g)
    lb = limit_of("addmm", [bias, a, b], {"alpha": 2.0}, torch.addmm(bias, a, b, alpha=2.0), reads=0.0)
    assert lb.terms == 1025


def test_errors_measured_upstream_widen_the_limit_and_unknown_terms_fall_back_to_sqrt_eps():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 16, generator=g)
    ref = a @ b
    clean, read = limit_of("mm", [a, b], {}, ref, reads=0.0), limit_of("mm", [a, b], {}, ref, reads=50.0)
    assert math.isclose(read.eps - clean.eps, 50.0 * clean.condition)
    # not every input measured: the terms' limit cannot be trusted, so sqrt(eps)
    unmeasured = limit_of("mm", [a, b], {}, ref, reads=None)
    assert not unmeasured.counted and unmeasured.eps == fallback(torch.float32).eps
    assert "sqrt(eps)" in unmeasured.describe() and "unknown" in unmeasured.describe()
    # an elementwise op: its terms are unknown; it carries twice a large error it reads
    gelu = limit_of("gelu", [ref], {}, torch.nn.functional.gelu(ref), reads=0.0)
    assert not gelu.counted and gelu.eps == fallback(torch.float32).eps
    wide = limit_of("gelu", [ref], {}, torch.nn.functional.gelu(ref), reads=1e4)
    assert wide.eps == 2e4 and "measured on what it reads" in wide.describe()


def test_a_bfloat16_sum_is_reordered_in_float32_and_rounded_once():
    g = torch.Generator().manual_seed(4)
    x = (torch.rand(1024, 128, generator=g) + 0.5).to(torch.bfloat16)  # positive terms: kappa 1
    ref = x.sum(0)
    lim = limit_of("sum", [x, [0]], {}, ref, reads=0.0)
    assert lim.accumulates == "float32" and lim.eps < 3  # bf16 eps: the reordering in float32 is far below one
    assert _rel_l2_eps(_sum_in_rank_order(x.float(), 4).to(torch.bfloat16), ref) <= lim.eps
    assert "eps(float32)" in lim.describe()
