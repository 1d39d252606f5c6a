"""replaydiff.compare.layout: which layout maps the ranks' tensors onto the single-process reference.

The ranks' tensors are made from a reference the way a parallel step makes them (a batch split, a per-rank mean, a
sum to be all-reduced), then the layout is found back without being told. And a value no layout explains (a shard
at the wrong offset, a sum whose parts were not all reduced) is found to be none.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replaydiff.compare.layout import (Layout, LayoutKind, candidates, infer_layout, infer_layouts, infer_mesh_layouts,
                                       rel_l2_close)

CLOSE = rel_l2_close(1e-6)


def _split(ref: torch.Tensor, dim: int, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(ref, sizes, dim=dim))


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 8), rows=st.integers(1, 12), cols=st.integers(2, 5), seed=st.integers(0, 2**16),
       dim=st.integers(0, 1), data=st.data())
def test_a_value_split_along_a_dimension_is_found_sharded_there(world, rows, cols, seed, dim, data):
    ref = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    n = ref.shape[dim]
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    if any(s == n for s in sizes):  # one rank holding all of it is a replicated shape, not a split
        return
    got = infer_layout(ref, _split(ref, dim, sizes), CLOSE)
    assert got is not None and got.kind is LayoutKind.SHARDED
    assert got.dim == dim and got.sizes == tuple(sizes) and got.factor == 1


@settings(max_examples=40, deadline=None)
@given(world=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_parts_that_sum_to_the_value_are_partial(world, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(world)]
    ref = torch.stack(parts).sum(0)
    got = infer_layout(ref, parts, CLOSE)
    assert got == Layout(LayoutKind.PARTIAL, world)


def test_a_data_parallel_step_maps_batch_loss_gradient_and_reduced_gradient():
    """A linear layer and a mean loss on a batch of 8: single process against 2 ranks of 4 rows each."""
    torch.manual_seed(0)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def step(xs, ys):
        out = xs @ w.t()
        loss = ((out - ys) ** 2).mean()
        (g,) = torch.autograd.grad(loss, w)
        return out.detach(), loss.detach(), g

    out, loss, grad = step(x, y)
    ranks = [step(x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4]) for r in range(2)]
    assert infer_layout(x, [x[:4], x[4:]], CLOSE).describe() == "sharded on dim 0 over 2 ranks (4+4)"
    assert infer_layout(out, [r[0] for r in ranks], CLOSE).kind is LayoutKind.SHARDED
    lay = infer_layout(loss, [r[1] for r in ranks], CLOSE)
    assert (lay.kind, lay.factor) == (LayoutKind.PARTIAL, Fraction(1, 2))
    assert lay.describe() == "partial over 2 ranks: the reference is their average (a per-rank mean)"
    local = [r[2] for r in ranks]
    assert (infer_layout(grad, local, CLOSE).kind, infer_layout(grad, local, CLOSE).factor) == \
        (LayoutKind.PARTIAL, Fraction(1, 2))
    averaged = [sum(local) / 2] * 2  # all-reduce, then divide by the world size: every rank holds the reference
    assert infer_layout(grad, averaged, CLOSE) == Layout(LayoutKind.REPLICATED, 2)
    doubled = [sum(local)] * 2  # the loss scaled by the world size a second time: every rank holds 2x
    lay = infer_layout(grad, doubled, CLOSE)
    assert (lay.kind, lay.factor) == (LayoutKind.REPLICATED, Fraction(1, 2))
    assert lay.describe() == "replicated on 2 ranks at 2x the reference"


def test_values_no_layout_explains_are_none():
    torch.manual_seed(1)
    ref = torch.randn(8, 3, dtype=torch.float64)
    assert infer_layout(ref, [ref[4:], ref[:4]], CLOSE) is None  # shards at each other's offsets
    parts = [torch.randn(8, 3, dtype=torch.float64) for _ in range(2)]
    assert infer_layout(parts[0] + parts[1], [parts[0], parts[0]], CLOSE) is None  # one part never reduced
    assert infer_layout(ref, [ref, ref * (1 + 1e-3)], CLOSE) is None  # a replica that drifted
    assert infer_layout(ref, [ref * 1.37, ref * 1.37], CLOSE) is None  # no simple factor
    assert infer_layout(ref, [ref * 3, ref * 3], CLOSE).factor == Fraction(1, 3)
    assert infer_layout(ref, [ref[:3], ref[3:7]], CLOSE) is None  # rows missing


def test_shapes_decide_the_candidates_plainest_first():
    kinds = [(c.kind, c.dim, c.factor) for c in candidates((8, 3), [(8, 3), (8, 3)])]
    assert kinds == [(LayoutKind.REPLICATED, None, 1), (LayoutKind.PARTIAL, None, 1), (LayoutKind.MAX, None, 1),
                     (LayoutKind.MIN, None, 1), (LayoutKind.NORM, None, 1)]
    assert [(c.kind, c.dim) for c in candidates((8, 3), [(4, 3), (4, 3)])][0] == (LayoutKind.SHARDED, 0)
    assert candidates((8, 3), [(4, 3), (3, 3)]) == []  # rows do not add up
    assert candidates((8, 3), [(8, 3)]) == [Layout(LayoutKind.REPLICATED, 1)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_must_match_in_place(bad):
    ref = torch.tensor([1.0, bad, 3.0, 4.0], dtype=torch.float64)
    assert infer_layout(ref, [ref[:2], ref[2:]], CLOSE).kind is LayoutKind.SHARDED
    moved = torch.tensor([bad, 1.0, 3.0, 4.0], dtype=torch.float64)
    assert infer_layout(ref, [moved[:2], moved[2:]], CLOSE) is None


def test_a_sharded_dim_flattened_with_an_outer_one_is_found_in_interleaved_blocks():
    """[seq, batch, d] with the batch sharded, viewed as [seq * batch, d] (as attention does): each rank's rows come
    in seq interleaved blocks."""
    torch.manual_seed(2)
    ref = torch.randn(12, 8, 32, dtype=torch.float64)
    parts = [ref[:, r * 4:(r + 1) * 4].reshape(48, 32) for r in range(2)]
    got = infer_layout(ref.reshape(96, 32), parts, CLOSE)
    assert (got.kind, got.dim, got.blocks) == (LayoutKind.SHARDED, 0, 12)
    assert "in 12 interleaved blocks" in got.describe()


def test_a_per_rank_max_reduced_by_a_max_is_the_max_layout():
    torch.manual_seed(3)
    parts = [torch.randn(5, dtype=torch.float64) for _ in range(3)]
    ref = torch.stack(parts).amax(0)
    assert infer_layout(ref, parts, CLOSE).kind is LayoutKind.MAX


ROWS, COLS = ((0, 1), (2, 3)), ((0, 2), (1, 3))  # a 2x2 mesh: rank d*2 + t at row d, column t


def test_a_value_over_a_2x2_mesh_is_found_through_its_rows_then_the_groups():
    """Rank (d, t) holds rows d and columns t of the reference (the batch over the mesh's rows' dimension, the
    hidden units over its columns'): each row of the mesh shards dim 1, the rows' parts join on dim 0."""
    ref = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    parts = [ref[d * 2:(d + 1) * 2, t * 3:(t + 1) * 3] for d in (0, 1) for t in (0, 1)]
    assert infer_layout(ref, parts, CLOSE) is None  # no layout over one dimension of 4 ranks
    fits = infer_mesh_layouts(ref, parts, CLOSE, (ROWS, COLS))
    first = fits[0]
    assert (first.kind, first.dim, first.groups, first.inner.kind, first.inner.dim) == \
        (LayoutKind.SHARDED, 0, ROWS, LayoutKind.SHARDED, 1)
    assert torch.equal(first.mapped(parts), ref)
    assert "each group (0/1, 2/3) holding its part sharded on dim 1" in first.describe()


def test_a_per_rank_mean_over_the_mesh_s_rows_is_partial_at_one_over_the_rows():
    """The loss: every rank of a mesh row holds its row's mean (replicated within the row), the reference is the
    average of the rows' means: partial over 2 groups at 1/2 (not over 4 ranks at 1/4)."""
    ref = torch.tensor(3.0, dtype=torch.float64)
    parts = [torch.tensor(v, dtype=torch.float64) for v in (2.0, 2.0, 4.0, 4.0)]
    fits = infer_mesh_layouts(ref, parts, CLOSE, (ROWS, COLS))
    row = next(f for f in fits if f.groups == ROWS)
    assert (row.kind, row.factor, row.inner.kind) == (LayoutKind.PARTIAL, Fraction(1, 2), LayoutKind.REPLICATED)
    # the columns' ranks do not agree within a column: no replicated part there
    assert not any(f.groups == COLS and f.inner.kind is LayoutKind.REPLICATED for f in fits)


def test_each_rank_s_norm_of_its_shard_is_a_norm_over_ranks_at_the_factor_of_its_values():
    g = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    norms = [part.norm() for part in g.tensor_split(3)]  # what clip_grad_norm_ computes on each rank's shard
    fits = infer_layouts(g.norm(), norms, rel_l2_close(1e-9))
    assert [(f.kind, f.factor) for f in fits] == [(LayoutKind.NORM, 1)]
    # the norm of gradients divided once too often is the norm over the ranks at 1/2x (said so), and one number is
    # not read as the ranks' sum at whatever ratio it happens to be of theirs (41/58x)
    fits = infer_layouts(2 * g.norm(), norms, rel_l2_close(1e-9))
    assert [(f.kind, f.factor) for f in fits] == [(LayoutKind.NORM, 2)]
    assert "is 1/2x the reference" in fits[0].describe()


def test_micro_batches_accumulated_on_each_rank_map_as_one_part_each_and_say_so():
    """Gradient accumulation on 2 ranks, 2 micro-batches each: the batch's rows are the 4 micro-batches joined in
    rank order, a gradient the sum of the 4 micro-batch gradients at 1/2 (each micro-batch's mean divided by 2, the
    rank's sum all-reduced and averaged over 2 ranks); the words name ranks and micro-batches, not 4 ranks."""
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(8, 3, generator=g, dtype=torch.float64)
    rows = list(batch.chunk(4))  # rank 0's micro-batches 0 and 1, then rank 1's
    sharded = infer_layout(batch, rows, CLOSE)
    assert sharded is not None and sharded.kind is LayoutKind.SHARDED and sharded.sizes == (2, 2, 2, 2)
    grad = batch.T @ torch.ones(8, 2, dtype=torch.float64) / 8  # of the mean over the global batch
    parts = [r.T @ torch.ones(2, 2, dtype=torch.float64) / 2 / 2 for r in rows]  # each micro-batch's mean / 2
    partial = infer_layout(grad, parts, CLOSE)
    assert partial is not None and partial.kind is LayoutKind.PARTIAL and partial.factor == Fraction(1, 2)
    said = Layout(partial.kind, 4, factor=partial.factor, passes=2).describe()
    assert "over 2 ranks x 2 micro-batches" in said and "4 ranks" not in said


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_rows_routed_to_experts_are_found_by_the_all_to_all_s_split_sizes(seed, data):
    """Tokens of 2 ranks, each grouped by the rank that holds their expert (a stable sort: in token order within a
    group): the single process's grouping over every token is block 0 of each rank in rank order, then block 1."""
    g = torch.Generator().manual_seed(seed)
    ranks = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (data.draw(st.integers(2, 7)),
                                                                            data.draw(st.integers(2, 7)))]
    expert = [torch.randint(0, 2, (len(x),), generator=g) for x in ranks]
    if any(int(e.sum()) in (0, len(e)) for e in expert):
        return  # every token of a rank to one expert: no exchange of two blocks
    parts = [x[torch.argsort(e, stable=True)] for x, e in zip(ranks, expert)]
    ref = torch.cat(ranks)[torch.argsort(torch.cat(expert), stable=True)]
    splits = tuple(tuple(int((e == k).sum()) for k in (0, 1)) for e in expert)
    # no layout of the shapes alone, but where the grouping is an even interleaving (1+1 and 1+1)
    assert all(f.kind is not LayoutKind.ROUTED for f in infer_layouts(ref, parts, CLOSE))
    got = [f for f in infer_layouts(ref, parts, CLOSE, exchanges=[((1, 1), (1, 1)), splits])
           if f.kind is LayoutKind.ROUTED]
    assert [(f.splits, f.factor) for f in got] == [(splits, 1)]
    got = got[0]
    assert torch.equal(got.assemble(parts), ref)
    assert "routed on dim 0 over 2 ranks" in got.describe()
    # the same rows in another grouping (the ranks' blocks swapped) are not routed
    swapped = tuple(s[::-1] for s in splits)
    assert not any(f.kind is LayoutKind.ROUTED for f in infer_layouts(
        ref, [torch.cat(p.split(list(s))[::-1]) for p, s in zip(parts, splits)], CLOSE, exchanges=[swapped]))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), counts=st.lists(st.integers(1, 4), min_size=8, max_size=8))
def test_rows_routed_to_several_experts_on_a_rank_are_found_by_the_counts_per_expert(seed, counts):
    """4 experts on 2 ranks, 2 on each: each rank's tokens grouped by expert (a stable sort), which groups them by
    the rank they are sent to too; the single process's grouping over every token is expert 0's rows of each rank
    in rank order, then expert 1's: blocks per expert (the counts the ranks exchange), not per destination rank."""
    g = torch.Generator().manual_seed(seed)
    per_rank = [counts[:4], counts[4:]]  # rank r's tokens for experts 0..3
    expert = [torch.tensor([e for e, n in enumerate(c) for _ in range(n)])[torch.randperm(sum(c), generator=g)]
              for c in per_rank]
    ranks = [torch.randn(len(e), 3, generator=g, dtype=torch.float64) for e in expert]
    parts = [x[torch.argsort(e, stable=True)] for x, e in zip(ranks, expert)]
    ref = torch.cat(ranks)[torch.argsort(torch.cat(expert), stable=True)]
    by_rank = tuple((c[0] + c[1], c[2] + c[3]) for c in per_rank)  # what the rows' all-to-all sends
    by_expert = tuple(tuple(c) for c in per_rank)  # what the all-to-all of the counts carries
    assert not any(f.kind is LayoutKind.ROUTED for f in infer_layouts(ref, parts, CLOSE, exchanges=[by_rank]))
    got = [f for f in infer_layouts(ref, parts, CLOSE, exchanges=[by_rank, by_expert]) if f.kind is LayoutKind.ROUTED]
    assert [(f.splits, f.factor) for f in got] == [(by_expert, 1)]
    assert torch.equal(got[0].assemble(parts), ref)
    said = got[0].describe()
    assert "grouped by the expert they are sent to (4 experts, 2 on each rank; rank 0: " \
           f"{'+'.join(map(str, per_rank[0]))}" in said


def test_a_value_one_rank_holds_is_that_rank_s_tensor():
    x = torch.randn(4, 2, dtype=torch.float64)
    held = Layout(LayoutKind.HELD, 2, holder=1)
    assert torch.equal(held.assemble([x]), x)
    assert held.describe() == "held whole by rank 1 alone, the rank that holds this expert"
    assert held.to_json()["holder"] == 1
